"""``arona-gateway serve --workers 2``: two HTTP processes on one port, the gRPC service in a
third, the SQLite files shared, SIGTERM draining all of them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")


def _children(pid: int) -> list[str]:
    """The command lines of a process's children (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == pid:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return found


async def test_two_workers_share_one_port_and_one_conversation_database(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(tmp_path), ARONA_HTTP_PORT="0", ARONA_GRPC_PORT="0")
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "serve",
        "--workers",
        "2",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    log: list[str] = []
    url = None
    try:
        while url is None:
            raw = await asyncio.wait_for(process.stderr.readline(), 60)
            assert raw, "\n".join(log)
            log.append(raw.decode().rstrip())
            found = re.search(r"serving on (http://\S+) \(2 HTTP workers\)", log[-1])
            url = found.group(1) if found else None
        drain = asyncio.create_task(_drain(process, log))
        children = _children(process.pid)
        assert sum("--only http" in c for c in children) == 2, children
        assert sum("--only grpc" in c for c in children) == 1, children

        # Fresh connections land on either worker; the conversation is one for both.
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            conversation = (await client.post("/v1/conversations", json={})).json()["id"]
        for i in range(20):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "echo",
                        "conversation_id": conversation,
                        "memory": False,
                        "messages": [{"role": "user", "content": f"turn {i}"}],
                    },
                )
                assert response.status_code == 200
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            history = (await client.get(f"/v1/conversations/{conversation}")).json()["messages"]
        assert [m["content"] for m in history if m["role"] == "user"] == [
            f"turn {i}" for i in range(20)
        ]
        # Both workers started their app (each logs its own start-up).
        assert sum("Application startup complete" in line for line in log) == 2
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 60)
    await drain
    assert process.returncode == 0, "\n".join(log)
    assert _children(process.pid) == []
    assert "Traceback" not in "\n".join(log)
    assert sum("Application shutdown complete" in line for line in log) == 2


async def _drain(process: asyncio.subprocess.Process, log: list[str]) -> None:
    assert process.stderr is not None
    async for raw in process.stderr:
        log.append(raw.decode().rstrip())
