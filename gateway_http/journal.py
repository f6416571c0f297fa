"""Durable before answered: the HTTP layer's journal of episodes on their way to memory.

A turn's writeback runs in the background after the reply, so a process killed hard (SIGKILL,
the OOM killer) a few milliseconds after answering would lose the episodes still in flight.
Each episode is therefore written to a local SQLite journal (WAL, no fsync per turn: a
process crash loses nothing, a power cut at most the last moments) before the reply's last
byte leaves, and dropped once the ``MemoryService`` has stored it or queued it in its outbox.
What is left at start (or after the gRPC service was unreachable) is sent again.

The journal is written on the event loop's thread: an insert and its commit take tens of
microseconds, less than a hop to a worker thread. An episode taken by the service is dropped
in the next insert's transaction (one commit a turn, not two), or within
:data:`DROP_DELAY_S` when no insert comes; a process killed meanwhile sends those episodes
again (the service knows them by their ids while they wait in its outbox; one it has stored
already may be stored twice, as after any crash between storing and dropping). WAL checkpoints,
which do sync the disk, run on a thread of their own every :data:`CHECKPOINT_EVERY` writes.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from arona_grpc.database import sqlite_migrate

logger = logging.getLogger(__name__)

CHECKPOINT_EVERY = 500
# The longest an episode the service took stays in the journal when no turn comes.
DROP_DELAY_S = 0.5
# Drops written together at most (SQLite's host parameters).
MAX_DROPS = 256
_STEPS = (
    """
    CREATE TABLE IF NOT EXISTS episodes (
        id         INTEGER PRIMARY KEY AUTOINCREMENT,
        user_text  TEXT NOT NULL,
        assistant  TEXT NOT NULL,
        scope      TEXT NOT NULL,
        -- Sent with the episode, so the service knows it again if it was already queued.
        episode_id TEXT NOT NULL,
        added_us   INTEGER NOT NULL
    );
    """,
)


_INSERT = (
    "INSERT INTO episodes (user_text, assistant, scope, episode_id, added_us)"
    " VALUES (?, ?, ?, ?, ?)"
)


def journal_path(data_dir: Path, worker: int) -> Path:
    """Each HTTP process has its own journal (``serve --workers``: one per worker)."""
    return data_dir / ("journal.db" if worker == 0 else f"journal-{worker}.db")


@dataclass(frozen=True)
class Journaled:
    id: int
    user: str
    assistant: str
    scope: str
    episode_id: str


class Journal:
    """Episodes answered but not yet taken by the memory service; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        # Checkpoints run on their own thread (below), never inside a turn's commit.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        sqlite_migrate(self._db, _STEPS, f"the journal {path}")
        self._writes = 0
        # Taken by the service, to be deleted with the next write.
        self._dropped: list[int] = []
        self._drop_timer: asyncio.TimerHandle | None = None
        self._checkpointing = threading.Lock()
        self._closed = False

    def add(self, user: str, assistant: str, scope: str) -> Journaled:
        """Keep one episode (committed when this returns)."""
        episode_id = uuid.uuid4().hex
        row = (user, assistant, scope, episode_id, int(time.time() * 1_000_000))
        if self._dropped:
            db = self._db
            dropped = self._dropped
            db.execute("BEGIN")
            try:
                self._delete_dropped()
                cursor = db.execute(_INSERT, row)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                self._dropped = dropped + self._dropped
                raise
        else:
            cursor = self._db.execute(_INSERT, row)
        self._wrote()
        return Journaled(int(cursor.lastrowid or 0), user, assistant, scope, episode_id)

    def drop(self, entry_id: int) -> None:
        """The memory service has the episode: forget it here (with the next write, or
        within :data:`DROP_DELAY_S`)."""
        if self._closed:
            return
        self._dropped.append(entry_id)
        if len(self._dropped) >= MAX_DROPS:
            self.flush_drops()
        elif self._drop_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush_drops()
                return
            self._drop_timer = loop.call_later(DROP_DELAY_S, self.flush_drops)

    def flush_drops(self) -> None:
        """Delete the dropped episodes now."""
        if self._drop_timer is not None:
            self._drop_timer.cancel()
            self._drop_timer = None
        if self._dropped and not self._closed:
            self._delete_dropped()
            self._wrote()

    def _delete_dropped(self) -> None:
        dropped, self._dropped = self._dropped, []
        marks = ",".join("?" * len(dropped))
        self._db.execute(f"DELETE FROM episodes WHERE id IN ({marks})", dropped)

    def pending(self) -> list[Journaled]:
        """Every episode still journaled, oldest first."""
        self.flush_drops()
        rows = self._db.execute(
            "SELECT id, user_text, assistant, scope, episode_id FROM episodes ORDER BY id"
        ).fetchall()
        return [Journaled(int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4])) for r in rows]

    def close(self) -> None:
        if self._closed:
            return
        self.flush_drops()
        self._closed = True
        with self._checkpointing:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._db.close()

    def _wrote(self) -> None:
        self._writes += 1
        if self._writes % CHECKPOINT_EVERY == 0:
            threading.Thread(target=self._checkpoint, name="journal-checkpoint").start()

    def _checkpoint(self) -> None:
        with self._checkpointing:
            if self._closed:
                return
            try:
                checkpoint = sqlite3.connect(self.path, timeout=5.0)
                try:
                    checkpoint.execute("PRAGMA wal_checkpoint(PASSIVE)")
                finally:
                    checkpoint.close()
            except sqlite3.Error as exc:
                logger.debug("journal checkpoint failed: %s", exc)
