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

from arona_common.database import sqlite_migrate
from arona_grpc.config import Settings
from arona_grpc.outbox import AnyOutbox, Outbox, OutboxClosed, entry_bytes, open_outbox
from arona_grpc.outbox import sqlite as outbox_module
from arona_grpc.service import InvalidArgument, MemoryDomain, MemoryUnavailable
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

    def outbox(self, max_bytes: int = 2**20) -> AnyOutbox:
        settings = Settings(
            data_dir=self.data_dir, memory_outbox_max_bytes=max_bytes, database_url=self.url
        )
        return open_outbox(settings, self.pool)


# Room for three episodes like "e0" (the same size each).
THREE = 3 * entry_bytes("e0", "episode", "", "")


@pytest.fixture
def on(tmp_path: Path, backend: str | None, pool: Any) -> Backend:
    return Backend(tmp_path, backend, pool)


async def texts_of(outbox: AnyOutbox) -> list[str]:
    """Every episode's text, oldest first, taking them out in batches of two."""
    found = []
    while batch := await outbox.oldest(2):
        found += [entry.text for entry in batch]
        await outbox.remove(*(entry.seq for entry in batch))
    return found


async def test_nothing_is_created_until_an_episode_is_kept(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "data", 2**20)
    await outbox.load()
    assert (outbox.depth, outbox.dropped, outbox.pending) == (0, 0, False)
    assert not (tmp_path / "data").exists()
    await outbox.aclose()


async def test_fifo_across_a_reopen(on: Backend) -> None:
    outbox = on.outbox()
    first = outbox.put("one", "episode")
    assert outbox.pending  # visible before the write commits
    seqs = [await first, await outbox.put("two", "episode"), await outbox.put("three", "x")]
    assert seqs == sorted(seqs)
    await outbox.aclose()
    with pytest.raises(OutboxClosed):
        outbox.put("late", "episode")

    again = on.outbox()
    await again.load()
    assert again.depth == 3
    [entry] = await again.oldest()
    assert (entry.text, entry.node_type) == ("one", "episode")
    # Looked at, not stored: given back (another replica may claim it then).
    await again.release(entry.seq)
    assert await texts_of(again) == ["one", "two", "three"]
    assert again.depth == 0
    await again.aclose()


async def test_overflow_drops_the_oldest_and_counts_them_across_restarts(on: Backend) -> None:
    outbox = on.outbox(THREE)
    for i in range(5):
        await outbox.put(f"e{i}", "episode")
    assert (outbox.depth, outbox.dropped, outbox.bytes) == (3, 2, THREE)
    await outbox.aclose()

    again = on.outbox(THREE)
    await again.load()
    assert (again.depth, again.dropped) == (3, 2)
    assert await texts_of(again) == ["e2", "e3", "e4"]
    await again.aclose()


async def test_an_episode_keeps_when_it_happened_across_a_reopen(on: Backend) -> None:
    outbox = on.outbox()
    before_us = int(time.time() * 1_000_000)
    await outbox.put("dated", "episode", occurred_us=1_683_554_160_000_000)
    await outbox.put("undated", "episode")
    after_us = int(time.time() * 1_000_000)
    await outbox.aclose()

    again = on.outbox()
    await again.load()
    dated, undated = await again.oldest(2)
    assert (dated.text, dated.occurred_us) == ("dated", 1_683_554_160_000_000)
    # Queued without a time: dated when it was queued.
    assert undated.text == "undated" and before_us <= undated.occurred_us <= after_us
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
    outbox = Outbox(tmp_path, 2**20)
    await outbox.load()
    # Its bytes are counted once the file is brought up to date.
    assert outbox.bytes == entry_bytes("from before", "episode", "", "")
    [entry] = await outbox.oldest()
    assert (entry.text, entry.occurred_us) == ("from before", 1_600_000_000_000_000)
    await outbox.aclose()


async def test_a_full_outbox_warns_once_not_on_every_drop(on: Backend) -> None:
    outbox = on.outbox(THREE)
    with watching("arona_grpc.outbox") as seen:
        for i in range(50):
            await outbox.put(f"e{i % 10}", "episode")
    assert (outbox.depth, outbox.dropped) == (3, 47)
    assert [r.getMessage() for r in seen.at_least(logging.WARNING)] == [
        "outbox full: dropped 1 oldest episode(s) (1 in all)"
    ]
    # Each drop is still a debug record.
    assert len(seen.matching("outbox full")) == 47
    await outbox.aclose()


async def test_the_bound_is_bytes_not_a_count(on: Backend) -> None:
    small = entry_bytes("e0", "episode", "", "")
    outbox = on.outbox(THREE)
    for i in range(3):
        await outbox.put(f"e{i}", "episode")
    # One large episode takes the room of two small ones: the two oldest make way.
    big = "x" * (small - entry_bytes("", "episode", "", "") + small)
    await outbox.put(big, "episode")
    assert (outbox.depth, outbox.dropped) == (2, 2)
    assert outbox.bytes == small + entry_bytes(big, "episode", "", "")
    assert await texts_of(outbox) == ["e2", big]
    assert (outbox.depth, outbox.bytes) == (0, 0)
    # Twice the count bound of earlier versions fits a byte bound made for it.
    await outbox.aclose()
    roomy = on.outbox(2000 * small)
    await roomy.load()
    await asyncio.gather(*(roomy.put(f"e{i % 10}", "episode") for i in range(2000)))
    await roomy.put("e9", "episode")
    assert (roomy.depth, roomy.dropped) == (2000, 2 + 1)
    await roomy.aclose()


async def test_dead_letters_leave_the_queue_and_are_counted_without_their_text(
    on: Backend,
) -> None:
    outbox = on.outbox()
    for text in ("first", "refused", "third"):
        await outbox.put(text, "episode", "scope-1" if text == "refused" else "")
    batch = await outbox.oldest(10)
    assert [e.text for e in batch] == ["first", "refused", "third"]
    await outbox.dead_letter(batch[1].seq, "Philia error -32602: Invalid params")
    await outbox.release(batch[0].seq, batch[2].seq)
    await outbox.bury("never queued", "episode", "", "id-9", None, "too large")
    assert (outbox.depth, outbox.dead_letters) == (2, 2)
    newest, older = outbox.recent_dead_letters
    assert (newest.reason, newest.chars) == ("too large", len("never queued"))
    assert (older.reason, older.chars, older.scope_id) == (
        "Philia error -32602: Invalid params",
        len("refused"),
        "scope-1",
    )
    await outbox.aclose()

    again = on.outbox()
    await again.load()
    assert (again.depth, again.dead_letters) == (2, 2)
    assert [d.reason for d in again.recent_dead_letters] == [
        "too large",
        "Philia error -32602: Invalid params",
    ]
    assert await texts_of(again) == ["first", "third"]
    await again.aclose()


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


async def test_an_episode_stored_when_sent_again_is_not_replayed_a_second_time(
    fake: FakePhilia, on: Backend
) -> None:
    # Left in the outbox by an earlier run...
    earlier = on.outbox()
    await earlier.put("User: again\nAssistant: ok", "episode", "", "ep-1")
    await earlier.aclose()
    domain = MemoryDomain(settings_for(fake, on), pool=on.pool)
    try:
        # ...and sent again by its caller (a journal, an import) before the outbox is read.
        first = await domain.writeback("again", "ok", episode_id="ep-1")
        assert first.stored
        await domain.start()
        # Queued behind the replay, which finds "again" stored already: its row goes.
        after = await domain.writeback("next", "ok", episode_id="ep-2")
        assert after.stored
        assert [s["text"] for s in fake.stored] == [
            "User: again\nAssistant: ok",
            "User: next\nAssistant: ok",
        ]
        assert domain.status().outbox_depth == 0
    finally:
        await domain.aclose(grace_s=0.1)


class Clock:
    """A monotonic clock a test moves forward (past the breaker's cooldown)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


async def test_the_replay_sends_a_batch_at_once_and_a_refused_episode_blocks_nothing(
    fake: FakePhilia, on: Backend
) -> None:
    await fake.stop()  # refused
    clock = Clock()
    settings = settings_for(fake, on, memory_breaker_failures=1, memory_breaker_cooldown_s=60.0)
    domain = MemoryDomain(settings, pool=on.pool, clock=clock)
    try:
        for i in range(10):
            with pytest.raises(MemoryUnavailable, match="queued in the outbox"):
                await domain.writeback(f"turn {i}", "")
        assert domain.status().outbox_depth == 10

        # Philia is back; the first store is slow, the third is refused for what it is.
        held = asyncio.Event()
        invalid = Step(error=(-32602, "Invalid params: text must be a non-empty string"))
        fake.script(STORE, Step(hold=held), Step(), invalid)
        await fake.start()
        clock.offset += 61.0
        await domain.recall("the probe")  # its success starts the replay
        # Every queued episode is on the wire while the first is still unanswered.
        await asyncio.wait_for(fake.wait_frames(STORE, 10), 10)
        held.set()
        # A new writeback queues behind them and is answered once it is stored.
        outcome = await asyncio.wait_for(domain.writeback("after", ""), 10)
        assert outcome.stored

        assert sorted(s["text"] for s in fake.stored) == sorted(
            [f"User: turn {i}" for i in range(10) if i != 2] + ["User: after"]
        )
        status = domain.status()
        assert (status.outbox_depth, status.outbox_bytes) == (0, 0)
        assert status.breaker.value == "closed"
        assert status.dead_letters == 1
        [dead] = status.recent_dead_letters
        assert "-32602" in dead.reason and dead.chars == len("User: turn 2")
    finally:
        await domain.aclose(grace_s=0.1)


async def test_a_writeback_refused_for_what_it_is_is_kept_aside_not_queued(
    fake: FakePhilia, on: Backend
) -> None:
    fake.script(STORE, Step(error=(-32600, "Invalid Request")))
    domain = MemoryDomain(settings_for(fake, on, memory_breaker_failures=1), pool=on.pool)
    try:
        with pytest.raises(InvalidArgument, match="dead-letter list") as refused:
            await domain.writeback("refused", "")
        # Kept: the caller (the HTTP layer's journal) must not send it again.
        assert (refused.value.queued, refused.value.code) == (True, "dead_letter")
        status = domain.status()
        assert (status.outbox_depth, status.dead_letters, status.breaker.value) == (
            0,
            1,
            "closed",
        )
        assert (await domain.writeback("next", "")).stored
        assert [s["text"] for s in fake.stored] == ["User: next"]
    finally:
        await domain.aclose(grace_s=0.1)
