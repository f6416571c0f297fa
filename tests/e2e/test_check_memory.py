"""``arona-gateway check-memory``, run as a real process against real Philia servers."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from arona_store.server import StoreServer
from tests.support.fake_philia import DELETE, QUERY, STORE, FakePhilia
from tests.support.raw_philia import closed_port

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
TOKEN = "check-memory-token-0123"


class FilterBlindPhilia(FakePhilia):
    """A Philia that keeps what it is given but ignores ``node_type_filter``."""

    def _default(self, method: str, params: dict[str, Any]) -> Any:
        if method == QUERY:
            results = [
                {"node_type": p["node_type"], "text": p["text"], "score": 0.5} for p in self.stored
            ]
            return {"query": params.get("query"), "total": len(results), "results": results}
        return super()._default(method, params)


async def check_memory(data_dir: Path, **extra: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(data_dir), **extra)
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "check-memory",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_the_embedded_store_isolates_users(tmp_path: Path) -> None:
    store = await StoreServer.start(db_path=tmp_path / "memory.db", token=TOKEN)
    try:
        code, out = await check_memory(
            tmp_path, ARONA_MEMORY_URL=store.url, ARONA_MEMORY_TOKEN=TOKEN
        )
        assert code == 0, out
        assert "isolates users" in out and "NOT" not in out
        assert TOKEN not in out
        # The probes were deleted.
        assert store.store.count() == 0
    finally:
        await store.stop()


async def test_a_philia_that_ignores_the_filter_fails_the_check(tmp_path: Path) -> None:
    async with FilterBlindPhilia(token=TOKEN) as philia:
        code, out = await check_memory(
            tmp_path, ARONA_MEMORY_URL=philia.url, ARONA_MEMORY_TOKEN=TOKEN
        )
        assert code == 1, out
        assert "does NOT isolate users" in out
        assert "scope a's recall returned scope b's probe" in out
        # Each probe went out with its own scoped node type, and both were deleted again.
        stores = philia.frames_of(STORE)
        assert len({f["params"]["node_type"] for f in stores}) == 2
        assert all(f["params"]["node_type"].startswith("episode:") for f in stores)
        queries = philia.frames_of(QUERY)
        assert {q["params"]["node_type_filter"] for q in queries} == {
            f["params"]["node_type"] for f in stores
        }
        assert sorted(f["params"]["node_id"] for f in philia.frames_of(DELETE)) == ["n-1", "n-2"]


async def test_an_unreachable_philia_cannot_pass(tmp_path: Path) -> None:
    code, out = await check_memory(
        tmp_path, ARONA_MEMORY_URL=f"ws://127.0.0.1:{closed_port()}/ws", ARONA_MEMORY_TOKEN=TOKEN
    )
    assert code == 1
    assert "cannot tell" in out and "Traceback" not in out
    assert TOKEN not in out


async def test_without_a_configured_philia_it_says_so_in_one_line(tmp_path: Path) -> None:
    code, out = await check_memory(tmp_path)
    assert code == 2
    assert out.strip().splitlines() == [
        "arona-gateway: error: ARONA_MEMORY_URL and ARONA_MEMORY_TOKEN must be set: "
        "there is no Philia to check"
    ]


async def test_each_of_several_stores_is_checked(tmp_path: Path) -> None:
    store = await StoreServer.start(db_path=tmp_path / "memory.db", token=TOKEN)
    try:
        async with FilterBlindPhilia(token=TOKEN) as blind:
            code, out = await check_memory(
                tmp_path, ARONA_MEMORY_URL=f"{store.url},{blind.url}", ARONA_MEMORY_TOKEN=TOKEN
            )
        # One store that leaks is enough to fail: turns go to every store in the list.
        assert code == 1, out
        assert f"{store.url} isolates users" in out
        assert f"{blind.url} does NOT isolate users" in out
        assert TOKEN not in out
        assert store.store.count() == 0
    finally:
        await store.stop()
