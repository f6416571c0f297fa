"""The conversation stores on both backends: SQLite files under ``tmp_path`` and a real
PostgreSQL database."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from arona_common.database import open_pool
from gateway_http.conversations import (
    PAGE_MAX_BYTES,
    ConversationForbidden,
    ConversationNotFound,
    ConversationStore,
    SqliteConversationStore,
    open_conversations,
)


def msg(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "nested" / "conversations.db"


@pytest_asyncio.fixture
async def store(backend: str | None, db_path: Path) -> AsyncIterator[ConversationStore]:
    pool = await open_pool(backend) if backend else None
    opened = open_conversations(db_path.parent, pool, backend)
    yield opened
    await opened.aclose()
    if pool is not None:
        await pool.close()


@pytest.mark.asyncio
async def test_create_then_get_returns_the_same_conversation(store: ConversationStore) -> None:
    before = datetime.now(UTC)
    created = await store.create("alice", "Trip to Lyon")
    fetched = await store.get(created.id, "alice")

    assert fetched == created
    assert created.id.startswith("conv_")
    assert created.owner == "alice"
    assert created.title == "Trip to Lyon"
    assert created.created_at == created.updated_at
    assert created.created_at.tzinfo is not None
    assert before - timedelta(seconds=5) <= created.created_at <= datetime.now(UTC)


@pytest.mark.asyncio
async def test_every_conversation_gets_its_own_id(store: ConversationStore) -> None:
    untitled = await store.create("alice")
    other = await store.create("alice")

    assert untitled.title is None
    assert untitled.id != other.id


@pytest.mark.asyncio
async def test_unknown_id_is_not_found(store: ConversationStore) -> None:
    with pytest.raises(ConversationNotFound):
        await store.get("conv_missing", "alice")
    with pytest.raises(ConversationNotFound):
        await store.delete("conv_missing", "alice")
    with pytest.raises(ConversationNotFound):
        await store.append("conv_missing", msg("user", "hello?"))


@pytest.mark.asyncio
async def test_another_owners_conversation_is_forbidden_and_left_alone(
    store: ConversationStore,
) -> None:
    mine = await store.create("alice", "private")
    await store.append(mine.id, msg("user", "my secret plans"))

    with pytest.raises(ConversationForbidden) as get_error:
        await store.get(mine.id, "mallory")
    with pytest.raises(ConversationForbidden):
        await store.delete(mine.id, "mallory")

    assert "alice" not in str(get_error.value)  # an owner (an API key on REST) is never shown
    still_mine = await store.get(mine.id, "alice")
    assert (still_mine.id, still_mine.owner, still_mine.title) == (mine.id, "alice", "private")
    assert await store.messages(mine.id) == [{"role": "user", "content": "my secret plans"}]
    assert await store.list("mallory") == []


@pytest.mark.asyncio
async def test_list_shows_only_the_owners_conversations_most_recent_first(
    store: ConversationStore,
) -> None:
    first = await store.create("alice", "first")
    await store.create("bob", "bob's")
    second = await store.create("alice", "second")
    third = await store.create("alice", "third")

    assert [c.id for c in await store.list("alice")] == [third.id, second.id, first.id]
    assert [c.title for c in await store.list("alice", limit=2)] == ["third", "second"]

    await store.append(first.id, msg("user", "back to the first one"))

    assert [c.id for c in await store.list("alice")] == [first.id, third.id, second.id]


@pytest.mark.asyncio
async def test_messages_come_back_oldest_first(store: ConversationStore) -> None:
    conversation = await store.create("alice")
    turns = [
        ("user", "where do I live?"),
        ("assistant", "In Lyon."),
        ("user", "and what tea do I like?\nbe brief"),
        ("assistant", "Oolong 🍵"),
    ]
    for role, content in turns:
        await store.append(conversation.id, msg(role, content))

    assert await store.messages(conversation.id) == [
        {"role": role, "content": content} for role, content in turns
    ]


@pytest.mark.asyncio
async def test_a_page_holds_the_most_recent_messages_and_the_cursor_of_older_ones(
    store: ConversationStore,
) -> None:
    conversation = await store.create("alice")
    other = await store.create("alice")
    for i in range(7):
        await store.append(conversation.id, msg("user", f"m{i}"))
        await store.append(other.id, msg("user", f"other {i}"))

    def texts(messages: list[dict[str, Any]]) -> list[str]:
        return [m["content"] for m in messages]

    first = await store.page(conversation.id, 3)
    assert texts(first.messages) == ["m4", "m5", "m6"] and first.has_more
    assert first.first_id is not None
    second = await store.page(conversation.id, 3, int(first.first_id))
    assert texts(second.messages) == ["m1", "m2", "m3"] and second.has_more
    assert second.first_id is not None
    last = await store.page(conversation.id, 3, int(second.first_id))
    assert texts(last.messages) == ["m0"] and not last.has_more and last.first_id is None
    whole = await store.page(conversation.id, 7)
    assert texts(whole.messages) == [f"m{i}" for i in range(7)] and not whole.has_more


@pytest.mark.asyncio
async def test_a_page_stops_at_its_byte_cap_but_holds_at_least_one_message(
    store: ConversationStore,
) -> None:
    conversation = await store.create("alice")
    big = "x" * (PAGE_MAX_BYTES // 3 - 100)  # three fit, with their JSON around them
    for i in range(5):
        await store.append(conversation.id, msg("user", f"{i} {big}"))
    page = await store.page(conversation.id, 100)
    assert [m["content"][0] for m in page.messages] == ["2", "3", "4"] and page.has_more
    huge = await store.create("alice")
    await store.append(huge.id, msg("user", "y" * (PAGE_MAX_BYTES + 10)))
    alone = await store.page(huge.id, 100)
    assert len(alone.messages) == 1 and not alone.has_more


@pytest.mark.asyncio
async def test_concurrent_appends_are_all_kept(store: ConversationStore) -> None:
    conversation = await store.create("alice")

    await asyncio.gather(*(store.append(conversation.id, msg("user", f"m{i}")) for i in range(50)))

    stored = await store.messages(conversation.id)
    assert sorted(m["content"] for m in stored) == sorted(f"m{i}" for i in range(50))


@pytest.mark.asyncio
async def test_messages_of_one_conversation_do_not_leak_into_another(
    store: ConversationStore,
) -> None:
    a = await store.create("alice")
    b = await store.create("alice")
    await store.append(a.id, msg("user", "for a"))
    await store.append(b.id, msg("user", "for b"))

    assert await store.messages(a.id) == [{"role": "user", "content": "for a"}]
    assert await store.messages(b.id) == [{"role": "user", "content": "for b"}]


@pytest.mark.asyncio
async def test_append_bumps_updated_at_only(store: ConversationStore) -> None:
    created = await store.create("alice")

    await store.append(created.id, msg("user", "hi"))
    after = await store.get(created.id, "alice")

    assert after.created_at == created.created_at
    assert after.updated_at > created.updated_at


@pytest.mark.asyncio
async def test_delete_removes_the_conversation_and_its_messages(
    store: ConversationStore, db_path: Path, backend: str | None
) -> None:
    doomed = await store.create("alice")
    kept = await store.create("alice")
    await store.append(doomed.id, msg("user", "forget me"))
    await store.append(kept.id, msg("user", "keep me"))

    await store.delete(doomed.id, "alice")

    with pytest.raises(ConversationNotFound):
        await store.get(doomed.id, "alice")
    assert await store.messages(doomed.id) == []
    assert [c.id for c in await store.list("alice")] == [kept.id]
    assert await store.messages(kept.id) == [msg("user", "keep me")]
    if backend is None:
        with sqlite3.connect(db_path) as raw:
            rows = raw.execute("SELECT conversation_id FROM messages").fetchall()
        assert rows == [(kept.id,)]


@pytest.mark.asyncio
async def test_conversations_survive_a_restart(db_path: Path) -> None:
    first_run = SqliteConversationStore.open(db_path)
    try:
        conversation = await first_run.create("alice", "persistent")
        await first_run.append(conversation.id, msg("user", "remember this"))
        await first_run.append(conversation.id, msg("assistant", "I will."))
        before = await first_run.get(conversation.id, "alice")
    finally:
        first_run.close()

    second_run = SqliteConversationStore.open(db_path)
    try:
        assert await second_run.get(conversation.id, "alice") == before
        assert await second_run.list("alice") == [before]
        assert await second_run.messages(conversation.id) == [
            {"role": "user", "content": "remember this"},
            {"role": "assistant", "content": "I will."},
        ]
        # New messages go after the old ones.
        await second_run.append(conversation.id, msg("user", "still there?"))
        assert (await second_run.messages(conversation.id))[-1]["content"] == "still there?"
    finally:
        second_run.close()


def test_open_creates_the_directories_and_a_wal_database(db_path: Path) -> None:
    assert not db_path.parent.exists()

    SqliteConversationStore.open(db_path).close()

    assert db_path.is_file()
    with sqlite3.connect(db_path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_open_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "conversations.db"
    path.write_bytes(b"this is not sqlite, just some text long enough to have a header" * 4)

    with pytest.raises(sqlite3.DatabaseError):
        SqliteConversationStore.open(path)


@pytest.mark.asyncio
async def test_a_closed_store_refuses_work(db_path: Path) -> None:
    store = SqliteConversationStore.open(db_path)
    store.close()
    store.close()  # closing twice is harmless

    with pytest.raises(RuntimeError, match="closed"):
        await store.create("alice")


TOOL_TURN = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Lyon?"}], "name": "mia"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Lyon", "unit": "C"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21.5}'},
]


@pytest.mark.asyncio
async def test_messages_are_kept_whole(store: ConversationStore) -> None:
    conversation = await store.create("alice")
    await store.append(conversation.id, *TOOL_TURN[:2])
    await store.append(conversation.id, *TOOL_TURN[2:])
    assert await store.messages(conversation.id) == TOOL_TURN


@pytest.mark.asyncio
async def test_rows_of_the_first_schema_are_migrated_whole(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    with sqlite3.connect(db_path) as raw:
        raw.executescript(
            """
            CREATE TABLE conversations (id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT,
                created_us INTEGER NOT NULL, updated_us INTEGER NOT NULL);
            CREATE TABLE messages (seq INTEGER PRIMARY KEY AUTOINCREMENT,
                conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
                role TEXT NOT NULL, content TEXT NOT NULL, created_us INTEGER NOT NULL);
            INSERT INTO conversations VALUES ('conv_old', 'alice', NULL, 1, 1);
            INSERT INTO messages (conversation_id, role, content, created_us)
                VALUES ('conv_old', 'user', 'an "old" question', 1),
                       ('conv_old', 'assistant', 'an answer', 2);
            PRAGMA user_version = 1;
            """
        )
    store = SqliteConversationStore.open(db_path)
    try:
        assert await store.messages("conv_old") == [
            msg("user", 'an "old" question'),
            msg("assistant", "an answer"),
        ]
        await store.append("conv_old", TOOL_TURN[2])
        assert (await store.messages("conv_old"))[-1] == TOOL_TURN[2]
    finally:
        store.close()
    with sqlite3.connect(db_path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 2
