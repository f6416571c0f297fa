"""The outbox in one SQLite file (``outbox.db`` under ``ARONA_DATA_DIR``): its schema's steps, the
file's side on one worker thread (:class:`OutboxFile`), and :class:`Outbox`, created only when
the first episode has to be kept.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from arona_common.database import SqliteStep, sqlite_erase, sqlite_migrate
from arona_grpc.episodes import Whose, sqlite_mark
from arona_grpc.outbox.model import (
    DEAD_COLUMNS,
    DEAD_LETTERS_KEPT,
    DEAD_LETTERS_SHOWN,
    ENTRY_COLUMNS,
    ENTRY_OVERHEAD_BYTES,
    OUTBOX_FILE,
    Counts,
    DeadLetter,
    Kept,
    OutboxClosed,
    OutboxEntry,
    T,
    dead_letters_of,
    entry_bytes,
    entry_of,
    now_us,
)

logger = logging.getLogger(__name__)


def _add_scope_ids(db: sqlite3.Connection) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(episodes)")}
    if "scope_id" not in columns:
        db.execute("ALTER TABLE episodes ADD COLUMN scope_id TEXT NOT NULL DEFAULT ''")


_SQLITE_STEPS: tuple[SqliteStep, ...] = (
    """
    CREATE TABLE IF NOT EXISTS episodes (
        seq        INTEGER PRIMARY KEY AUTOINCREMENT,
        text       TEXT NOT NULL,
        node_type  TEXT NOT NULL,
        queued_us  INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS counters (
        name   TEXT PRIMARY KEY,
        value  INTEGER NOT NULL
    );
    """,
    # 2: whose episode it is, for the episode index.
    _add_scope_ids,
    # 3: the caller's id of the episode, so that one sent again is not queued twice.
    """
    ALTER TABLE episodes ADD COLUMN episode_id TEXT NOT NULL DEFAULT '';
    CREATE INDEX IF NOT EXISTS episodes_by_id ON episodes (episode_id) WHERE episode_id != '';
    """,
    # 4: when the episode happened (NULL in rows of earlier versions: when it was queued).
    "ALTER TABLE episodes ADD COLUMN occurred_us INTEGER;",
    # 5: the bytes each episode takes (the bound), and the dead-letter list.
    f"""
    ALTER TABLE episodes ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
    UPDATE episodes SET bytes = length(CAST(text AS BLOB)) + length(CAST(node_type AS BLOB))
        + length(scope_id) + length(episode_id) + {ENTRY_OVERHEAD_BYTES};
    CREATE TABLE IF NOT EXISTS dead_letters (
        seq         INTEGER PRIMARY KEY AUTOINCREMENT,
        text        TEXT NOT NULL,
        node_type   TEXT NOT NULL,
        scope_id    TEXT NOT NULL,
        episode_id  TEXT NOT NULL,
        queued_us   INTEGER NOT NULL,
        occurred_us INTEGER,
        dead_us     INTEGER NOT NULL,
        reason      TEXT NOT NULL
    );
    """,
    # 6: whose principal an episode is, so that forgetting a principal finds its episodes.
    """
    ALTER TABLE episodes ADD COLUMN principal_id TEXT;
    ALTER TABLE dead_letters ADD COLUMN principal_id TEXT;
    """,
)


# Whether an episode id is queued. The index on the ids holds only episodes that have one: a
# query must say so to use it (the planner cannot tell that a parameter is not ''), or every
# writeback during an outage reads the whole outbox.
SQLITE_HAS = "SELECT 1 FROM episodes WHERE episode_id = ? AND episode_id != '' LIMIT 1"


_SQLITE_RECENT = (
    "SELECT dead_us, reason, length(text), scope_id FROM dead_letters"
    f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}"
)
_SQLITE_SET_COUNTER = (
    "INSERT INTO counters (name, value) VALUES (?, ?) "
    "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
)


class OutboxFile:
    """The SQLite side; every method runs on the worker thread."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self._path = path
        self._max = max_bytes
        self._db: sqlite3.Connection | None = None
        self._depth = 0
        self._bytes = 0
        self._dropped = 0
        self._dead = 0
        self._recent: tuple[DeadLetter, ...] = ()

    def load(self) -> Counts:
        """Open an existing file (a fresh start creates nothing) and read its counts."""
        if self._db is None and self._path.exists():
            self._open()
        return self._counts()

    def put(
        self,
        text: str,
        node_type: str,
        scope_id: str,
        episode_id: str,
        occurred_us: int | None,
        unless_queued: bool,
        principal_id: str,
    ) -> tuple[int | None, Counts]:
        db = self._opened()
        if unless_queued and episode_id and self.has(episode_id):
            return None, self._counts()
        size = entry_bytes(text, node_type, scope_id, episode_id)
        with db:
            cursor = db.execute(
                "INSERT INTO episodes (text, node_type, queued_us, scope_id, episode_id,"
                " occurred_us, bytes, principal_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (text, node_type, now_us(), scope_id, episode_id, occurred_us, size, principal_id),
            )
            seq = int(cursor.lastrowid or 0)
            self._depth += 1
            self._bytes += size
            if self._bytes > self._max:
                self._drop_oldest(db, seq)
        return seq, self._counts()

    def _drop_oldest(self, db: sqlite3.Connection, newest: int) -> None:
        """Drop the oldest episodes (never ``newest``) until the bytes fit the bound."""
        excess = self._bytes - self._max
        last = None
        freed = dropped = 0
        rows = db.execute("SELECT seq, bytes FROM episodes WHERE seq < ? ORDER BY seq", (newest,))
        for seq, size in rows:
            if freed >= excess:
                break
            last = int(seq)
            freed += int(size)
            dropped += 1
        rows.close()
        if last is None:
            return
        db.execute("DELETE FROM episodes WHERE seq <= ?", (last,))
        self._depth -= dropped
        self._bytes -= freed
        self._dropped += dropped
        db.execute(_SQLITE_SET_COUNTER, ("dropped", self._dropped))

    def has(self, episode_id: str) -> bool:
        if self._db is None:
            return False
        row = self._db.execute(SQLITE_HAS, (episode_id,)).fetchone()
        return row is not None

    def oldest(self, limit: int) -> list[OutboxEntry]:
        if self._db is None:
            return []
        rows = self._db.execute(
            f"SELECT {ENTRY_COLUMNS} FROM episodes ORDER BY seq LIMIT ?", (limit,)
        ).fetchall()
        return [entry_of(row) for row in rows]

    def remove(self, seqs: Sequence[int]) -> Counts:
        if self._db is not None and seqs:
            marks = ",".join("?" * len(seqs))
            with self._db:
                gone = self._db.execute(
                    "SELECT count(*), coalesce(sum(bytes), 0) FROM episodes"
                    f" WHERE seq IN ({marks})",
                    tuple(seqs),
                ).fetchone()
                self._db.execute(f"DELETE FROM episodes WHERE seq IN ({marks})", tuple(seqs))
            self._depth -= int(gone[0])
            self._bytes -= int(gone[1])
        return self._counts()

    def dead_letter(self, seq: int, reason: str) -> Counts:
        """Move one queued episode to the dead-letter list."""
        if self._db is None:
            return self._counts()
        with self._db:
            row = self._db.execute("SELECT bytes FROM episodes WHERE seq = ?", (seq,)).fetchone()
            if row is None:
                return self._counts()
            self._db.execute(
                f"INSERT INTO dead_letters ({DEAD_COLUMNS}, dead_us, reason)"
                f" SELECT {DEAD_COLUMNS}, ?, ? FROM episodes WHERE seq = ?",
                (now_us(), reason, seq),
            )
            self._db.execute("DELETE FROM episodes WHERE seq = ?", (seq,))
            self._depth -= 1
            self._bytes -= int(row[0])
            self._buried(self._db)
        return self._counts()

    def bury(
        self,
        text: str,
        node_type: str,
        scope_id: str,
        episode_id: str,
        occurred_us: int | None,
        reason: str,
        principal_id: str,
    ) -> Counts:
        """Add an episode that was never queued to the dead-letter list."""
        db = self._opened()
        now = now_us()
        with db:
            db.execute(
                f"INSERT INTO dead_letters ({DEAD_COLUMNS}, dead_us, reason)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (text, node_type, scope_id, episode_id, now, occurred_us)
                + (principal_id, now, reason),
            )
            self._buried(db)
        return self._counts()

    def forget(self, whose: Whose) -> Counts:
        """Remove the queued episodes and dead letters of ``whose``, leaving nothing of them
        in the file or its log."""
        if self._db is None and not self._path.exists():
            return self._counts()
        db = self._opened()
        condition, args = whose.where(sqlite_mark)
        with db:
            db.execute(f"DELETE FROM episodes WHERE {condition}", args)
            db.execute(f"DELETE FROM dead_letters WHERE {condition}", args)
            depth, size = db.execute(
                "SELECT count(*), coalesce(sum(bytes), 0) FROM episodes"
            ).fetchone()
            self._depth, self._bytes = int(depth), int(size)
            self._recent = dead_letters_of(db.execute(_SQLITE_RECENT).fetchall())
        sqlite_erase(db)
        return self._counts()

    def _buried(self, db: sqlite3.Connection) -> None:
        self._dead += 1
        db.execute(_SQLITE_SET_COUNTER, ("dead_letters", self._dead))
        db.execute(
            "DELETE FROM dead_letters WHERE seq <= (SELECT max(seq) FROM dead_letters) - ?",
            (DEAD_LETTERS_KEPT,),
        )
        self._recent = dead_letters_of(db.execute(_SQLITE_RECENT).fetchall())

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _opened(self) -> sqlite3.Connection:
        if self._db is None:
            self._open()
        assert self._db is not None
        return self._db

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self._path, isolation_level=None)
        try:
            # WAL + NORMAL: a commit survives a crash of this process without an fsync each.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=2000")
            # A removed episode is zeroed in the file, not left in a freed page.
            db.execute("PRAGMA secure_delete=ON")
            db.isolation_level = "DEFERRED"
            sqlite_migrate(db, _SQLITE_STEPS, f"the outbox {self._path}")
            depth, size = db.execute(
                "SELECT count(*), coalesce(sum(bytes), 0) FROM episodes"
            ).fetchone()
            self._depth, self._bytes = int(depth), int(size)
            counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
            self._dropped = int(counters.get("dropped", 0))
            self._dead = int(counters.get("dead_letters", 0))
            self._recent = dead_letters_of(db.execute(_SQLITE_RECENT).fetchall())
        except BaseException:
            db.close()
            raise
        self._db = db

    def _counts(self) -> Counts:
        return Counts(self._depth, self._dropped, self._bytes, self._dead, self._recent)


class Outbox(Kept):
    """Bounded FIFO of episodes in ``<data_dir>/outbox.db``; see the module docstring."""

    def __init__(self, data_dir: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("the outbox needs room for at least one byte")
        self.path = data_dir / OUTBOX_FILE
        super().__init__()
        self._file = OutboxFile(self.path, max_bytes)
        self._worker: ThreadPoolExecutor | None = None
        self._closed = False

    # One process owns this file: nothing to look for beyond its own episodes.
    shared = False

    @property
    def where(self) -> str:
        return str(self.path)

    async def refresh(self) -> None:
        """Re-read what other processes queued (nothing: the file is this process's)."""

    async def release(self, *seqs: int) -> None:
        """Give episodes back after a failed store (nothing to do with one process)."""

    async def load(self) -> None:
        """Read the counts of an outbox left by an earlier run (creates no file)."""
        self._settle(await self._run(self._file.load))

    def put(
        self,
        text: str,
        node_type: str,
        scope_id: str = "",
        episode_id: str = "",
        *,
        occurred_us: int | None = None,
        unless_queued: bool = False,
        principal_id: str = "",
    ) -> asyncio.Future[int | None]:
        """Queue one episode; a future of its sequence number.

        ``occurred_us``: when it happened, in POSIX microseconds (None: when it is queued).

        ``unless_queued``: an episode whose ``episode_id`` is already waiting is not queued
        again, and the future's result is None (one trip to the worker thread for both).
        The write is submitted now and commits even if the future is never awaited
        (a cancelled caller's episode is still kept). Raises :class:`OutboxClosed`
        after :meth:`aclose`.
        """
        if self._closed:
            raise OutboxClosed("the outbox is closed")
        self._unsettled += 1
        done: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

        def committed(job: asyncio.Future[tuple[int | None, Counts]]) -> None:
            self._unsettled -= 1
            if job.cancelled():
                done.cancel()
            elif (exc := job.exception()) is not None:
                # Said by the service, once per fault (arona_common.storage).
                done.set_exception(exc)
            else:
                seq, counts = job.result()
                self._settle(counts)
                done.set_result(seq)

        self._submit(
            self._file.put,
            text,
            node_type,
            scope_id,
            episode_id,
            occurred_us,
            unless_queued,
            principal_id,
        ).add_done_callback(committed)
        return done

    async def oldest(self, limit: int = 1) -> list[OutboxEntry]:
        """Up to ``limit`` of the oldest episodes, oldest first, to replay next."""
        return await self._run(self._file.oldest, limit)

    async def remove(self, *seqs: int) -> None:
        """Philia stored these episodes: they leave the outbox (one transaction)."""
        self._settle(await self._run(self._file.remove, seqs))

    async def dead_letter(self, seq: int, reason: str) -> None:
        """Philia refused this episode for what it is: to the dead-letter list."""
        self._settle(await self._run(self._file.dead_letter, seq, reason))

    async def bury(
        self,
        text: str,
        node_type: str,
        scope_id: str,
        episode_id: str,
        occurred_us: int | None,
        reason: str,
        principal_id: str = "",
    ) -> None:
        """Philia refused an episode that was never queued: to the dead-letter list."""
        if self._closed:
            raise OutboxClosed("the outbox is closed")
        self._settle(
            await self._run(
                self._file.bury,
                text,
                node_type,
                scope_id,
                episode_id,
                occurred_us,
                reason,
                principal_id,
            )
        )

    async def forget(self, whose: Whose) -> None:
        """Remove the queued episodes and dead letters of ``whose`` (see the file's
        :meth:`OutboxFile.forget`)."""
        self._settle(await self._run(self._file.forget, whose))

    async def aclose(self) -> None:
        """Finish every submitted write, then close the file."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            # FIFO worker: once close ran, every earlier write has committed.
            await asyncio.shield(self._submit(self._file.close))
            self._worker.shutdown(wait=False)

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        # Shielded: an abandoned caller must not leave the worker half-way through.
        return await asyncio.shield(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arona-outbox")
        return asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
