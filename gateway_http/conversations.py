"""Conversation storage: SQLite under ``ARONA_DATA_DIR``, or PostgreSQL shared by replicas.

A conversation belongs to one owner (the caller's principal: a JWT ``sub`` or an API key's
``key:…``) and holds its messages in the order they were appended, each **whole**: the
message as the client sent it (tool calls, tool call ids, names, content parts) and the
upstream's reply as it was returned, so a replayed history is exactly what was said.
Deleting a conversation deletes its messages with it.

:class:`ConversationStore` is the interface the turn pipeline uses; :func:`open_conversations`
picks the backend. :class:`SqliteConversationStore` keeps one file (``conversations.db``) on
one worker thread that owns the connection: a commit may wait on the disk and must never
stall the event loop. :class:`PostgresConversationStore` uses the process's connection pool;
when the database is unreachable its calls raise
:class:`~arona_common.database.DatabaseUnavailable` at once.
"""

from __future__ import annotations

import builtins
import logging
import sqlite3
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

from arona_common.database import (
    DatabaseUnavailable,
    SqliteThread,
    run_on,
    sqlite_erase,
    sqlite_open,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

CONVERSATIONS_FILE = "conversations.db"
_MAX_LIST = 1000
# A page of a conversation's messages (``GET /v1/conversations/{id}``, ``conversations.get``):
# the most recent ``limit`` messages (default and maximum below), and never more than
# PAGE_MAX_BYTES of them (at least one), so no answer grows with the conversation.
PAGE_DEFAULT_MESSAGES = 100
PAGE_MAX_MESSAGES = 1000
PAGE_MAX_BYTES = 4 * 2**20
_NO_CURSOR = 2**63 - 1
_SQLITE_STEPS = (
    # 1: conversations and their messages as role + text.
    """
    CREATE TABLE IF NOT EXISTS conversations (
        id          TEXT PRIMARY KEY,
        owner       TEXT NOT NULL,
        title       TEXT,
        created_us  INTEGER NOT NULL,  -- microseconds since the epoch, UTC
        updated_us  INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS conversations_by_owner
        ON conversations (owner, updated_us DESC);
    CREATE TABLE IF NOT EXISTS messages (
        seq             INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        role            TEXT NOT NULL,
        content         TEXT NOT NULL,
        created_us      INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS messages_by_conversation
        ON messages (conversation_id, seq);
    """,
    # 2: each message whole, as JSON; the rows of version 1 become {role, content}.
    """
    ALTER TABLE messages ADD COLUMN body TEXT;
    UPDATE messages SET body = json_object('role', role, 'content', content);
    """,
)


class ConversationNotFound(Exception):
    """No conversation has this id."""


class ConversationForbidden(Exception):
    """The conversation exists but belongs to another owner."""


@dataclass(frozen=True)
class Conversation:
    id: str
    owner: str
    title: str | None
    created_at: datetime
    updated_at: datetime


def _now_us() -> int:
    return int(datetime.now(UTC).timestamp() * 1_000_000)


def _datetime(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1_000_000, UTC)


def _conversation(row: Sequence[Any]) -> Conversation:
    return Conversation(row[0], row[1], row[2], _datetime(row[3]), _datetime(row[4]))


def _encoded(message: Mapping[str, Any]) -> tuple[str, str]:
    """(role, JSON) of one message to store."""
    return str(message.get("role", "")), orjson.dumps(message).decode()


def _new_id() -> str:
    return f"conv_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class MessagesPage:
    """The most recent messages before a cursor, oldest first; ``first_id`` is the cursor of
    the first of them when older messages remain (pass it as ``before`` for those), else None."""

    messages: list[dict[str, Any]]
    first_id: str | None

    @property
    def has_more(self) -> bool:
        return self.first_id is not None


def parse_cursor(before: str | None) -> int:
    """A ``before`` cursor as the key it stands for (ValueError when it is none of ours)."""
    if before is None:
        return _NO_CURSOR
    refusal = ValueError("'before' must be a cursor from 'first_id'")
    if not before.isascii() or not before.isdigit() or len(before.lstrip("0")) > 19:
        raise refusal
    key = int(before)
    if key >= _NO_CURSOR:
        raise refusal
    return key


def _page(rows: Sequence[Sequence[Any]], limit: int) -> MessagesPage:
    """A page from rows of (key, body), newest first, at most ``limit + 1`` of them."""
    taken: list[dict[str, Any]] = []
    size = 0
    first: int | None = None
    for index, (_key, body) in enumerate(rows):
        size += len(body)
        if index == limit or (taken and size > PAGE_MAX_BYTES):
            first = int(rows[index - 1][0])
            break
        taken.append(orjson.loads(body))
    taken.reverse()
    return MessagesPage(taken, None if first is None else str(first))


class ConversationStore(Protocol):
    """What the turn pipeline and the conversation routes need (one per backend)."""

    async def create(self, owner: str, title: str | None = None) -> Conversation: ...

    async def get(self, conversation_id: str, owner: str) -> Conversation:
        """The conversation, if ``owner`` owns it (else NotFound / Forbidden)."""
        ...

    async def list(self, owner: str, limit: int = 100) -> builtins.list[Conversation]:
        """The owner's conversations, most recently active first."""
        ...

    async def delete(self, conversation_id: str, owner: str) -> None:
        """Delete one of the owner's conversations and its messages, leaving nothing of them
        in the database's files (its write-ahead log included) once this returns."""
        ...

    async def forget(self, owner: str | None) -> int:
        """Delete every conversation of ``owner`` (None: everyone's) as :meth:`delete` does;
        how many."""
        ...

    async def append(self, conversation_id: str, *messages: Mapping[str, Any]) -> None:
        """Add whole messages at the end, in one transaction, and mark it as just updated."""
        ...

    async def messages(self, conversation_id: str) -> builtins.list[dict[str, Any]]:
        """Every message, oldest first, exactly as stored (ownership is checked by ``get``)."""
        ...

    async def page(
        self, conversation_id: str, limit: int = PAGE_DEFAULT_MESSAGES, before: int = _NO_CURSOR
    ) -> MessagesPage:
        """The ``limit`` most recent messages before the cursor ``before``, as a page."""
        ...

    async def aclose(self) -> None: ...


class SqliteConversationStore:
    """:class:`ConversationStore` in one SQLite file; see the module docstring."""

    def __init__(self, path: Path) -> None:
        """Open (creating if needed) the database at ``path``, its parent directories and schema."""
        self._thread = SqliteThread(path, _connect, "arona-conversations", "the conversation store")
        logger.debug("conversation store opened at %s", path)

    @classmethod
    def open(cls, path: Path) -> SqliteConversationStore:
        return cls(path)

    async def create(self, owner: str, title: str | None = None) -> Conversation:
        conversation_id = _new_id()

        def work(db: sqlite3.Connection) -> Conversation:
            now = _now_us()
            with db:
                db.execute(
                    "INSERT INTO conversations (id, owner, title, created_us, updated_us)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (conversation_id, owner, title, now, now),
                )
            return _conversation((conversation_id, owner, title, now, now))

        return await self._run(work)

    async def get(self, conversation_id: str, owner: str) -> Conversation:
        def work(db: sqlite3.Connection) -> Conversation:
            row = db.execute(
                "SELECT id, owner, title, created_us, updated_us FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            return _owned(row, conversation_id, owner)

        return await self._run(work)

    async def list(self, owner: str, limit: int = 100) -> builtins.list[Conversation]:
        limit = max(0, min(limit, _MAX_LIST))

        def work(db: sqlite3.Connection) -> builtins.list[Conversation]:
            rows = db.execute(
                "SELECT id, owner, title, created_us, updated_us FROM conversations"
                " WHERE owner = ? ORDER BY updated_us DESC, rowid DESC LIMIT ?",
                (owner, limit),
            ).fetchall()
            return [_conversation(row) for row in rows]

        return await self._run(work)

    async def delete(self, conversation_id: str, owner: str) -> None:
        def work(db: sqlite3.Connection) -> None:
            with db:
                row = db.execute(
                    "SELECT owner FROM conversations WHERE id = ?", (conversation_id,)
                ).fetchone()
                _check_owner(row, conversation_id, owner)
                db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            sqlite_erase(db)

        await self._run(work)

    async def forget(self, owner: str | None) -> int:
        def work(db: sqlite3.Connection) -> int:
            with db:
                if owner is None:
                    cursor = db.execute("DELETE FROM conversations")
                else:
                    cursor = db.execute("DELETE FROM conversations WHERE owner = ?", (owner,))
                gone = cursor.rowcount
            sqlite_erase(db)
            return int(gone)

        return await self._run(work)

    async def append(self, conversation_id: str, *messages: Mapping[str, Any]) -> None:
        rows = [_encoded(m) for m in messages]

        def work(db: sqlite3.Connection) -> None:
            now = _now_us()
            with db:
                # max() keeps updated_at moving forward even if the wall clock steps back.
                updated = db.execute(
                    "UPDATE conversations SET updated_us = max(updated_us + 1, ?) WHERE id = ?",
                    (now, conversation_id),
                )
                if updated.rowcount == 0:
                    raise ConversationNotFound(conversation_id)
                db.executemany(
                    "INSERT INTO messages (conversation_id, role, content, body, created_us)"
                    " VALUES (?, ?, '', ?, ?)",
                    [(conversation_id, role, body, now) for role, body in rows],
                )

        await self._run(work)

    async def messages(self, conversation_id: str) -> builtins.list[dict[str, Any]]:
        def work(db: sqlite3.Connection) -> builtins.list[dict[str, Any]]:
            rows = db.execute(
                "SELECT body FROM messages WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
            return [orjson.loads(body) for (body,) in rows]

        return await self._run(work)

    async def page(
        self, conversation_id: str, limit: int = PAGE_DEFAULT_MESSAGES, before: int = _NO_CURSOR
    ) -> MessagesPage:
        def work(db: sqlite3.Connection) -> MessagesPage:
            rows = db.execute(
                "SELECT seq, body FROM messages WHERE conversation_id = ? AND seq < ?"
                " ORDER BY seq DESC LIMIT ?",
                (conversation_id, before, limit + 1),
            ).fetchall()
            return _page(rows, limit)

        return await self._run(work)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the database; idempotent. Work already submitted finishes first."""
        self._thread.close()

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await self._thread.run(work)


# Deleted rows leave the tables' pages at once rather than at autovacuum's next pass (what
# PostgreSQL's own write-ahead log keeps is the database's: docs/forgetting.md).
_VACUUM = "VACUUM conversations, messages"


class PostgresConversationStore:
    """:class:`ConversationStore` in PostgreSQL, shared by every replica."""

    def __init__(self, pool: Any, url: str) -> None:
        self._pool = pool
        self._url = url

    async def create(self, owner: str, title: str | None = None) -> Conversation:
        conversation_id = _new_id()
        now = _now_us()

        async def work(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO conversations (id, owner, title, created_us, updated_us)"
                " VALUES ($1, $2, $3, $4, $4)",
                conversation_id,
                owner,
                title,
                now,
            )

        await self._run(work)
        return _conversation((conversation_id, owner, title, now, now))

    async def get(self, conversation_id: str, owner: str) -> Conversation:
        async def work(conn: Any) -> Conversation:
            row = await conn.fetchrow(
                "SELECT id, owner, title, created_us, updated_us FROM conversations WHERE id = $1",
                conversation_id,
            )
            return _owned(row, conversation_id, owner)

        return await self._run(work)

    async def list(self, owner: str, limit: int = 100) -> builtins.list[Conversation]:
        limit = max(0, min(limit, _MAX_LIST))

        async def work(conn: Any) -> builtins.list[Conversation]:
            rows = await conn.fetch(
                "SELECT id, owner, title, created_us, updated_us FROM conversations"
                " WHERE owner = $1 ORDER BY updated_us DESC, created_us DESC, id LIMIT $2",
                owner,
                limit,
            )
            return [_conversation(row) for row in rows]

        return await self._run(work)

    async def delete(self, conversation_id: str, owner: str) -> None:
        async def work(conn: Any) -> None:
            async with conn.transaction():
                row = await conn.fetchrow(
                    "SELECT owner FROM conversations WHERE id = $1 FOR UPDATE", conversation_id
                )
                _check_owner(row, conversation_id, owner)
                await conn.execute("DELETE FROM conversations WHERE id = $1", conversation_id)
            await conn.execute(_VACUUM)

        await self._run(work)

    async def forget(self, owner: str | None) -> int:
        async def work(conn: Any) -> int:
            if owner is None:
                done = await conn.execute("DELETE FROM conversations")
            else:
                done = await conn.execute("DELETE FROM conversations WHERE owner = $1", owner)
            await conn.execute(_VACUUM)
            return int(done.rsplit(" ", 1)[-1])

        return await self._run(work)

    async def append(self, conversation_id: str, *messages: Mapping[str, Any]) -> None:
        rows = [_encoded(m) for m in messages]

        async def work(conn: Any) -> None:
            now = _now_us()
            async with conn.transaction():
                updated = await conn.execute(
                    "UPDATE conversations SET updated_us = greatest(updated_us + 1, $1)"
                    " WHERE id = $2",
                    now,
                    conversation_id,
                )
                if updated.endswith(" 0"):
                    raise ConversationNotFound(conversation_id)
                await conn.executemany(
                    "INSERT INTO messages (conversation_id, role, body, created_us)"
                    " VALUES ($1, $2, $3, $4)",
                    [(conversation_id, role, body, now) for role, body in rows],
                )

        await self._run(work)

    async def messages(self, conversation_id: str) -> builtins.list[dict[str, Any]]:
        async def work(conn: Any) -> builtins.list[dict[str, Any]]:
            rows = await conn.fetch(
                "SELECT body FROM messages WHERE conversation_id = $1 ORDER BY seq",
                conversation_id,
            )
            return [orjson.loads(row[0]) for row in rows]

        return await self._run(work)

    async def page(
        self, conversation_id: str, limit: int = PAGE_DEFAULT_MESSAGES, before: int = _NO_CURSOR
    ) -> MessagesPage:
        async def work(conn: Any) -> MessagesPage:
            rows = await conn.fetch(
                "SELECT seq, body FROM messages WHERE conversation_id = $1 AND seq < $2"
                " ORDER BY seq DESC LIMIT $3",
                conversation_id,
                before,
                limit + 1,
            )
            return _page([tuple(row) for row in rows], limit)

        return await self._run(work)

    async def aclose(self) -> None:
        """The pool belongs to the process; nothing of its own to close."""

    async def _run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        return await run_on(self._pool, self._url, work)


def _owned(row: Sequence[Any] | None, conversation_id: str, owner: str) -> Conversation:
    _check_owner(row, conversation_id, owner, column=1)
    assert row is not None
    return _conversation(row)


def _check_owner(
    row: Sequence[Any] | None, conversation_id: str, owner: str, column: int = 0
) -> None:
    if row is None:
        raise ConversationNotFound(conversation_id)
    if row[column] != owner:
        raise ConversationForbidden(conversation_id)


def open_conversations(data_dir: Path, pool: Any | None, url: str | None) -> ConversationStore:
    """PostgreSQL when a pool is given, else ``conversations.db`` under ``data_dir``."""
    if pool is not None:
        assert url is not None
        return PostgresConversationStore(pool, url)
    return SqliteConversationStore.open(data_dir / CONVERSATIONS_FILE)


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite_open(path, _SQLITE_STEPS, f"the conversation database {path}", foreign_keys=True)


__all__ = [
    "Conversation",
    "ConversationForbidden",
    "ConversationNotFound",
    "ConversationStore",
    "DatabaseUnavailable",
    "PostgresConversationStore",
    "SqliteConversationStore",
    "open_conversations",
]
