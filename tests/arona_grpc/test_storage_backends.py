"""The episode index and the writeback outbox on both backends: SQLite files and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from arona_common.database import PG_MIGRATIONS, apply_migrations, open_pool
from arona_common.redact import redact_url
from arona_grpc.config import Settings
from arona_grpc.episodes import EpisodeIndex, Whose, open_index
from arona_grpc.outbox import OutboxEntry, PostgresOutbox, entry_bytes, open_outbox
from arona_grpc.outbox.postgres import PG_PUT_UNLESS_QUEUED
from arona_grpc.outbox.sqlite import SQLITE_HAS
from arona_grpc.service import MemoryDomain, MemoryUnavailable, ScopeModeRefused
from tests.support.erasure import files_holding, tables_holding
from tests.support.fake_philia import STORE, FakePhilia, Step

pytestmark = pytest.mark.asyncio


def _alice() -> str:
    from arona_grpc.scopes import scope_id

    return scope_id("alice")


TOKEN = "backend-test-token"


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


def settings_for(
    fake: FakePhilia, tmp_path: Path, backend: str | None, **overrides: Any
) -> Settings:
    base = Settings(
        memory_url=fake.url,
        memory_token=TOKEN,
        memory_timeout_s=1.0,
        data_dir=tmp_path,
        database_url=backend,
    )
    return dataclasses.replace(base, **overrides)


async def test_the_index_pages_and_forgets_on_each_backend(
    tmp_path: Path, backend: str | None, pool: Any
) -> None:
    index: EpisodeIndex = open_index(tmp_path, pool, backend)
    try:
        for i in range(5):
            index.record(f"n-{i}", "s1", f"episode {i}")
        index.record("x-1", "s2", "another scope")
        index.record("n-1", "s1", "episode 1 again")
        first = await index.page("s1", 3, None)
        assert [e.node_id for e in first.episodes] == ["n-1", "n-4", "n-3"]
        assert first.episodes[0].preview == "episode 1 again"
        rest = await index.page("s1", 3, first.next)
        assert ([e.node_id for e in rest.episodes], rest.next) == (["n-2", "n-0"], None)
        assert await index.owner("x-1") == "s2"
        assert await index.owner("nope") is None
        await index.remove(["n-4", "nope"])
        assert await index.node_ids(Whose(scope_id="s1")) == ["n-1", "n-3", "n-2", "n-0"]
    finally:
        await index.aclose()


async def test_the_outbox_is_a_bounded_fifo_on_each_backend(
    tmp_path: Path, backend: str | None, pool: Any, fake: FakePhilia
) -> None:
    three = 3 * entry_bytes("episode 0", "episode", "s0", "")
    settings = settings_for(fake, tmp_path, backend, memory_outbox_max_bytes=three)
    outbox = open_outbox(settings, pool)
    try:
        await outbox.load()
        assert not outbox.pending
        for i in range(5):
            await outbox.put(f"episode {i}", "episode", f"s{i}")
        assert (outbox.depth, outbox.dropped, outbox.bytes) == (3, 2, three)
        [entry] = await outbox.oldest()
        assert (entry.text, entry.scope_id) == ("episode 2", "s2")
        await outbox.remove(entry.seq)
        assert outbox.depth == 2
    finally:
        await outbox.aclose()


async def test_an_episode_sent_again_is_found_by_the_index_on_each_backend(
    tmp_path: Path, backend: str | None, pool: Any, fake: FakePhilia
) -> None:
    """During an outage every writeback asks whether its episode is queued already: that must
    be an index lookup, not a read of the whole outbox (16 ms a writeback at 100,000)."""
    outbox = open_outbox(settings_for(fake, tmp_path, backend), pool)
    try:
        await outbox.load()
        for i in range(20):
            await outbox.put(f"episode {i}", "episode", "", f"id-{i}")
        await outbox.put("an episode without an id", "episode", "")
        again = await outbox.put("episode 7", "episode", "", "id-7", unless_queued=True)
        assert (again, outbox.depth) == (None, 21)
        new = await outbox.put("episode 404", "episode", "", "id-404", unless_queued=True)
        assert new is not None and outbox.depth == 22
        # Without an id nothing is "the same episode": both are kept.
        for _ in range(2):
            assert await outbox.put("no id", "episode", "", "", unless_queued=True) is not None
        assert outbox.depth == 24
    finally:
        await outbox.aclose()
    if backend is None:
        with contextlib.closing(sqlite3.connect(tmp_path / "outbox.db")) as db:
            plan = " ".join(
                row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {SQLITE_HAS}", ("x",))
            )
        assert "INDEX episodes_by_id" in plan, plan
    else:
        conn = await asyncpg.connect(backend)
        try:
            # The plan asyncpg's prepared statement gets once PostgreSQL stops re-planning
            # per value; with sequential scans priced out, it uses any index that can serve.
            await conn.execute("SET plan_cache_mode = force_generic_plan")
            await conn.execute("SET enable_seqscan = off")
            await conn.execute(
                "PREPARE put_episode(text, text, text, bigint, text, bigint, bigint, text)"
                f" AS {PG_PUT_UNLESS_QUEUED}"
            )
            rows = await conn.fetch("EXPLAIN EXECUTE put_episode('t', 'e', '', 1, 'x', 1, 1, '')")
        finally:
            await conn.close()
        plan = " ".join(row[0] for row in rows)
        assert "outbox_by_episode" in plan, plan


async def test_two_replicas_claim_different_episodes_and_a_dead_ones_claims_run_out(
    database_url: str,
) -> None:
    pool = await open_pool(database_url)
    try:
        alive = PostgresOutbox(pool, database_url, 2**20, claim_s=60)
        dead = PostgresOutbox(pool, database_url, 2**20, claim_s=0.2)
        for i in range(4):
            await alive.put(f"episode {i}", "episode")
        first = await dead.oldest()
        second = await alive.oldest(2)
        # Oldest first, and never the same episode twice while claimed.
        assert [e.text for e in first + second] == ["episode 0", "episode 1", "episode 2"]
        # The claimant of episode 0 never comes back; its claim runs out (bounded wait).
        third: list[OutboxEntry] = []
        for _ in range(100):
            third = await alive.oldest()
            if third and third[0].text == "episode 0":
                break
            await alive.release(*(e.seq for e in third))
            await asyncio.sleep(0.05)
        assert [e.text for e in third] == ["episode 0"]
        # A failed store gives its episodes back at once.
        await alive.release(*(e.seq for e in second))
        again = await alive.oldest(5)
        assert [e.text for e in again] == ["episode 1", "episode 2", "episode 3"]
    finally:
        await pool.close()


async def test_a_replica_replays_what_another_queued_each_once(
    tmp_path: Path, database_url: str, fake: FakePhilia
) -> None:
    settings = settings_for(fake, tmp_path / "a", database_url, memory_breaker_failures=1)
    pool = await open_pool(database_url)
    try:
        queuing = MemoryDomain(settings, pool=pool)
        fake.script(STORE, Step(error=(-32603, "down")))
        for i in range(4):
            with pytest.raises(MemoryUnavailable, match="queued in the outbox"):
                await queuing.writeback(f"fact {i}", "", "alice")
        # The replica goes away with its episodes queued (no shutdown grace for replay).
        await queuing.aclose(grace_s=0)
        other = MemoryDomain(
            dataclasses.replace(settings, data_dir=tmp_path / "b", memory_breaker_failures=3),
            pool=pool,
        )
        try:
            await other.start()
            stores = await fake.wait_frames(STORE, 5)
            assert [f["params"]["text"] for f in stores[1:]] == [
                f"User: fact {i}" for i in range(4)
            ]
        finally:
            # Shutdown lets the replay finish the episode it is on.
            await other.aclose()
        # Stored once each, and listed for their owner by the shared index.
        assert len(fake.frames_of(STORE)) == 5
        index = open_index(tmp_path, pool, database_url)
        try:
            previews = [e.preview for e in (await index.page(_alice(), 10, None)).episodes]
        finally:
            await index.aclose()
        assert previews == [f"User: fact {i}" for i in (3, 2, 1, 0)]
    finally:
        await pool.close()


async def test_migrations_apply_once_under_concurrent_starts(database_url: str) -> None:
    pools = await asyncio.gather(*(open_pool(database_url, migrate=False) for _ in range(4)))
    try:

        async def migrate(pool: Any) -> int:
            async with pool.acquire() as conn:
                return len(await apply_migrations(conn))

        applied = await asyncio.gather(*(migrate(pool) for pool in pools))
        assert sorted(applied) == [0, 0, 0, len(PG_MIGRATIONS)]
        async with pools[0].acquire() as conn:
            versions = [r[0] for r in await conn.fetch("SELECT version FROM arona_schema")]
        assert versions == [m.version for m in PG_MIGRATIONS]
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))


async def test_a_shared_index_says_written_only_once_its_entry_is_committed(
    tmp_path: Path, database_url: str
) -> None:
    # Another replica's List reads the table: a writeback must not be answered before
    # its entry is committed there.
    pool = await open_pool(database_url)
    index = open_index(tmp_path, pool, database_url)
    blocker = await asyncpg.connect(database_url)
    try:
        held = blocker.transaction()
        await held.start()
        await blocker.execute("LOCK TABLE episodes IN ACCESS EXCLUSIVE MODE")
        index.record("n-1", "s1", "an episode")
        written = asyncio.create_task(index.written())
        # Bounded: until the index's write waits for the lock (no event says so).
        for _ in range(500):
            if await blocker.fetchval(
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND relation = 'episodes'::regclass"
            ):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the index never tried to write")
        assert not written.done()
        await held.rollback()
        await asyncio.wait_for(written, 10)
        other = await asyncpg.connect(database_url)
        try:
            assert (
                await other.fetchval("SELECT scope_id FROM episodes WHERE node_id = 'n-1'") == "s1"
            )
        finally:
            await other.close()
        # Nothing on its way: at once.
        await asyncio.wait_for(index.written(), 10)
    finally:
        await blocker.close()
        await index.aclose()
        await pool.close()


async def test_shared_mode_refuses_an_index_that_holds_one_users_episodes(
    tmp_path: Path, backend: str | None, pool: Any, fake: FakePhilia
) -> None:
    shared = settings_for(fake, tmp_path, backend)
    per_user = dataclasses.replace(shared, memory_scope="user")
    # Shared mode indexes a caller's own episodes too: those are no reason to refuse.
    domain = MemoryDomain(shared, pool=pool)
    await domain.writeback("I like oolong", "noted", "alice")
    await domain.check_scope_mode()
    await domain.aclose()
    domain = MemoryDomain(per_user, pool=pool)
    await domain.writeback("My locker code is 4417", "noted", "alice")
    await domain.check_scope_mode()
    await domain.aclose()
    domain = MemoryDomain(shared, pool=pool)
    try:
        with pytest.raises(ScopeModeRefused) as refused:
            await domain.check_scope_mode()
    finally:
        await domain.aclose()
    where = (
        f"{tmp_path / 'episodes.db'}"
        if backend is None
        else f"the episode index in {redact_url(backend)}"
    )
    assert str(refused.value) == (
        f"{where} holds per-user memories (stored with ARONA_MEMORY_SCOPE=user), which shared "
        "mode would show to every caller: set ARONA_MEMORY_SCOPE=user; or forget them (run it "
        "with ARONA_MEMORY_SCOPE=user, then `arona-gateway forget --all` beside it) and start "
        "again; or, for a new shared memory, use "
        f"{'another ARONA_DATA_DIR' if backend is None else 'another database'}"
    )
    # Once its owner forgot it, the index holds nothing of one user alone.
    domain = MemoryDomain(per_user, pool=pool)
    assert await domain.forget("alice") == 2
    await domain.aclose()
    domain = MemoryDomain(shared, pool=pool)
    await domain.check_scope_mode()
    await domain.aclose()


async def test_a_fresh_data_directory_gets_no_index_file_from_the_check(
    tmp_path: Path, fake: FakePhilia
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path, None), pool=None)
    await domain.check_scope_mode()
    await domain.aclose()
    assert not (tmp_path / "episodes.db").exists()


async def test_forgetting_a_principal_erases_its_queued_and_refused_episodes_and_events(
    tmp_path: Path, backend: str | None, pool: Any, fake: FakePhilia
) -> None:
    # Philia refuses one of alice's episodes for what it is (a dead letter), then fails: the
    # breaker opens and the rest wait in the outbox, a user alice narrowed to and bob's too.
    words = ["Ferrowhisp", "Glenquartz", "Ombrelline", "Tisselbrook"]
    settings = settings_for(
        fake,
        tmp_path,
        backend,
        memory_scope="user",
        memory_breaker_failures=1,
        memory_breaker_cooldown_s=60.0,
    )
    domain = MemoryDomain(settings, pool=pool)
    try:
        await domain.recall(f"Where did I put the {words[0]}?", scope="alice/mia")
        fake.script(
            STORE, Step(error=(-32602, "invalid episode")), Step(error=(-32603, "disk busy"))
        )
        for text, scope in ((words[1], "alice"), (words[2], "alice"), (words[3], "alice/mia")):
            with pytest.raises(Exception, match="dead-letter|outbox"):
                await domain.writeback(f"Remember {text}", "noted", scope)
        with pytest.raises(MemoryUnavailable):
            await domain.writeback("My dog is called Marrowfinch", "noted", "bob")
        status = domain.status(100)
        assert (status.outbox_depth, status.dead_letters) == (3, 1)
        assert any(words[0] in event.detail for event in status.events)

        assert await domain.forget(principal="alice") == 0
        status = domain.status(100)
        assert status.outbox_depth == 1
        assert [d.scope_id for d in status.recent_dead_letters] == []
        assert not [e for e in status.events if any(w in e.detail for w in words)]
    finally:
        await domain.aclose()
    if backend is None:
        assert files_holding(tmp_path, words) == {}
        assert set(files_holding(tmp_path, ["Marrowfinch"])) <= {"outbox.db", "outbox.db-wal"}
    else:
        assert await tables_holding(backend, [*words, "Marrowfinch"]) == {"outbox": ["Marrowfinch"]}


async def test_what_one_replica_forgot_leaves_the_others_events(
    tmp_path: Path, database_url: str, fake: FakePhilia
) -> None:
    settings = settings_for(fake, tmp_path, database_url, memory_scope="user")
    pool = await open_pool(database_url)
    first = MemoryDomain(settings, pool=pool)
    second = MemoryDomain(dataclasses.replace(settings, data_dir=tmp_path / "second"), pool=pool)
    try:
        await second.recall("What is Quillbramble?", scope="alice")
        await second.recall("What is Hopscrawl?", scope="bob")
        assert await first.forget(scope="alice") == 0
        await second.clear_erased_events()
        details = [event.detail for event in second.status(100).events]
        assert details == ["What is Hopscrawl?"]
    finally:
        await first.aclose()
        await second.aclose()
        await pool.close()
