"""Conversation storage: one SQLite database file under ``ARONA_DATA_DIR``.

A conversation belongs to one owner (the JWT ``sub`` on JSON-RPC, the API key owner on REST) and
holds its messages in the order they were appended. The file survives restarts; deleting a
conversation deletes its messages with it (``ON DELETE CASCADE``).

All SQLite work runs on one dedicated worker thread that owns the connection. SQLite calls are
short, but a commit can still wait on the disk (a WAL checkpoint syncs the file), and that must
never stall the event loop that is streaming other users' answers. One thread also serializes
every statement, so the connection needs no lock and writers never contend with each other.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import sqlite3
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SCHEMA_VERSION = 1
_MAX_LIST = 1000
_SCHEMA = """
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
"""


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


def _row(row: tuple[str, str, str | None, int, int]) -> Conversation:
    return Conversation(row[0], row[1], row[2], _datetime(row[3]), _datetime(row[4]))


class ConversationStore:
    """Conversations and their messages in one SQLite file; see the module docstring."""

    def __init__(self, executor: ThreadPoolExecutor, connection: sqlite3.Connection) -> None:
        # Use :meth:`open`; the connection must only ever be used on ``executor``'s thread.
        self._executor = executor
        self._db = connection
        self._closed = False

    @classmethod
    def open(cls, path: Path) -> ConversationStore:
        """Open (creating if needed) the database at ``path``, its parent directories and schema."""
        path.parent.mkdir(parents=True, exist_ok=True)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arona-conversations")
        try:
            connection = executor.submit(_connect, path).result()
        except BaseException:
            executor.shutdown(wait=True)
            raise
        logger.debug("conversation store opened at %s", path)
        return cls(executor, connection)

    async def create(self, owner: str, title: str | None = None) -> Conversation:
        conversation_id = f"conv_{uuid.uuid4().hex}"

        def work(db: sqlite3.Connection) -> Conversation:
            now = _now_us()
            with db:
                db.execute(
                    "INSERT INTO conversations (id, owner, title, created_us, updated_us)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (conversation_id, owner, title, now, now),
                )
            return _row((conversation_id, owner, title, now, now))

        return await self._run(work)

    async def get(self, conversation_id: str, owner: str) -> Conversation:
        """The conversation, if ``owner`` owns it (else NotFound / Forbidden)."""

        def work(db: sqlite3.Connection) -> Conversation:
            row = db.execute(
                "SELECT id, owner, title, created_us, updated_us FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            if row is None:
                raise ConversationNotFound(conversation_id)
            if row[1] != owner:
                raise ConversationForbidden(conversation_id)
            return _row(row)

        return await self._run(work)

    async def list(self, owner: str, limit: int = 100) -> list[Conversation]:
        """The owner's conversations, most recently active (created or appended to) first."""
        limit = max(0, min(limit, _MAX_LIST))

        def work(db: sqlite3.Connection) -> list[Conversation]:
            rows = db.execute(
                "SELECT id, owner, title, created_us, updated_us FROM conversations"
                " WHERE owner = ? ORDER BY updated_us DESC, rowid DESC LIMIT ?",
                (owner, limit),
            ).fetchall()
            return [_row(row) for row in rows]

        return await self._run(work)

    async def delete(self, conversation_id: str, owner: str) -> None:
        """Delete the conversation and its messages, if ``owner`` owns it."""

        def work(db: sqlite3.Connection) -> None:
            with db:
                row = db.execute(
                    "SELECT owner FROM conversations WHERE id = ?", (conversation_id,)
                ).fetchone()
                if row is None:
                    raise ConversationNotFound(conversation_id)
                if row[0] != owner:
                    raise ConversationForbidden(conversation_id)
                db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

        await self._run(work)

    async def append(self, conversation_id: str, role: str, content: str) -> None:
        """Add a message at the end of the conversation and mark it as just updated."""

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
                db.execute(
                    "INSERT INTO messages (conversation_id, role, content, created_us)"
                    " VALUES (?, ?, ?, ?)",
                    (conversation_id, role, content, now),
                )

        await self._run(work)

    # ``builtins.list``: inside this class ``list`` names the method above.
    async def messages(self, conversation_id: str) -> builtins.list[dict[str, str]]:
        """``[{"role", "content"}]`` oldest first; an unknown id has none.

        Ownership is not checked here: callers go through :meth:`get` first.
        """

        def work(db: sqlite3.Connection) -> builtins.list[dict[str, str]]:
            rows = db.execute(
                "SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
            return [{"role": role, "content": content} for role, content in rows]

        return await self._run(work)

    def close(self) -> None:
        """Close the database; idempotent. Work already submitted finishes first."""
        if self._closed:
            return
        self._closed = True
        try:
            self._executor.submit(self._db.close).result()
        finally:
            self._executor.shutdown(wait=True)

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise RuntimeError("the conversation store is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, work, self._db)


def _connect(path: Path) -> sqlite3.Connection:
    # Autocommit off (the default isolation level): writes commit through ``with db:``.
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA journal_mode = WAL")
        # WAL + NORMAL: a commit does not wait for fsync; a power cut can lose the last
        # commits but never corrupts the file.
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
        db.execute("PRAGMA busy_timeout = 5000")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise RuntimeError(
                f"the conversation database {path} was written by a newer version"
                f" (schema {version} > {_SCHEMA_VERSION})"
            )
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
    except BaseException:
        db.close()
        raise
    return db
