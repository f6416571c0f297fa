"""Memory scopes in the domain: the Philia wire in each mode, the episode index, fencing."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from arona_grpc.config import Settings
from arona_grpc.episodes import SqliteEpisodeIndex, Whose, preview_of
from arona_grpc.outbox import OUTBOX_FILE
from arona_grpc.philia import PhiliaMemory
from arona_grpc.scopes import scope_id, scoped_node_type
from arona_grpc.service import (
    NOT_IN_MEMORY,
    NOT_INDEXED,
    OTHER_SCOPE,
    SECTION_HEADER,
    DeleteOutcome,
    EventKind,
    InvalidArgument,
    MemoryDomain,
    MemoryUnavailable,
    episode_text,
    render_section,
    without_memory_section,
)
from tests.support.fake_philia import DELETE, QUERY, STORE, FakePhilia, Step

TOKEN = "scope-test-token"


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


def settings_for(fake: FakePhilia, data_dir: Path, **overrides: Any) -> Settings:
    base = Settings(
        memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=1.0, data_dir=data_dir
    )
    return dataclasses.replace(base, **overrides)


# --- scope ids and fencing ---------------------------------------------------------


def test_scope_ids_are_stable_hashes_that_do_not_name_the_scope() -> None:
    assert scope_id("alice") == scope_id("alice")
    assert scope_id("alice") != scope_id("alice/kid") != scope_id("bob")
    assert "alice" not in scope_id("alice") and len(scope_id("alice")) == 32
    assert scoped_node_type(scope_id("alice")) == f"episode:{scope_id('alice')}"


SECTION = render_section(
    [
        PhiliaMemory("User: I prefer oolong tea\nAssistant: Noted", 0.83, "episode"),
        PhiliaMemory("I live in Lyon", 0.41, "episode"),
    ]
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"Echo: which tea?\n\n{SECTION}", "Echo: which tea?"),
        (f"{SECTION}\n\nwhich tea?", "which tea?"),
        (f"before\n{SECTION}\nafter", "before\nafter"),
        (SECTION, ""),
        (
            "no section here\n- [0.5] a bullet of my own",
            "no section here\n- [0.5] a bullet of my own",
        ),
        (f"  {SECTION_HEADER}\n- [0.10] x\n  y\n\nrest", "rest"),
    ],
)
def test_injected_sections_are_cut_out_of_episode_text(text: str, expected: str) -> None:
    assert without_memory_section(text) == expected


def test_an_episode_never_contains_the_section() -> None:
    text = episode_text(f"which tea?\n{SECTION}", f"Echo: which tea?\n\n{SECTION}")
    assert text == "User: which tea?\nAssistant: Echo: which tea?"
    assert episode_text(SECTION, SECTION) == ""


# --- the Philia wire per mode --------------------------------------------------------


@pytest.mark.asyncio
async def test_shared_mode_keeps_the_seed_wire_and_indexes_by_scope(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path))
    try:
        await domain.recall("tea?", 5, scope="alice")
        stored = await domain.writeback("I like tea", "noted", "alice")
        await domain.writeback("anonymous turn", "ok")
    finally:
        await domain.aclose()
    [query] = fake.frames_of(QUERY)
    assert query["params"] == {"query": "tea?", "limit": 5}
    assert [f["params"] for f in fake.frames_of(STORE)] == [
        {"text": "User: I like tea\nAssistant: noted", "node_type": "episode"},
        {"text": "User: anonymous turn\nAssistant: ok", "node_type": "episode"},
    ]
    index = SqliteEpisodeIndex(tmp_path)
    try:
        page = await index.page(scope_id("alice"), 10, None)
        assert [e.node_id for e in page.episodes] == [stored.node_id]
        # A turn of nobody is stored (shared pool) and indexed as nobody's: listed and
        # forgotten as the anonymous turns, never as anyone's own.
        assert await index.owner("n-2") == ""
        anonymous = await index.page("", 10, None)
        assert [e.node_id for e in anonymous.episodes] == ["n-2"]
    finally:
        await index.aclose()


@pytest.mark.asyncio
async def test_user_mode_stores_and_recalls_in_the_scope_only(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path, memory_scope="user"))
    try:
        await domain.recall("tea?", 5, scope="alice")
        await domain.writeback("I like tea", "noted", "alice")
        for call in (
            domain.recall("tea?", 5),
            domain.writeback("hi", "there"),
            domain.list_episodes(""),
            domain.forget(""),
        ):
            with pytest.raises(InvalidArgument):
                await call
    finally:
        await domain.aclose()
    node_type = f"episode:{scope_id('alice')}"
    [query] = fake.frames_of(QUERY)
    assert query["params"] == {"query": "tea?", "limit": 5, "node_type_filter": node_type}
    [store] = fake.frames_of(STORE)
    assert store["params"] == {"text": "User: I like tea\nAssistant: noted", "node_type": node_type}


@pytest.mark.asyncio
async def test_user_mode_delete_checks_the_index_before_asking_philia(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path, memory_scope="user"))
    try:
        stored = await domain.writeback("mine", "", "alice")
        assert await domain.delete(stored.node_id, "bob") == DeleteOutcome(False, OTHER_SCOPE)
        assert await domain.delete("n-unknown", "alice") == DeleteOutcome(False, NOT_INDEXED)
        # Without a scope: whoever's the index says it is, and only an indexed node.
        assert await domain.delete("n-unknown") == DeleteOutcome(False, NOT_INDEXED)
        assert fake.frames_of(DELETE) == []
        assert await domain.delete(stored.node_id, "alice") == DeleteOutcome(True)
        assert len(fake.frames_of(DELETE)) == 1
        assert (await domain.list_episodes("alice")).episodes == ()
    finally:
        await domain.aclose()


@pytest.mark.asyncio
async def test_an_own_delete_in_shared_mode_deletes_only_the_callers_episode(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path))
    try:
        alices = await domain.writeback("alice's", "", "alice")
        nobodys = await domain.writeback("nobody's", "")
        # Shared memory as the seed has it: any node is asked of Philia, index or not.
        assert await domain.delete("n-unknown") == DeleteOutcome(False, NOT_IN_MEMORY)
        # Own: only an episode indexed for exactly the scope named (none: nobody's).
        own = {"own": True}
        assert await domain.delete(alices.node_id, "bob", **own) == DeleteOutcome(
            False, OTHER_SCOPE
        )
        assert await domain.delete(nobodys.node_id, "alice", **own) == DeleteOutcome(
            False, OTHER_SCOPE
        )
        assert await domain.delete(alices.node_id, "", **own) == DeleteOutcome(False, OTHER_SCOPE)
        assert await domain.delete("n-unknown", "alice", **own) == DeleteOutcome(False, NOT_INDEXED)
        assert len(fake.frames_of(DELETE)) == 1
        assert await domain.delete(alices.node_id, "alice", **own) == DeleteOutcome(True)
        assert await domain.delete(nobodys.node_id, "", **own) == DeleteOutcome(True)
        assert len(fake.frames_of(DELETE)) == 3
    finally:
        await domain.aclose()


@pytest.mark.asyncio
async def test_user_mode_delete_without_a_scope_deletes_for_the_indexed_owner(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path, memory_scope="user"))
    try:
        stored = await domain.writeback("mine", "", "alice")
        assert await domain.delete(stored.node_id) == DeleteOutcome(True)
        [delete] = fake.frames_of(DELETE)
        assert delete["params"] == {"node_id": stored.node_id}
        # The event names the owner's scope; the index forgets the node.
        assert (domain.status().events[0].kind, domain.status().events[0].scope_id) == (
            EventKind.DELETE,
            scope_id("alice"),
        )
        assert (await domain.list_episodes("alice")).episodes == ()
        assert await domain.delete(stored.node_id) == DeleteOutcome(False, NOT_INDEXED)
        # Indexed, but Philia no longer has it: asked, and the index forgets it.
        lost = await domain.writeback("lost", "", "alice")
        fake.script(DELETE, Step(result={"deleted": False}))
        assert await domain.delete(lost.node_id) == DeleteOutcome(False, NOT_IN_MEMORY)
        assert (await domain.list_episodes("alice")).episodes == ()
    finally:
        await domain.aclose()


@pytest.mark.asyncio
async def test_forget_stopped_by_an_outage_finishes_when_called_again(
    fake: FakePhilia, tmp_path: Path
) -> None:
    domain = MemoryDomain(settings_for(fake, tmp_path, memory_breaker_failures=10))
    try:
        for i in range(3):
            await domain.writeback(f"fact {i}", "", "alice")
        await domain.writeback("bob's fact", "", "bob")
        # The deletes go out together: the one refused is left, the others are done.
        fake.script(DELETE, Step(), Step(error=(-32603, "disk on fire")))
        with pytest.raises(MemoryUnavailable, match=r"2 of 3 episode\(s\) deleted; call again"):
            await domain.forget("alice")
        assert len((await domain.list_episodes("alice")).episodes) == 1
        assert await domain.forget("alice") == 1
        assert (await domain.list_episodes("alice")).episodes == ()
        assert len((await domain.list_episodes("bob")).episodes) == 1
    finally:
        await domain.aclose()


@pytest.mark.asyncio
async def test_an_episode_replayed_from_the_outbox_is_indexed_for_its_scope(
    fake: FakePhilia, tmp_path: Path
) -> None:
    settings = settings_for(fake, tmp_path, memory_scope="user", memory_breaker_failures=1)
    domain = MemoryDomain(settings)
    try:
        fake.script(STORE, Step(error=(-32603, "busy")))
        with pytest.raises(MemoryUnavailable, match="queued in the outbox"):
            await domain.writeback("queued fact", "", "alice")
    finally:
        await domain.aclose()
    # The next start replays the outbox; the episode keeps its scope on the way.
    domain = MemoryDomain(dataclasses.replace(settings, memory_breaker_failures=3))
    try:
        await domain.start()
        await fake.wait_frames(STORE, 2)
    finally:
        # Shutdown waits for the replay to finish its episode.
        await domain.aclose()
    stores = fake.frames_of(STORE)
    assert {f["params"]["node_type"] for f in stores} == {f"episode:{scope_id('alice')}"}
    index = SqliteEpisodeIndex(tmp_path)
    try:
        page = await index.page(scope_id("alice"), 10, None)
        assert [e.preview for e in page.episodes] == ["User: queued fact"]
    finally:
        await index.aclose()


@pytest.mark.asyncio
async def test_an_outbox_from_before_scopes_is_read_and_replayed(
    fake: FakePhilia, tmp_path: Path
) -> None:
    with sqlite3.connect(tmp_path / OUTBOX_FILE) as db:
        db.executescript(
            """
            CREATE TABLE episodes (seq INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT NOT NULL,
                node_type TEXT NOT NULL, queued_us INTEGER NOT NULL);
            CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
            INSERT INTO episodes (text, node_type, queued_us)
                VALUES ('User: old turn', 'episode', 1600000000000000);
            """
        )
    domain = MemoryDomain(settings_for(fake, tmp_path))
    try:
        await domain.start()
        [store] = await fake.wait_frames(STORE)
        # Dated when it was queued (the rows of earlier versions have no time of their own).
        assert store["params"] == {
            "text": "User: old turn",
            "node_type": "episode",
            "properties": {"occurred_at": "2020-09-13T12:26:40Z"},
        }
    finally:
        await domain.aclose()


# --- the index alone -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_index_pages_newest_first_and_survives_a_restart(tmp_path: Path) -> None:
    index = SqliteEpisodeIndex(tmp_path)
    try:
        for i in range(5):
            index.record(f"n-{i}", "s1", f"episode {i}")
        index.record("x-1", "s2", "another scope")
        index.record("n-1", "s1", "episode 1")  # stored again: the newest now
        first = await index.page("s1", 2, None)
        assert [e.node_id for e in first.episodes] == ["n-1", "n-4"]
        assert first.next is not None
        second = await index.page("s1", 2, first.next)
        assert [e.node_id for e in second.episodes] == ["n-3", "n-2"]
        third = await index.page("s1", 2, second.next)
        assert ([e.node_id for e in third.episodes], third.next) == (["n-0"], None)
        assert await index.owner("x-1") == "s2"
        await index.remove(["n-4", "nope"])
    finally:
        await index.aclose()
    reopened = SqliteEpisodeIndex(tmp_path)
    try:
        assert await reopened.node_ids(Whose(scope_id="s1")) == ["n-1", "n-3", "n-2", "n-0"]
    finally:
        await reopened.aclose()


def test_previews_are_one_short_line() -> None:
    assert preview_of("User: hi\nAssistant:   there") == "User: hi Assistant: there"
    long = preview_of("word " * 100)
    assert len(long) == 120 and long.endswith("\u2026")
