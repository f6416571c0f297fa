"""Sizes decided once: what the service sends Philia always fits its frame budget, a long
episode is stored shortened with a marker, a long question is recalled by its last part, and
a call Philia refuses for what it is never counts against the breaker."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from arona_grpc.config import DEFAULT_EPISODE_CHARS, DEFAULT_QUERY_CHARS, Settings
from arona_grpc.philia import MAX_REQUEST_BYTES, QUERY_METHOD, STORE_METHOD, request_bytes
from arona_grpc.service import MemoryDomain, MemoryState
from arona_grpc.sizes import fitted_episode, fitted_query, last_part, shortened
from tests.support.fake_philia import QUERY, FakePhilia, Step

TOKEN = "sizes-token"
# The costliest characters a frame can carry: an astral one (two \uXXXX escapes once a lone
# surrogate sends the frame through the standard encoder) and a control character.
WORST = "\U0001f375\x01"


def test_a_side_over_the_cap_keeps_both_ends_and_says_what_it_left_out() -> None:
    text = "A" * 600 + "B" * 600
    short = shortened(text, 100)
    assert short.startswith("A" * 50) and short.endswith("B" * 50)
    assert "[\u2026 1,100 characters omitted \u2026]" in short
    assert shortened("short", 100) == "short"


def test_a_question_over_the_cap_is_its_last_part() -> None:
    assert last_part("x" * 10 + "what tea do I like?", 19) == "what tea do I like?"


@pytest.mark.parametrize("lone_surrogate", [False, True], ids=["utf-8", "ascii-escaped"])
def test_the_default_caps_fit_the_frame_whatever_the_text(lone_surrogate: bool) -> None:
    side = WORST * DEFAULT_EPISODE_CHARS + ("\udc80" if lone_surrogate else "")
    text = fitted_episode(side, side, "episode:" + "f" * 64, DEFAULT_EPISODE_CHARS)
    assert len(text) < 2 * DEFAULT_EPISODE_CHARS + 200
    assert request_bytes(STORE_METHOD, {"text": text, "node_type": "episode"}) <= MAX_REQUEST_BYTES
    query = fitted_query(side, DEFAULT_QUERY_CHARS, {"limit": 5})
    assert len(query) == DEFAULT_QUERY_CHARS


def test_a_larger_configured_cap_is_shortened_further_to_fit() -> None:
    side = WORST * 400_000 + "\udc80"
    text = fitted_episode(side, "ok", "episode", 10_000_000)
    size = request_bytes(STORE_METHOD, {"text": text, "node_type": "episode"})
    # As much as fits, and no more than the frame.
    assert MAX_REQUEST_BYTES * 0.8 < size <= MAX_REQUEST_BYTES
    assert re.search(r"\[\u2026 [\d,]+ characters omitted \u2026\]", text)
    assert text.endswith("\nAssistant: ok")
    query = fitted_query(side, 10_000_000, {"limit": 5})
    assert request_bytes(QUERY_METHOD, {"query": query, "limit": 5}) <= MAX_REQUEST_BYTES
    assert side.endswith(query)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


def settings_for(fake: FakePhilia, tmp_path: Path, **overrides: Any) -> Settings:
    base = Settings(
        memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=2.0, data_dir=tmp_path
    )
    return dataclasses.replace(base, **overrides)


@pytest.mark.asyncio
async def test_an_oversized_turn_is_stored_shortened_with_a_marker(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path, memory_max_episode_chars=1000))
    try:
        outcome = await domain.writeback("q" * 600_000 + " the end", "Echo: short")
    finally:
        await domain.aclose()
    assert outcome.stored
    [stored] = fake.stored
    text = stored["text"]
    assert text.startswith("User: " + "q" * 500)
    assert "[\u2026 599,008 characters omitted \u2026]" in text
    assert text.endswith("the end\nAssistant: Echo: short")


@pytest.mark.asyncio
async def test_an_oversized_question_is_recalled_by_its_last_part(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path))
    try:
        outcome = await domain.recall("z" * 1_100_000 + " what tea do I like?")
    finally:
        await domain.aclose()
    assert outcome.state is MemoryState.DISABLED  # answered, nothing to inject
    [frame] = fake.frames_of(QUERY)
    query = frame["params"]["query"]
    assert len(query) == DEFAULT_QUERY_CHARS and query.endswith(" what tea do I like?")


@pytest.mark.asyncio
async def test_calls_refused_for_what_they_are_leave_the_breaker_closed(
    fake: FakePhilia, tmp_path: Path
) -> None:
    invalid = (-32602, "Invalid params")
    fake.script(QUERY, *(Step(error=invalid) for _ in range(5)))
    domain = MemoryDomain(settings_for(fake, tmp_path, memory_breaker_failures=3))
    try:
        for _ in range(5):
            assert (await domain.recall("refused")).state is MemoryState.OFFLINE
        assert domain.status().breaker.value == "closed"
        fake.memories = [{"text": "oolong", "score": 0.8, "node_type": "episode"}]
        assert (await domain.recall("what tea?")).state is MemoryState.ENABLED
        # One connection all along: a refusal drops no link shared with other callers.
        assert len(fake.upgrades) == 1
    finally:
        await domain.aclose()
