"""Several stores in ``ARONA_MEMORY_URL``: the service spreads its calls over them, makes a call
that failed on one store once more on another, says which store is down, and uses a store
again once it answers. Each store is a scripted Philia on 127.0.0.1 (``FakePhilia``); the
service is the real :class:`MemoryDomain`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from arona_grpc.breaker import BreakerState
from arona_grpc.config import Settings
from arona_grpc.philia import PhiliaClient
from arona_grpc.service import InvalidArgument, MemoryDomain, MemoryState, MemoryUnavailable
from tests.support.fake_philia import HANDSHAKE, QUERY, STORE, FakePhilia, Step
from tests.support.log_watch import watching

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TOKEN = "multi-store-token-0123"
MEMORY = {"node_type": "episode", "text": "I prefer oolong tea", "score": 0.8}


@contextlib.asynccontextmanager
async def two_stores() -> AsyncIterator[tuple[FakePhilia, ...]]:
    async with FakePhilia(token=TOKEN) as one, FakePhilia(token=TOKEN) as two:
        for fake in (one, two):
            fake.memories = [MEMORY]
        yield one, two


@contextlib.asynccontextmanager
async def service(tmp_path: Path, *urls: str, **overrides: Any) -> AsyncIterator[MemoryDomain]:
    settings = Settings(
        memory_url=",".join(urls),
        memory_token=TOKEN,
        memory_timeout_s=1.0,
        memory_breaker_cooldown_s=0.05,
        data_dir=tmp_path / "data",
        **overrides,
    )
    domain = MemoryDomain(settings)
    await domain.start()
    try:
        yield domain
    finally:
        await domain.aclose(grace_s=1.0)


async def until(done: Callable[[], bool], within_s: float = 10.0) -> None:
    """Return once ``done()`` holds; fail after ``within_s`` (the service's background check
    runs on its own timer, so this looks every 10 ms)."""
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.01)


def states(domain: MemoryDomain) -> list[bool]:
    return [store.up for store in domain.status().stores]


async def test_one_url_is_one_philia_client_and_lists_no_stores(tmp_path: Path) -> None:
    async with FakePhilia(token=TOKEN) as fake, service(tmp_path, fake.url) as domain:
        fake.memories = [MEMORY]
        assert isinstance(domain.client, PhiliaClient)
        assert (await domain.recall("tea?")).state is MemoryState.ENABLED
        assert domain.status().stores == ()


async def test_calls_are_spread_over_the_stores(tmp_path: Path) -> None:
    async with two_stores() as (one, two), service(tmp_path, one.url, two.url) as domain:
        recalls = [await domain.recall(f"tea {i}?") for i in range(6)]
        assert {r.state for r in recalls} == {MemoryState.ENABLED}
        for i in range(4):
            assert (await domain.writeback(f"turn {i}", "noted")).stored
        assert (len(one.frames_of(QUERY)), len(two.frames_of(QUERY))) == (3, 3)
        assert (len(one.stored), len(two.stored)) == (2, 2)
        status = domain.status()
        assert [(s.url, s.up, s.error) for s in status.stores] == [
            (one.url, True, ""),
            (two.url, True, ""),
        ]


async def test_a_refused_store_is_skipped_and_named_down(tmp_path: Path) -> None:
    async with two_stores() as (one, two), service(tmp_path, one.url, two.url) as domain:
        one.upgrade_status = 503
        with watching("arona_grpc.stores") as logs:
            recalls = [await domain.recall(f"tea {i}?") for i in range(5)]
            stored = [await domain.writeback(f"turn {i}", "noted") for i in range(3)]
        # Every turn answered through the other store; the refusing one was tried once.
        assert {r.state for r in recalls} == {MemoryState.ENABLED}
        assert all(w.stored for w in stored) and len(two.stored) == 3
        assert len(one.upgrades) == 1
        status = domain.status()
        assert status.breaker is BreakerState.CLOSED
        down, up = status.stores
        assert (down.url, down.up, up.up) == (one.url, False, True)
        assert "HTTP 503" in down.error and up.error == ""
        errors = [e.detail for e in status.events if e.kind.value == "error"]
        assert errors == [f"memory store 1 ({one.url}) is down: {down.error}"]
        [warning] = logs.matching("is down")
        assert "calls go to the other 1 store(s)" in warning.getMessage()
        assert TOKEN not in repr(status) and TOKEN not in warning.getMessage()


async def test_calls_cut_by_a_dying_store_are_answered_by_the_other(tmp_path: Path) -> None:
    async with two_stores() as (one, two), service(tmp_path, one.url, two.url) as domain:
        # The first store drops the link in the middle of a recall and of a store.
        one.script(QUERY, Step(action="close"))
        one.script(STORE, Step(action="close"))
        recall = await domain.recall("tea?")
        one.upgrade_status = 503  # and stays away
        writes = [await domain.writeback(f"turn {i}", "noted") for i in range(2)]
        assert recall.state is MemoryState.ENABLED
        assert all(w.stored for w in writes)
        assert [p["text"] for p in two.stored] == [
            "User: turn 0\nAssistant: noted",
            "User: turn 1\nAssistant: noted",
        ]
        assert domain.status().outbox_depth == 0
        assert states(domain) == [False, True]


async def test_a_store_back_takes_calls_again(tmp_path: Path) -> None:
    async with two_stores() as (one, two), service(tmp_path, one.url, two.url) as domain:
        one.upgrade_status = 503
        assert (await domain.recall("tea?")).state is MemoryState.ENABLED
        assert states(domain) == [False, True]
        one.upgrade_status = None
        # The background check connects to it (a handshake, no call) and finds it up.
        await one.wait_frames(HANDSHAKE)
        await until(lambda: states(domain) == [True, True])
        asked = len(one.frames_of(QUERY))
        for i in range(4):
            assert (await domain.recall(f"tea {i}?")).state is MemoryState.ENABLED
        assert len(one.frames_of(QUERY)) - asked == 2
        status = domain.status()
        assert status.stores[0].error == ""


async def test_every_store_down_is_offline_and_the_outbox_replays_through_one_back(
    tmp_path: Path,
) -> None:
    async with (
        two_stores() as (one, two),
        service(tmp_path, one.url, two.url, memory_breaker_failures=2) as domain,
    ):
        one.upgrade_status = two.upgrade_status = 503
        assert (await domain.recall("tea?")).state is MemoryState.OFFLINE
        with pytest.raises(MemoryUnavailable) as kept:
            await domain.writeback("remember the kettle", "noted")
        assert kept.value.queued
        # As with one store: the breaker opened, recall is offline without a call.
        assert domain.status().breaker is not BreakerState.CLOSED
        assert (await domain.recall("tea?")).state is MemoryState.OFFLINE
        assert states(domain) == [False, False]
        assert domain.status().outbox_depth == 1
        # One store comes back: the queued episode reaches it without another turn.
        two.upgrade_status = None
        await two.wait_stored(1)
        assert two.stored[0]["text"] == "User: remember the kettle\nAssistant: noted"
        await until(lambda: domain.status().outbox_depth == 0)
        assert states(domain) == [False, True]
        assert (await domain.recall("tea?")).state is MemoryState.ENABLED


async def test_a_call_refused_for_what_it_is_goes_to_no_other_store(tmp_path: Path) -> None:
    async with two_stores() as (one, two), service(tmp_path, one.url, two.url) as domain:
        one.script(STORE, Step(error=(-32602, "text is not acceptable")))
        with pytest.raises(InvalidArgument):
            await domain.writeback("an odd turn", "noted")
        # The other store was not asked: it would refuse it too. The first one is well.
        assert two.frames_of(STORE) == []
        assert states(domain) == [True, True]
        assert domain.status().dead_letters == 1


async def test_metrics_say_which_store_is_up_and_count_failovers(tmp_path: Path) -> None:
    async with two_stores() as (one, two), service(tmp_path, one.url, two.url) as domain:
        one.upgrade_status = 503
        assert (await domain.recall("tea?")).state is MemoryState.ENABLED
        assert domain.metrics is not None
        text = generate_latest(domain.metrics.registry()).decode()
        assert f'arona_memory_store_up{{store="1",url="{one.url}"}} 0.0' in text
        assert f'arona_memory_store_up{{store="2",url="{two.url}"}} 1.0' in text
        assert 'arona_memory_store_failovers_total{method="query"} 1.0' in text
        assert TOKEN not in text
