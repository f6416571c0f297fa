"""Outbox: a bounded FIFO (a SQLite file, or a PostgreSQL table: every test runs on both
backends but the one about the file), and the domain's shutdown keeping in-flight episodes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from arona_grpc import outbox as outbox_module
from arona_grpc.config import Settings
from arona_grpc.database import sqlite_migrate
from arona_grpc.outbox import AnyOutbox, Outbox, OutboxClosed, open_outbox
from arona_grpc.service import MemoryDomain, MemoryUnavailable
from tests.support.fake_philia import STORE, FakePhilia, Step
from tests.support.log_watch import watching

pytestmark = pytest.mark.asyncio

TOKEN = "t0k3n"


@dataclasses.dataclass
class Backend:
    """Opens outboxes and domains on one backend (``url`` None: SQLite under ``data_dir``)."""

    data_dir: Path
    url: str | None
    pool: Any

    def outbox(self, max_entries: int) -> AnyOutbox:
        settings = Settings(
            data_dir=self.data_dir, memory_outbox_max=max_entries, database_url=self.url
        )
        return open_outbox(settings, self.pool)


@pytest.fixture
def on(tmp_path: Path, backend: str | None, pool: Any) -> Backend:
    return Backend(tmp_path, backend, pool)


async def texts_of(outbox: AnyOutbox) -> list[str]:
    found = []
    for _ in range(outbox.depth):
        entry = await outbox.oldest()
        assert entry is not None
        found.append(entry.text)
        await outbox.remove(entry.seq)
    return found


async def test_nothing_is_created_until_an_episode_is_kept(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "data", 10)
    await outbox.load()
    assert (outbox.depth, outbox.dropped, outbox.pending) == (0, 0, False)
    assert not (tmp_path / "data").exists()
    await outbox.aclose()


async def test_fifo_across_a_reopen(on: Backend) -> None:
    outbox = on.outbox(10)
    first = outbox.put("one", "episode")
    assert outbox.pending  # visible before the write commits
    seqs = [await first, await outbox.put("two", "episode"), await outbox.put("three", "x")]
    assert seqs == sorted(seqs)
    await outbox.aclose()
    with pytest.raises(OutboxClosed):
        outbox.put("late", "episode")

    again = on.outbox(10)
    await again.load()
    assert again.depth == 3
    entry = await again.oldest()
    assert entry is not None and (entry.text, entry.node_type) == ("one", "episode")
    # Looked at, not stored: given back (another replica may claim it then).
    await again.release(entry.seq)
    assert await texts_of(again) == ["one", "two", "three"]
    assert again.depth == 0
    await again.aclose()


async def test_overflow_drops_the_oldest_and_counts_them_across_restarts(on: Backend) -> None:
    outbox = on.outbox(3)
    for i in range(5):
        await outbox.put(f"e{i}", "episode")
    assert (outbox.depth, outbox.dropped) == (3, 2)
    await outbox.aclose()

    again = on.outbox(3)
    await again.load()
    assert (again.depth, again.dropped) == (3, 2)
    assert await texts_of(again) == ["e2", "e3", "e4"]
    await again.aclose()


async def test_an_episode_keeps_when_it_happened_across_a_reopen(on: Backend) -> None:
    outbox = on.outbox(10)
    before_us = int(time.time() * 1_000_000)
    await outbox.put("dated", "episode", occurred_us=1_683_554_160_000_000)
    await outbox.put("undated", "episode")
    after_us = int(time.time() * 1_000_000)
    await outbox.aclose()

    again = on.outbox(10)
    await again.load()
    dated = await again.oldest()
    assert dated is not None and (dated.text, dated.occurred_us) == (
        "dated",
        1_683_554_160_000_000,
    )
    await again.remove(dated.seq)
    undated = await again.oldest()
    # Queued without a time: dated when it was queued.
    assert undated is not None and before_us <= undated.occurred_us <= after_us
    await again.aclose()


async def test_an_outbox_of_an_earlier_version_replays_with_the_queued_time(
    tmp_path: Path,
) -> None:
    path = tmp_path / "outbox.db"
    db = sqlite3.connect(path, isolation_level=None)
    sqlite_migrate(db, outbox_module._SQLITE_STEPS[:3], "an outbox of version 3")
    db.execute(
        "INSERT INTO episodes (text, node_type, queued_us, scope_id, episode_id)"
        " VALUES ('from before', 'episode', 1600000000000000, '', '')"
    )
    db.close()
    outbox = Outbox(tmp_path, 10)
    await outbox.load()
    entry = await outbox.oldest()
    assert entry is not None and (entry.text, entry.occurred_us) == (
        "from before",
        1_600_000_000_000_000,
    )
    await outbox.aclose()


async def test_a_full_outbox_warns_once_not_on_every_drop(on: Backend) -> None:
    outbox = on.outbox(3)
    with watching("arona_grpc.outbox") as seen:
        for i in range(50):
            await outbox.put(f"e{i}", "episode")
    assert (outbox.depth, outbox.dropped) == (3, 47)
    assert [r.getMessage() for r in seen.at_least(logging.WARNING)] == [
        "outbox full: dropped 1 oldest episode(s) (1 in all)"
    ]
    # Each drop is still a debug record.
    assert len(seen.matching("outbox full")) == 47
    await outbox.aclose()


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


def settings_for(fake: FakePhilia, on: Backend, **overrides: object) -> Settings:
    base = Settings(
        memory_url=fake.url,
        memory_token=TOKEN,
        memory_timeout_s=5.0,
        data_dir=on.data_dir,
        database_url=on.url,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


async def test_shutdown_keeps_an_in_flight_writeback_for_the_next_start(
    fake: FakePhilia, on: Backend
) -> None:
    fake.script(STORE, Step(action="hang"))
    domain = MemoryDomain(settings_for(fake, on), pool=on.pool)
    await domain.start()
    in_flight = asyncio.ensure_future(domain.writeback("remember me", "noted"))
    await fake.wait_frames(STORE)

    await domain.aclose(grace_s=0.1)
    with pytest.raises(MemoryUnavailable):
        await in_flight
    assert domain.status().outbox_depth == 1
    assert fake.stored == []

    restarted = MemoryDomain(settings_for(fake, on), pool=on.pool)
    await restarted.start()
    await asyncio.wait_for(fake.wait_frames(STORE, 2), 5)
    await restarted.aclose()
    assert [s["text"] for s in fake.stored] == ["User: remember me\nAssistant: noted"]
    assert restarted.status().outbox_depth == 0


async def test_cancelled_writeback_is_kept(fake: FakePhilia, on: Backend) -> None:
    fake.script(STORE, Step(action="hang"))
    domain = MemoryDomain(settings_for(fake, on), pool=on.pool)
    try:
        call = asyncio.ensure_future(domain.writeback("u", "a"))
        await fake.wait_frames(STORE)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        outbox = domain.outbox
        assert outbox is not None and outbox.depth == 1
    finally:
        await domain.aclose(grace_s=0.1)


async def test_writeback_while_open_fails_fast_and_is_queued(fake: FakePhilia, on: Backend) -> None:
    await fake.stop()  # refused
    domain = MemoryDomain(
        settings_for(fake, on, memory_breaker_failures=1, memory_breaker_cooldown_s=60.0),
        pool=on.pool,
    )
    try:
        with pytest.raises(MemoryUnavailable, match="queued in the outbox"):
            await domain.writeback("one", "")
        with pytest.raises(MemoryUnavailable, match="breaker open"):
            await domain.writeback("two", "")
        snapshot = domain.status()
        assert snapshot.breaker.value == "open"
        assert snapshot.breaker_opened_at is not None
        assert snapshot.outbox_depth == 2
        with pytest.raises(MemoryUnavailable, match="breaker open"):
            await domain.delete("n-1")
    finally:
        await domain.aclose(grace_s=0.1)


async def test_an_episode_sent_again_during_an_outage_is_queued_once(
    fake: FakePhilia, on: Backend
) -> None:
    await fake.stop()  # refused
    domain = MemoryDomain(
        settings_for(fake, on, memory_breaker_failures=1, memory_breaker_cooldown_s=60.0),
        pool=on.pool,
    )
    try:
        for text, episode_id in [("one", "ep-1"), ("two", "ep-2"), ("one", "ep-1")]:
            with pytest.raises(MemoryUnavailable) as info:
                await domain.writeback(text, "", episode_id=episode_id)
            # Queued either way: the caller (the HTTP layer's journal) may let it go.
            assert info.value.queued
        assert "already queued" in str(info.value)
        assert domain.status().outbox_depth == 2
    finally:
        await domain.aclose(grace_s=0.1)
