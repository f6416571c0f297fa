"""MemoryDomain: section rendering, episode text, events, and its behaviour against Philia."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import pytest
import pytest_asyncio

from arona_grpc.config import Settings
from arona_grpc.philia import PhiliaMemory
from arona_grpc.service import (
    NOT_IN_MEMORY,
    DeleteOutcome,
    EventKind,
    InvalidArgument,
    MemoryDomain,
    MemoryState,
    MemoryTimeout,
    MemoryUnavailable,
    NotConfigured,
    episode_text,
    render_section,
)
from tests.support.fake_philia import QUERY, STORE, FakePhilia, Step

TOKEN = "s3cr3t-t0ken/+&"


def settings_for(fake: FakePhilia, **overrides: Any) -> Settings:
    base = Settings(memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=1.0)
    return dataclasses.replace(base, **overrides)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


@pytest_asyncio.fixture
async def domain(fake: FakePhilia) -> AsyncIterator[MemoryDomain]:
    d = MemoryDomain(settings_for(fake))
    yield d
    await d.aclose()


# --- rendering -------------------------------------------------------------------


def test_section_header_bullets_and_two_decimals() -> None:
    section = render_section(
        [PhiliaMemory("I prefer oolong tea", 0.834, "entity"), PhiliaMemory("Lyon", 0.4, "x")]
    )
    assert section == "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea\n- [0.40] Lyon"


def test_section_indents_continuation_lines_and_skips_blank_memories() -> None:
    section = render_section(
        [
            PhiliaMemory("   ", 0.99, "episode"),
            PhiliaMemory("User: where do I live?\nAssistant: In Lyon.", 0.41, "episode"),
            PhiliaMemory("", 0.9, "episode"),
            PhiliaMemory("## not a heading\r\n- not a bullet", 1, "episode"),
        ]
    )
    assert section == (
        "## Relevant Long-Term Memories\n"
        "- [0.41] User: where do I live?\n"
        "  Assistant: In Lyon.\n"
        "- [1.00] ## not a heading\n"
        "  - not a bullet"
    )


def test_section_is_empty_without_non_blank_memories() -> None:
    assert render_section([]) == ""
    assert render_section([PhiliaMemory(" \n\t", 0.5, "episode")]) == ""


@pytest.mark.parametrize(
    ("user", "assistant", "text"),
    [
        ("hi", "hello", "User: hi\nAssistant: hello"),
        ("hi", "", "User: hi"),
        ("", "hello", "Assistant: hello"),
        ("  ", "hello", "Assistant: hello"),
        ("", "", ""),
        ("a\nb", "c", "User: a\nb\nAssistant: c"),
    ],
)
def test_episode_text(user: str, assistant: str, text: str) -> None:
    assert episode_text(user, assistant) == text


# --- disabled ----------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["memory_url", "memory_token"])
@pytest.mark.asyncio
async def test_disabled_opens_no_connection(fake: FakePhilia, missing: str) -> None:
    domain = MemoryDomain(settings_for(fake, **{missing: None}))
    try:
        outcome = await domain.recall("what tea?", 5)
        assert (outcome.state, outcome.memories, outcome.section) == (
            MemoryState.DISABLED,
            (),
            "",
        )
        writeback = await domain.writeback("hi", "hello")
        assert writeback.stored is False
        with pytest.raises(NotConfigured):
            await domain.delete("n-1")
        status = domain.status()
        assert (status.enabled, status.writeback, status.events) == (False, False, ())
    finally:
        await domain.aclose()
    assert fake.upgrades == []


# --- recall ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_recall_renders_memories_and_records_the_query(
    fake: FakePhilia, domain: MemoryDomain
) -> None:
    fake.memories = [
        {"node_type": "episode", "text": "User: I love oolong\nAssistant: Noted!", "score": 0.83},
        {"node_type": "entity", "text": "  ", "score": 0.5},
        {"node_type": "entity", "text": "oolong tea", "score": 0.41},
    ]
    outcome = await domain.recall("what tea do I like?", 0)

    assert outcome.state is MemoryState.ENABLED
    assert [m.text for m in outcome.memories] == [
        "User: I love oolong\nAssistant: Noted!",
        "oolong tea",
    ]
    assert outcome.section == (
        "## Relevant Long-Term Memories\n"
        "- [0.83] User: I love oolong\n"
        "  Assistant: Noted!\n"
        "- [0.41] oolong tea"
    )
    [query] = fake.frames_of(QUERY)
    assert query["params"] == {"query": "what tea do I like?", "limit": 5}
    [event] = domain.status().events
    assert (event.kind, event.detail) == (EventKind.RECALL, "what tea do I like?")


@pytest.mark.asyncio
async def test_recall_with_only_blank_results_is_disabled(
    fake: FakePhilia, domain: MemoryDomain
) -> None:
    fake.memories = [{"node_type": "episode", "text": "   ", "score": 0.9}]
    outcome = await domain.recall("q", 3)
    assert (outcome.state, outcome.section) == (MemoryState.DISABLED, "")
    assert fake.frames_of(QUERY)[0]["params"]["limit"] == 3


@pytest.mark.asyncio
async def test_recall_of_blank_query_asks_nothing(fake: FakePhilia, domain: MemoryDomain) -> None:
    outcome = await domain.recall("  ", 5)
    assert outcome.state is MemoryState.DISABLED
    assert fake.upgrades == []


@pytest.mark.parametrize(
    "step", [Step(action="hang"), Step(error=(-32603, "stalled")), Step(action="close")]
)
@pytest.mark.asyncio
async def test_recall_fault_is_offline_and_logged(
    fake: FakePhilia, domain: MemoryDomain, step: Step, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script(QUERY, step)
    with caplog.at_level(logging.WARNING, logger="arona_grpc"):
        outcome = await domain.recall("q", 5)
    assert (outcome.state, outcome.memories, outcome.section) == (MemoryState.OFFLINE, (), "")
    assert any(
        r.levelno == logging.WARNING and "recall failed" in r.message for r in caplog.records
    )
    [event] = domain.status().events
    assert event.kind is EventKind.ERROR and event.detail.startswith("recall failed")
    # And the next turn has its memories again.
    fake.memories = [{"node_type": "episode", "text": "back", "score": 0.5}]
    assert (await domain.recall("q", 5)).state is MemoryState.ENABLED


@pytest.mark.asyncio
async def test_refused_philia_is_offline() -> None:
    fake = await FakePhilia(token=TOKEN).start()
    await fake.stop()
    domain = MemoryDomain(settings_for(fake))
    try:
        assert (await domain.recall("q", 5)).state is MemoryState.OFFLINE
    finally:
        await domain.aclose()


# --- writeback and delete -----------------------------------------------------------


@pytest.mark.asyncio
async def test_writeback_stores_the_episode(fake: FakePhilia, domain: MemoryDomain) -> None:
    outcome = await domain.writeback("where do I live?", "In Lyon.")
    assert (outcome.stored, outcome.node_id) == (True, "n-1")
    assert fake.stored == [
        {"text": "User: where do I live?\nAssistant: In Lyon.", "node_type": "episode"}
    ]
    [event] = domain.status().events
    assert (event.kind, event.detail) == (EventKind.WRITEBACK, "n-1")


@pytest.mark.asyncio
async def test_writeback_of_an_empty_turn_sends_nothing(
    fake: FakePhilia, domain: MemoryDomain
) -> None:
    assert (await domain.writeback("", " ")).stored is False
    assert fake.upgrades == []


@pytest.mark.asyncio
async def test_writeback_off_sends_nothing(fake: FakePhilia) -> None:
    domain = MemoryDomain(settings_for(fake, memory_writeback=False))
    try:
        assert (await domain.writeback("hi", "hello")).stored is False
        assert (domain.status().enabled, domain.status().writeback) == (True, False)
    finally:
        await domain.aclose()
    assert fake.upgrades == []


@pytest.mark.parametrize(
    ("step", "error"),
    [(Step(action="hang"), MemoryTimeout), (Step(error=(-32603, "boom")), MemoryUnavailable)],
)
@pytest.mark.asyncio
async def test_writeback_fault_raises_and_is_recorded(
    fake: FakePhilia, domain: MemoryDomain, step: Step, error: type[Exception]
) -> None:
    fake.script(STORE, step)
    with pytest.raises(error, match="writeback failed"):
        await domain.writeback("hi", "hello")
    [event] = domain.status().events
    assert event.kind is EventKind.ERROR


@pytest.mark.asyncio
async def test_delete(fake: FakePhilia, domain: MemoryDomain) -> None:
    stored = await domain.writeback("hi", "")
    assert await domain.delete(stored.node_id) == DeleteOutcome(True)
    # Shared mode: Philia is asked about any node, and says it has no such one.
    assert await domain.delete("n-404") == DeleteOutcome(False, NOT_IN_MEMORY)
    kinds = [(e.kind, e.detail) for e in domain.status().events]
    assert kinds == [
        (EventKind.DELETE, "n-404"),
        (EventKind.DELETE, "n-1"),
        (EventKind.WRITEBACK, "n-1"),
    ]
    with pytest.raises(InvalidArgument):
        await domain.delete(" ")


# --- events ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_events_newest_first_capped_and_limited(
    fake: FakePhilia, domain: MemoryDomain
) -> None:
    before = datetime.now(UTC)
    for i in range(120):
        await domain.recall(f"q{i}", 1)

    default = domain.status(0).events
    assert [e.detail for e in default] == [f"q{i}" for i in range(119, 69, -1)]
    assert [e.detail for e in domain.status(3).events] == ["q119", "q118", "q117"]
    everything = domain.status(1000).events
    assert len(everything) == 100
    assert everything[-1].detail == "q20"
    assert all(e.at.tzinfo is UTC and e.at >= before for e in everything)
    assert [e.at for e in everything] == sorted((e.at for e in everything), reverse=True)


# --- secrets -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_token_never_in_errors_events_or_logs(
    fake: FakePhilia, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = FakePhilia(token="other")
    async with wrong:
        domain = MemoryDomain(settings_for(wrong))
        try:
            assert (await domain.recall("q", 5)).state is MemoryState.OFFLINE  # HTTP 401
        finally:
            await domain.aclose()

    domain = MemoryDomain(settings_for(fake))
    errors: list[str] = []
    try:
        fake.script(QUERY, Step(error=(-32603, f"bad token {TOKEN}")))
        assert (await domain.recall("q", 5)).state is MemoryState.OFFLINE
        fake.script(STORE, Step(action="garbage"))
        with pytest.raises(MemoryUnavailable) as caught:
            await domain.writeback("hi", "hello")
        errors.append(str(caught.value))
        assert (await domain.recall("q", 5)).state is MemoryState.DISABLED
        events = [e.detail for e in domain.status().events]
    finally:
        await domain.aclose()

    ours = [r.getMessage() for r in caplog.records if not r.name.startswith(FakePhilia.LOGGER)]
    everything = "\n".join([*errors, *events, *ours])
    assert "bad token ***" in everything  # the server's message is kept, the token masked
    for form in (TOKEN, quote(TOKEN, safe="")):
        assert form not in everything
