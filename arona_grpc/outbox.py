"""The writeback outbox: episodes that could not be stored, kept until replayed.

One SQLite file (``outbox.db`` under ``ARONA_DATA_DIR``), or a PostgreSQL table shared by the
replicas, holds a FIFO of episodes keyed by an ever-growing sequence number, so that replay
order is queue order. It is bounded by the **bytes** its episodes take
(``ARONA_MEMORY_OUTBOX_MAX_MB``, default 256: each episode counts its text, its other fields
and :data:`ENTRY_OVERHEAD_BYTES`), not by a count: when a new episode would overflow it, the
**oldest** entries are dropped (the newest turns are the ones a user is most likely to ask
about next) and counted; the count survives restarts and is reported by Status.

The replay takes the oldest episodes a batch at a time (:meth:`Outbox.oldest`), removes those
Philia stored in one transaction, and moves one Philia refused for what it is (too large,
invalid: sending it again would be refused again) to the **dead-letter list**
(:meth:`Outbox.dead_letter`), so it never holds up the episodes behind it. Dead letters keep
their text on disk for an operator (the newest :data:`DEAD_LETTERS_KEPT`); their count and the
reasons of the last few (no text) are reported by Status.

The file is created only when the first episode has to be kept, so a healthy gateway
never pays for SQLite: the domain stores episodes straight to Philia and consults only
:attr:`Outbox.pending`, an in-memory mirror. All SQLite work runs on one worker thread
that owns the connection, in submission order (a commit may wait on the disk, which must
not stall the event loop). Work already submitted completes even if its caller is
cancelled, which is what keeps an episode queued during shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from arona_common.database import SqliteStep, run_on, sqlite_erase, sqlite_migrate
from arona_common.redact import redact_url
from arona_grpc.config import Settings
from arona_grpc.episodes import Whose, postgres_mark, sqlite_mark
from arona_grpc.failure_log import FailureLog

logger = logging.getLogger(__name__)

T = TypeVar("T")

OUTBOX_FILE = "outbox.db"
# What one queued episode costs beyond its fields' bytes (row, index entries, page slack).
ENTRY_OVERHEAD_BYTES = 100
# Dead letters kept with their text; older ones are removed (their count stays).
DEAD_LETTERS_KEPT = 1000
# Dead letters Status shows, newest first.
DEAD_LETTERS_SHOWN = 5


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


class OutboxClosed(RuntimeError):
    """The outbox was closed; nothing more can be queued."""


@dataclass(frozen=True)
class OutboxEntry:
    seq: int
    text: str
    node_type: str
    # Whose episode it is (for the episode index); "" when nobody's.
    scope_id: str = ""
    # The caller's id of the episode ("" for none).
    episode_id: str = ""
    # When it happened, in POSIX microseconds (queued without a time: when it was queued).
    occurred_us: int = 0
    # The scope id of its scope's principal ("" for nobody's or unknown).
    principal_id: str = ""


@dataclass(frozen=True)
class DeadLetter:
    """An episode Philia refused for what it is, as Status shows it (never its text)."""

    # Wall-clock seconds when it was refused.
    at: float
    reason: str
    # The length of its text, in characters.
    chars: int
    scope_id: str = ""


@dataclass(frozen=True)
class _Counts:
    depth: int
    dropped: int
    bytes: int = 0
    dead: int = 0
    # The newest dead letters, newest first.
    recent: tuple[DeadLetter, ...] = ()


def entry_bytes(text: str, node_type: str, scope_id: str, episode_id: str) -> int:
    """What one queued episode counts against the outbox's bound."""
    return (
        len(text.encode("utf-8", "surrogatepass"))
        + len(node_type.encode("utf-8", "surrogatepass"))
        + len(scope_id)
        + len(episode_id)
        + ENTRY_OVERHEAD_BYTES
    )


# Whether an episode id is queued. The index on the ids holds only episodes that have one: a
# query must say so to use it (the planner cannot tell that a parameter is not ''), or every
# writeback during an outage reads the whole outbox.
SQLITE_HAS = "SELECT 1 FROM episodes WHERE episode_id = ? AND episode_id != '' LIMIT 1"
PG_PUT = (
    "INSERT INTO outbox"
    " (text, node_type, scope_id, queued_us, episode_id, occurred_us, bytes, principal_id)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING seq"
)
# No row (seq NULL) when the episode is already queued (the same lookup as SQLITE_HAS).
PG_PUT_UNLESS_QUEUED = (
    "INSERT INTO outbox"
    " (text, node_type, scope_id, queued_us, episode_id, occurred_us, bytes, principal_id)"
    " SELECT $1, $2, $3, $4, $5::text, $6::bigint, $7, $8 WHERE NOT EXISTS"
    " (SELECT 1 FROM outbox WHERE episode_id = $5::text AND episode_id <> '')"
    " RETURNING seq"
)
# The columns of an OutboxEntry, on both backends.
_ENTRY_COLUMNS = (
    "seq, text, node_type, scope_id, episode_id, coalesce(occurred_us, queued_us),"
    " coalesce(principal_id, '')"
)
# What a dead letter keeps of a queued episode (the same columns on both backends).
_DEAD_COLUMNS = "text, node_type, scope_id, episode_id, queued_us, occurred_us, principal_id"
_SQLITE_RECENT = (
    "SELECT dead_us, reason, length(text), scope_id FROM dead_letters"
    f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}"
)
_SQLITE_SET_COUNTER = (
    "INSERT INTO counters (name, value) VALUES (?, ?) "
    "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
)


def _now_us() -> int:
    return int(time.time() * 1_000_000)


def _entry(row: Any) -> OutboxEntry:
    return OutboxEntry(
        int(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]), int(row[5]), str(row[6])
    )


def _dead_letters(rows: Sequence[Any]) -> tuple[DeadLetter, ...]:
    return tuple(DeadLetter(int(r[0]) / 1_000_000, str(r[1]), int(r[2]), str(r[3])) for r in rows)


class _OutboxFile:
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

    def load(self) -> _Counts:
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
    ) -> tuple[int | None, _Counts]:
        db = self._opened()
        if unless_queued and episode_id and self.has(episode_id):
            return None, self._counts()
        size = entry_bytes(text, node_type, scope_id, episode_id)
        with db:
            cursor = db.execute(
                "INSERT INTO episodes (text, node_type, queued_us, scope_id, episode_id,"
                " occurred_us, bytes, principal_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (text, node_type, _now_us(), scope_id, episode_id, occurred_us, size, principal_id),
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
            f"SELECT {_ENTRY_COLUMNS} FROM episodes ORDER BY seq LIMIT ?", (limit,)
        ).fetchall()
        return [_entry(row) for row in rows]

    def remove(self, seqs: Sequence[int]) -> _Counts:
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

    def dead_letter(self, seq: int, reason: str) -> _Counts:
        """Move one queued episode to the dead-letter list."""
        if self._db is None:
            return self._counts()
        with self._db:
            row = self._db.execute("SELECT bytes FROM episodes WHERE seq = ?", (seq,)).fetchone()
            if row is None:
                return self._counts()
            self._db.execute(
                f"INSERT INTO dead_letters ({_DEAD_COLUMNS}, dead_us, reason)"
                f" SELECT {_DEAD_COLUMNS}, ?, ? FROM episodes WHERE seq = ?",
                (_now_us(), reason, seq),
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
    ) -> _Counts:
        """Add an episode that was never queued to the dead-letter list."""
        db = self._opened()
        now = _now_us()
        with db:
            db.execute(
                f"INSERT INTO dead_letters ({_DEAD_COLUMNS}, dead_us, reason)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (text, node_type, scope_id, episode_id, now, occurred_us)
                + (principal_id, now, reason),
            )
            self._buried(db)
        return self._counts()

    def forget(self, whose: Whose) -> _Counts:
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
            self._recent = _dead_letters(db.execute(_SQLITE_RECENT).fetchall())
        sqlite_erase(db)
        return self._counts()

    def _buried(self, db: sqlite3.Connection) -> None:
        self._dead += 1
        db.execute(_SQLITE_SET_COUNTER, ("dead_letters", self._dead))
        db.execute(
            "DELETE FROM dead_letters WHERE seq <= (SELECT max(seq) FROM dead_letters) - ?",
            (DEAD_LETTERS_KEPT,),
        )
        self._recent = _dead_letters(db.execute(_SQLITE_RECENT).fetchall())

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
            self._recent = _dead_letters(db.execute(_SQLITE_RECENT).fetchall())
        except BaseException:
            db.close()
            raise
        self._db = db

    def _counts(self) -> _Counts:
        return _Counts(self._depth, self._dropped, self._bytes, self._dead, self._recent)


class _Kept:
    """What both outboxes keep in memory: the counts last seen, and the puts handed over but
    not yet committed (the queue is non-empty from the moment an episode is handed over, so
    later writebacks line up behind it at once)."""

    def __init__(self) -> None:
        self._counts = _Counts(0, 0)
        self._unsettled = 0
        self._drops = FailureLog(logger, "the outbox")

    @property
    def depth(self) -> int:
        """Episodes waiting (including ones handed over but not yet committed)."""
        return self._counts.depth + self._unsettled

    @property
    def bytes(self) -> int:
        """The bytes the waiting episodes count against the bound."""
        return self._counts.bytes

    @property
    def dropped(self) -> int:
        """Episodes dropped on overflow, over the outbox's whole life."""
        return self._counts.dropped

    @property
    def dead_letters(self) -> int:
        """Episodes Philia refused for what they are, over the outbox's whole life."""
        return self._counts.dead

    @property
    def recent_dead_letters(self) -> tuple[DeadLetter, ...]:
        """The newest dead letters (at most :data:`DEAD_LETTERS_SHOWN`), newest first."""
        return self._counts.recent

    @property
    def pending(self) -> bool:
        # Asked on every writeback and every successful call: kept to two reads.
        return self._counts.depth > 0 or self._unsettled > 0

    def _settle(self, counts: _Counts) -> None:
        before = self._counts.dropped
        self._counts = counts
        if counts.dropped > before:
            # Once full, every new episode drops some: a warning per period, not each.
            self._drops.failed(
                f"outbox full: dropped {counts.dropped - before} oldest episode(s) "
                f"({counts.dropped} in all)"
            )


class Outbox(_Kept):
    """Bounded FIFO of episodes in ``<data_dir>/outbox.db``; see the module docstring."""

    def __init__(self, data_dir: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("the outbox needs room for at least one byte")
        self.path = data_dir / OUTBOX_FILE
        super().__init__()
        self._file = _OutboxFile(self.path, max_bytes)
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

        def committed(job: asyncio.Future[tuple[int | None, _Counts]]) -> None:
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
        :meth:`_OutboxFile.forget`)."""
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


# Every write to the shared outbox takes this row's lock first, so the counters stay exact
# and two writers never wait for each other's rows in opposite orders.
_PG_LOCK = "SELECT value FROM outbox_counters WHERE name = 'bytes' FOR UPDATE"
_PG_ADD = (
    "UPDATE outbox_counters SET value = value + CASE name"
    " WHEN 'depth' THEN $1::bigint WHEN 'bytes' THEN $2::bigint"
    " WHEN 'dropped' THEN $3::bigint WHEN 'dead_letters' THEN $4::bigint END"
    " WHERE name IN ('depth', 'bytes', 'dropped', 'dead_letters')"
)
_PG_COUNTS = (
    "SELECT coalesce(max(value) FILTER (WHERE name = 'depth'), 0),"
    " coalesce(max(value) FILTER (WHERE name = 'bytes'), 0),"
    " coalesce(max(value) FILTER (WHERE name = 'dropped'), 0),"
    " coalesce(max(value) FILTER (WHERE name = 'dead_letters'), 0)"
    " FROM outbox_counters"
)
_PG_RECENT = (
    "SELECT dead_us, reason, char_length(text), scope_id FROM outbox_dead_letters"
    f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}"
)
_PG_PRUNE = (
    "DELETE FROM outbox_dead_letters WHERE seq <= (SELECT max(seq) FROM outbox_dead_letters) - $1"
)


class PostgresOutbox(_Kept):
    """The outbox as a table shared by every gRPC replica (``ARONA_DATABASE_URL``).

    Replicas replay it together, oldest first, without storing an episode twice in normal
    recovery: :meth:`oldest` claims rows (``FOR UPDATE SKIP LOCKED``) for
    ``ARONA_MEMORY_OUTBOX_CLAIM_S``; a claim is dropped with the row once Philia stored
    it, or given back on failure. The claim of a replica that died runs out, and another
    replica replays the episode. :meth:`refresh` reads what other replicas queued, so a
    replica that never failed still helps drain it. The depth, bytes and counts live in
    ``outbox_counters``, kept exact by every write (no count over the table per writeback).
    """

    shared = True

    def __init__(self, pool: Any, url: str, max_bytes: int, claim_s: float) -> None:
        if max_bytes < 1:
            raise ValueError("the outbox needs room for at least one byte")
        self._pool = pool
        self._url = url
        self._max = max_bytes
        self._claim_s = claim_s
        self._owner = f"replica-{uuid.uuid4().hex[:12]}"
        super().__init__()
        self._closed = False
        self._writes: set[asyncio.Task[int | None]] = set()

    @property
    def where(self) -> str:
        return f"table outbox at {redact_url(self._url)}"

    async def load(self) -> None:
        await self.refresh()

    async def refresh(self) -> None:
        async def work(conn: Any) -> _Counts:
            return await self._read_counts(conn)

        self._settle(await self._run(work))

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
        if self._closed:
            raise OutboxClosed("the outbox is closed")
        self._unsettled += 1
        task = asyncio.get_running_loop().create_task(
            self._put(
                text,
                node_type,
                scope_id,
                episode_id,
                occurred_us,
                unless_queued and bool(episode_id),
                principal_id,
            )
        )
        self._writes.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[int | None]) -> None:
        self._writes.discard(task)
        self._unsettled -= 1

    async def _put(
        self,
        text: str,
        node_type: str,
        scope_id: str,
        episode_id: str,
        occurred_us: int | None,
        unless_queued: bool,
        principal_id: str,
    ) -> int | None:
        size = entry_bytes(text, node_type, scope_id, episode_id)

        async def work(conn: Any) -> tuple[int | None, _Counts]:
            async with conn.transaction():
                total = int(await conn.fetchval(_PG_LOCK) or 0)
                seq = await conn.fetchval(
                    PG_PUT_UNLESS_QUEUED if unless_queued else PG_PUT,
                    text,
                    node_type,
                    scope_id,
                    _now_us(),
                    episode_id,
                    occurred_us,
                    size,
                    principal_id,
                )
                if seq is None:  # already queued: nothing changed
                    return None, await self._read_counts(conn)
                depth, freed, dropped = 1, size, 0
                excess = total + size - self._max
                if excess > 0:
                    gone = await conn.fetchrow(
                        "WITH doomed AS (SELECT seq FROM (SELECT seq, sum(bytes) OVER"
                        " (ORDER BY seq) - bytes AS before FROM outbox WHERE seq < $1) o"
                        " WHERE before < $2),"
                        " gone AS (DELETE FROM outbox WHERE seq IN (SELECT seq FROM doomed)"
                        " RETURNING bytes)"
                        " SELECT count(*), coalesce(sum(bytes), 0) FROM gone",
                        seq,
                        excess,
                    )
                    dropped = int(gone[0])
                    depth, freed = 1 - dropped, size - int(gone[1])
                await conn.execute(_PG_ADD, depth, freed, dropped, 0)
                return int(seq), await self._read_counts(conn)

        seq, counts = await self._run(work)
        self._settle(counts)
        return seq

    async def oldest(self, limit: int = 1) -> list[OutboxEntry]:
        """Claim up to ``limit`` of the oldest unclaimed episodes (or ones whose claim ran
        out), oldest first."""

        async def work(conn: Any) -> list[Any]:
            return list(
                await conn.fetch(
                    "UPDATE outbox SET claimed_by = $1,"
                    " claimed_until = now() + make_interval(secs => $2)"
                    " WHERE seq IN (SELECT seq FROM outbox"
                    "  WHERE claimed_until IS NULL OR claimed_until < now()"
                    "  ORDER BY seq FOR UPDATE SKIP LOCKED LIMIT $3)"
                    f" RETURNING {_ENTRY_COLUMNS}",
                    self._owner,
                    self._claim_s,
                    limit,
                )
            )

        rows = await self._run(work)
        if not rows:
            await self.refresh()
        return sorted((_entry(row) for row in rows), key=lambda entry: entry.seq)

    async def remove(self, *seqs: int) -> None:
        if not seqs:
            return

        async def work(conn: Any) -> _Counts:
            async with conn.transaction():
                await conn.fetchval(_PG_LOCK)
                gone = await conn.fetchrow(
                    "WITH gone AS (DELETE FROM outbox WHERE seq = ANY($1::bigint[])"
                    " RETURNING bytes) SELECT count(*), coalesce(sum(bytes), 0) FROM gone",
                    list(seqs),
                )
                await conn.execute(_PG_ADD, -int(gone[0]), -int(gone[1]), 0, 0)
                return await self._read_counts(conn)

        self._settle(await self._run(work))

    async def release(self, *seqs: int) -> None:
        if not seqs:
            return

        async def work(conn: Any) -> None:
            await conn.execute(
                "UPDATE outbox SET claimed_by = NULL, claimed_until = NULL"
                " WHERE seq = ANY($1::bigint[]) AND claimed_by = $2",
                list(seqs),
                self._owner,
            )

        await self._run(work)

    async def dead_letter(self, seq: int, reason: str) -> None:
        async def work(conn: Any) -> _Counts:
            async with conn.transaction():
                await conn.fetchval(_PG_LOCK)
                size = await conn.fetchval(
                    "WITH gone AS (DELETE FROM outbox WHERE seq = $1 RETURNING *),"
                    f" kept AS (INSERT INTO outbox_dead_letters ({_DEAD_COLUMNS}, dead_us, reason)"
                    f" SELECT {_DEAD_COLUMNS}, $2, $3 FROM gone RETURNING 1)"
                    " SELECT bytes FROM gone",
                    seq,
                    _now_us(),
                    reason,
                )
                if size is not None:
                    await conn.execute(_PG_ADD, -1, -int(size), 0, 1)
                    await conn.execute(_PG_PRUNE, DEAD_LETTERS_KEPT)
                return await self._read_counts(conn)

        self._settle(await self._run(work))

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
        if self._closed:
            raise OutboxClosed("the outbox is closed")

        async def work(conn: Any) -> _Counts:
            now = _now_us()
            async with conn.transaction():
                await conn.fetchval(_PG_LOCK)
                await conn.execute(
                    f"INSERT INTO outbox_dead_letters ({_DEAD_COLUMNS}, dead_us, reason)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $8, $5, $7)",
                    text,
                    node_type,
                    scope_id,
                    episode_id,
                    now,
                    occurred_us,
                    reason,
                    principal_id,
                )
                await conn.execute(_PG_ADD, 0, 0, 0, 1)
                await conn.execute(_PG_PRUNE, DEAD_LETTERS_KEPT)
                return await self._read_counts(conn)

        self._settle(await self._run(work))

    async def forget(self, whose: Whose) -> None:
        """Remove the queued episodes and dead letters of ``whose``; their rows are
        vacuumed away (PostgreSQL's own log is the database's: README, "What is kept")."""
        condition, args = whose.where(postgres_mark)

        async def work(conn: Any) -> _Counts:
            async with conn.transaction():
                await conn.fetchval(_PG_LOCK)
                gone = await conn.fetchrow(
                    f"WITH gone AS (DELETE FROM outbox WHERE {condition} RETURNING bytes)"
                    " SELECT count(*), coalesce(sum(bytes), 0) FROM gone",
                    *args,
                )
                await conn.execute(_PG_ADD, -int(gone[0]), -int(gone[1]), 0, 0)
                await conn.execute(f"DELETE FROM outbox_dead_letters WHERE {condition}", *args)
                counts = await self._read_counts(conn)
            await conn.execute("VACUUM outbox, outbox_dead_letters")
            return counts

        self._settle(await self._run(work))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=5.0)

        async def work(conn: Any) -> None:
            await conn.execute(
                "UPDATE outbox SET claimed_by = NULL, claimed_until = NULL WHERE claimed_by = $1",
                self._owner,
            )

        # Claims a stopped replay still holds (it may have been cancelled between claiming a
        # batch and giving it back) go back now: other replicas need not wait for them to run
        # out.
        try:
            await self._run(work)
        except Exception as exc:  # the database is away: the claims run out by themselves
            logger.debug("outbox claims not given back: %s", type(exc).__name__)

    @staticmethod
    async def _read_counts(conn: Any) -> _Counts:
        depth, size, dropped, dead = await conn.fetchrow(_PG_COUNTS)
        recent = _dead_letters(await conn.fetch(_PG_RECENT))
        return _Counts(int(depth), int(dropped), int(size), int(dead), recent)

    async def _run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        return await run_on(self._pool, self._url, work)


AnyOutbox = Outbox | PostgresOutbox


def open_outbox(settings: Settings, pool: Any | None) -> AnyOutbox:
    """The outbox of this deployment: the shared table with a pool, else ``outbox.db``."""
    if pool is not None:
        assert settings.database_url is not None
        return PostgresOutbox(
            pool,
            settings.database_url,
            settings.memory_outbox_max_bytes,
            settings.memory_outbox_claim_s,
        )
    return Outbox(settings.data_dir, settings.memory_outbox_max_bytes)
