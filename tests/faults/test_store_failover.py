"""One of two store processes SIGKILLed under load: memory stays enabled, no answered turn lost.

Real processes on loopback: two store processes (``arona-gateway store``) serving the same
memories, on each backend: on one data directory (one SQLite file), and on one PostgreSQL
database with pgvector; and the gateway (``arona-gateway serve``, the echo model) given both
URLs.
Chat turns arrive at :data:`RATE` a second from :data:`CONCURRENCY` clients; the first store is
killed with SIGKILL in the middle of them. No turn may answer ``offline`` (the other store
serves every recall, and the calls the kill cut are made again there), every turn answered 200
must be in the database afterwards, and ``memory.status`` must name the killed store.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from gateway_http.auth import mint_token
from tests.faults.processes import TOKEN, Gateway, Load, Store, wait_stored

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

RATE = 40.0
CONCURRENCY = 8
BEFORE = 40
AFTER = 120
JWT_SECRET = "a-jwt-secret-for-the-failover-test-0123456789"
# Every answered turn reaches the database within seconds; the bound is for a loaded box.
DRAIN_S = 60.0


async def _stored(store: Store, words: set[str]) -> set[str]:
    """Those of ``words`` still missing from ``store``'s memories after :data:`DRAIN_S`."""
    if store.database_url is None:
        return await wait_stored(store.db, words, DRAIN_S)
    from tests.faults.test_pg_store import stored_words

    deadline = time.monotonic() + DRAIN_S
    missing = words - await stored_words(store.database_url)
    while missing and time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # another process: its database is read again
        missing = words - await stored_words(store.database_url)
    return missing


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_store_killed_under_load_keeps_memory_enabled_and_loses_nothing(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    logs = tmp_path / "logs"
    url = request.getfixturevalue("store_database_url") if backend == "postgres" else None
    one = Store(tmp_path / "store", logs, database_url=url)
    two = Store(tmp_path / "store", logs, database_url=url)
    gateway = Gateway(
        tmp_path / "gateway",
        logs,
        f"{one.url},{two.url}",
        env={"ARONA_JWT_SECRET": JWT_SECRET},
    )
    load = Load(RATE, CONCURRENCY, max_turns=BEFORE + AFTER + 100)
    running: asyncio.Task[None] | None = None
    try:
        await one.start()
        await two.start()
        await gateway.start()
        load.point_at(gateway.url)
        running = asyncio.create_task(load.run())
        await load.wait_answered(BEFORE, 120)
        await one.kill()
        await load.wait_answered(BEFORE + AFTER, 120)
        load.stop.set()
        await running
        assert load.failed == 0
        assert load.offline == 0, f"{load.offline} of {len(load.answered)} turns were offline"
        missing = await _stored(two, load.words)
        assert not missing, f"{len(missing)} of {len(load.answered)} answered turns not stored"

        async with httpx.AsyncClient(timeout=30) as client:
            jwt = mint_token(JWT_SECRET, "ops", 600)
            reply = await client.post(
                f"{gateway.url}/api/rpc",
                json={"jsonrpc": "2.0", "id": 1, "method": "memory.status"},
                headers={"Authorization": f"Bearer {jwt}"},
            )
        stores = reply.json()["result"]["stores"]
        assert [(s["url"], s["state"]) for s in stores] == [(one.url, "down"), (two.url, "up")]
        assert stores[0]["error"] and TOKEN not in reply.text
    finally:
        load.stop.set()
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
        await gateway.stop()
        await two.stop()
        await one.stop()
