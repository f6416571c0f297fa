"""Recall limits: the section cap, the budget and the caller's deadline, and their settings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from arona_grpc.breaker import BreakerState
from arona_grpc.config import ConfigError, Settings
from arona_grpc.philia import PhiliaMemory
from arona_grpc.service import (
    ELLIPSIS,
    MAX_MEMORY_CHARS,
    MAX_SECTION_CHARS,
    EventKind,
    MemoryDomain,
    MemoryState,
    cap_memories,
    render_section,
)
from tests.support.fake_philia import QUERY, FakePhilia, Step

TOKEN = "t0k3n"


def test_cap_keeps_small_sections_as_they_are() -> None:
    memories = [
        PhiliaMemory("a", 0.9, "x"),
        PhiliaMemory("  ", 0.8, "x"),
        PhiliaMemory("b", 0.1, "x"),
    ]
    assert cap_memories(memories) == (PhiliaMemory("a", 0.9, "x"), PhiliaMemory("b", 0.1, "x"))


def test_cap_drops_the_lowest_scores_first_and_keeps_the_order() -> None:
    # Ten 900-character memories cannot all fit in 4,000 characters.
    scores = [0.5, 0.9, 0.1, 0.7, 0.3, 0.8, 0.2, 0.6, 0.4, 0.95]
    memories = [PhiliaMemory(f"{i}" * 900, s, "x") for i, s in enumerate(scores)]
    kept = cap_memories(memories)
    section = render_section(kept)
    assert len(section) <= MAX_SECTION_CHARS
    # The four best, in Philia's order.
    assert [m.score for m in kept] == [0.9, 0.7, 0.8, 0.95]


def test_cap_cuts_one_overlong_memory_with_an_ellipsis() -> None:
    [kept] = cap_memories([PhiliaMemory("word " * 5000, 0.5, "x")])
    assert len(kept.text) <= MAX_MEMORY_CHARS
    assert kept.text.endswith(ELLIPSIS)
    assert kept.text.startswith("word word")


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


@pytest.mark.asyncio
async def test_recall_section_never_exceeds_the_cap(fake: FakePhilia) -> None:
    fake.memories = [
        {"text": f"memory {i} " + "x" * 3000, "score": 1 - i / 100, "node_type": "x"}
        for i in range(100)
    ]
    domain = MemoryDomain(Settings(memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=2))
    try:
        outcome = await domain.recall("q", limit=100)
    finally:
        await domain.aclose()
    assert outcome.state is MemoryState.ENABLED
    assert len(outcome.section) <= MAX_SECTION_CHARS
    # The best memories survived, best first as Philia ranked them.
    assert [m.text.split()[1] for m in outcome.memories] == ["0", "1", "2"]
    assert all(m.text.endswith(ELLIPSIS) for m in outcome.memories)


# A recall that ends at its caller's 0.3 s deadline takes 0.25 s (measured on a 2-core box,
# idle or loaded); the bound is twelve times that and a twentieth of the budget, so a recall
# that waited for its budget instead fails here whatever the load.
BUDGET_S = 60
DEADLINE_BOUND_S = 3.0


@pytest.mark.asyncio
async def test_recall_gives_up_before_the_callers_deadline(fake: FakePhilia) -> None:
    fake.script(QUERY, Step(action="hang"))
    settings = Settings(
        memory_url=fake.url,
        memory_token=TOKEN,
        memory_timeout_s=BUDGET_S,
        memory_recall_budget_ms=BUDGET_S * 1000,
    )
    domain = MemoryDomain(settings)
    try:
        started = time.monotonic()
        outcome = await asyncio.wait_for(domain.recall("q", deadline_s=0.3), BUDGET_S / 2)
        elapsed = time.monotonic() - started
    finally:
        await domain.aclose()
    assert outcome.state is MemoryState.OFFLINE
    assert elapsed < DEADLINE_BOUND_S  # the caller's deadline, not the 60 s budget
    [error] = [e for e in domain.status().events if e.kind is EventKind.ERROR]
    assert "no answer from Philia within 0.25 s" in error.detail


@pytest.mark.asyncio
async def test_a_recall_cut_off_at_its_callers_deadline_counts_against_the_breaker(
    fake: FakePhilia,
) -> None:
    fake.script(QUERY, Step(action="hang"), Step(action="hang"))
    settings = Settings(
        memory_url=fake.url,
        memory_token=TOKEN,
        memory_timeout_s=BUDGET_S,
        memory_recall_budget_ms=BUDGET_S * 1000,
        memory_breaker_failures=1,
        memory_breaker_cooldown_s=BUDGET_S,
    )
    domain = MemoryDomain(settings)
    try:
        # A client that leaves mid-recall says nothing about Philia: the breaker stays closed.
        left = asyncio.create_task(domain.recall("q", deadline_s=BUDGET_S))
        await fake.wait_frames(QUERY)
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        assert domain.status().breaker is BreakerState.CLOSED

        # A loaded loop: it is busy past the recall's 0.3 s deadline, and the caller's
        # cancellation is handled before the service's own timer. Philia did not answer in
        # time, so this is a failure, and one failure opens this breaker.
        cut_off = asyncio.create_task(domain.recall("q", deadline_s=0.3))
        await fake.wait_frames(QUERY, 2)
        # Blocks the loop on purpose: the load that lets the caller win.
        time.sleep(0.3)  # noqa: ASYNC251
        cut_off.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut_off
        status = domain.status()
        # The next turn does not wait for Philia at all.
        skipped = await asyncio.wait_for(domain.recall("q", deadline_s=BUDGET_S), BUDGET_S / 2)
    finally:
        await domain.aclose()
    assert status.breaker is BreakerState.OPEN
    errors = [e.detail for e in status.events if e.kind is EventKind.ERROR]
    assert errors == [
        "memory breaker opened after 1 consecutive failures",
        "recall failed: no answer from Philia within 0.25 s (the caller's deadline ended it)",
    ]
    assert skipped.state is MemoryState.OFFLINE
    assert len(fake.frames_of(QUERY)) == 2


@pytest.mark.asyncio
async def test_recall_budget_bounds_a_hanging_query(fake: FakePhilia) -> None:
    fake.script(QUERY, Step(action="hang"))
    settings = Settings(
        memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=10, memory_recall_budget_ms=200
    )
    domain = MemoryDomain(settings)
    try:
        outcome = await asyncio.wait_for(domain.recall("q"), 5)
    finally:
        await domain.aclose()
    assert outcome.state is MemoryState.OFFLINE
    [error] = [e for e in domain.status().events if e.kind is EventKind.ERROR]
    assert "within 0.2 s" in error.detail


def test_outbox_bound_from_the_environment(caplog: pytest.LogCaptureFixture) -> None:
    assert Settings.from_env({}).memory_outbox_max_bytes == 256 * 2**20
    env = {"ARONA_MEMORY_OUTBOX_MAX_MB": "25"}
    assert Settings.from_env(env).memory_outbox_max_bytes == 25 * 2**20
    with pytest.raises(ConfigError, match="ARONA_MEMORY_OUTBOX_MAX_MB"):
        Settings.from_env({"ARONA_MEMORY_OUTBOX_MAX_MB": "0"})
    # The count bound of earlier versions is gone: said once, the byte bound kept.
    with caplog.at_level("WARNING", logger="arona_grpc.config"):
        settings = Settings.from_env({"ARONA_MEMORY_OUTBOX_MAX": "1000"})
    assert settings.memory_outbox_max_bytes == 256 * 2**20
    assert "ARONA_MEMORY_OUTBOX_MAX is no longer used" in caplog.text
