"""The writeback outbox: episodes that could not be stored, kept in SQLite until replayed.

One SQLite file (``outbox.db`` under ``ARONA_DATA_DIR``) holds a FIFO of episodes, keyed
by an ever-growing sequence number so that replay order is queue order. It is bounded by
``ARONA_MEMORY_OUTBOX_MAX`` entries: when a new episode would overflow it, the **oldest**
entries are dropped (the newest turns are the ones a user is most likely to ask about
next) and counted; the count survives restarts and is reported by Status.

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
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from arona_grpc.config import Settings
from arona_grpc.database import SqliteStep, is_unavailable, sqlite_migrate, unavailable
from arona_grpc.failure_log import FailureLog
from arona_grpc.redact import redact_url

logger = logging.getLogger(__name__)

T = TypeVar("T")

OUTBOX_FILE = "outbox.db"


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


@dataclass(frozen=True)
class _Counts:
    depth: int
    dropped: int


# Whether an episode id is queued. The index on the ids holds only episodes that have one: a
# query must say so to use it (the planner cannot tell that a parameter is not ''), or every
# writeback during an outage reads the whole outbox.
SQLITE_HAS = "SELECT 1 FROM episodes WHERE episode_id = ? AND episode_id != '' LIMIT 1"
PG_PUT = (
    "INSERT INTO outbox (text, node_type, scope_id, queued_us, episode_id, occurred_us)"
    " VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq"
)
# No row (seq NULL) when the episode is already queued (the same lookup as SQLITE_HAS).
PG_PUT_UNLESS_QUEUED = (
    "INSERT INTO outbox (text, node_type, scope_id, queued_us, episode_id, occurred_us)"
    " SELECT $1, $2, $3, $4, $5::text, $6::bigint WHERE NOT EXISTS"
    " (SELECT 1 FROM outbox WHERE episode_id = $5::text AND episode_id <> '')"
    " RETURNING seq"
)


# The columns of an OutboxEntry, on both backends.
_ENTRY_COLUMNS = "seq, text, node_type, scope_id, episode_id, coalesce(occurred_us, queued_us)"


def _entry(row: Any) -> OutboxEntry:
    return OutboxEntry(int(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]), int(row[5]))


class _OutboxFile:
    """The SQLite side; every method runs on the worker thread."""

    def __init__(self, path: Path, max_entries: int) -> None:
        self._path = path
        self._max = max_entries
        self._db: sqlite3.Connection | None = None
        self._depth = 0
        self._dropped = 0

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
    ) -> tuple[int | None, _Counts]:
        if self._db is None:
            self._open()
        assert self._db is not None
        if unless_queued and episode_id and self.has(episode_id):
            return None, self._counts()
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO episodes"
                " (text, node_type, queued_us, scope_id, episode_id, occurred_us)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (text, node_type, int(time.time() * 1_000_000), scope_id, episode_id, occurred_us),
            )
            seq = int(cursor.lastrowid or 0)
            self._depth += 1
            overflow = self._depth - self._max
            if overflow > 0:
                self._db.execute(
                    "DELETE FROM episodes WHERE seq IN "
                    "(SELECT seq FROM episodes ORDER BY seq LIMIT ?)",
                    (overflow,),
                )
                self._depth -= overflow
                self._dropped += overflow
                self._db.execute(
                    "INSERT INTO counters (name, value) VALUES ('dropped', ?) "
                    "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                    (self._dropped,),
                )
        return seq, self._counts()

    def has(self, episode_id: str) -> bool:
        if self._db is None:
            return False
        row = self._db.execute(SQLITE_HAS, (episode_id,)).fetchone()
        return row is not None

    def oldest(self) -> OutboxEntry | None:
        if self._db is None:
            return None
        row = self._db.execute(
            f"SELECT {_ENTRY_COLUMNS} FROM episodes ORDER BY seq LIMIT 1"
        ).fetchone()
        return _entry(row) if row is not None else None

    def remove(self, seq: int) -> _Counts:
        if self._db is not None:
            with self._db:
                removed = self._db.execute("DELETE FROM episodes WHERE seq = ?", (seq,)).rowcount
            self._depth -= max(0, removed)
        return self._counts()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self._path, isolation_level=None)
        try:
            # WAL + NORMAL: a commit survives a crash of this process without an fsync each.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=2000")
            db.isolation_level = "DEFERRED"
            sqlite_migrate(db, _SQLITE_STEPS, f"the outbox {self._path}")
            self._depth = int(db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0])
            row = db.execute("SELECT value FROM counters WHERE name = 'dropped'").fetchone()
            self._dropped = int(row[0]) if row else 0
        except BaseException:
            db.close()
            raise
        self._db = db

    def _counts(self) -> _Counts:
        return _Counts(self._depth, self._dropped)


class _Kept:
    """What both outboxes keep in memory: the depth last seen, the drops, and the puts
    handed over but not yet committed (the queue is non-empty from the moment an episode is
    handed over, so later writebacks line up behind it at once)."""

    def __init__(self) -> None:
        self._depth = 0
        self._dropped = 0
        self._unsettled = 0

    @property
    def depth(self) -> int:
        """Episodes waiting (including ones handed over but not yet committed)."""
        return self._depth + self._unsettled

    @property
    def dropped(self) -> int:
        """Episodes dropped on overflow, over the outbox's whole life."""
        return self._dropped

    @property
    def pending(self) -> bool:
        # Asked on every writeback and every successful call: kept to two reads.
        return self._depth > 0 or self._unsettled > 0


class Outbox(_Kept):
    """Bounded FIFO of episodes in ``<data_dir>/outbox.db``; see the module docstring."""

    def __init__(self, data_dir: Path, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("the outbox needs room for at least one episode")
        self.path = data_dir / OUTBOX_FILE
        super().__init__()
        self._file = _OutboxFile(self.path, max_entries)
        self._worker: ThreadPoolExecutor | None = None
        self._closed = False
        self._drops = FailureLog(logger, "the outbox")

    # One process owns this file: nothing to look for beyond its own episodes.
    shared = False

    @property
    def where(self) -> str:
        return str(self.path)

    async def refresh(self) -> None:
        """Re-read what other processes queued (nothing: the file is this process's)."""

    async def release(self, seq: int) -> None:
        """Give an episode back after a failed store (nothing to do with one process)."""

    async def load(self) -> None:
        """Read the depth of an outbox left by an earlier run (creates no file)."""
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
    ) -> asyncio.Future[int | None]:
        """Queue one episode; a future of its sequence number.

        ``occurred_us``: when it happened (POSIX microseconds); None: when it is queued.

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
                logger.error("could not keep an episode in the outbox: %s", exc)
                done.set_exception(exc)
            else:
                before = self._dropped
                seq, counts = job.result()
                self._settle(counts)
                if self._dropped > before:
                    # Once full, every new episode drops one: a warning per period, not each.
                    self._drops.failed(
                        f"outbox full: dropped {self._dropped - before} oldest episode(s) "
                        f"({self._dropped} in all)"
                    )
                done.set_result(seq)

        self._submit(
            self._file.put, text, node_type, scope_id, episode_id, occurred_us, unless_queued
        ).add_done_callback(committed)
        return done

    async def oldest(self) -> OutboxEntry | None:
        """The oldest episode, to replay next."""
        return await self._run(self._file.oldest)

    async def remove(self, seq: int) -> None:
        self._settle(await self._run(self._file.remove, seq))

    async def aclose(self) -> None:
        """Finish every submitted write, then close the file."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            # FIFO worker: once close ran, every earlier write has committed.
            await asyncio.shield(self._submit(self._file.close))
            self._worker.shutdown(wait=False)

    def _settle(self, counts: _Counts) -> None:
        self._depth, self._dropped = counts.depth, counts.dropped

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        # Shielded: an abandoned caller must not leave the worker half-way through.
        return await asyncio.shield(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arona-outbox")
        return asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)


class PostgresOutbox(_Kept):
    """The outbox as a table shared by every gRPC replica (``ARONA_DATABASE_URL``).

    Replicas replay it together, oldest first, without storing an episode twice in normal
    recovery: :meth:`oldest` claims a row (``FOR UPDATE SKIP LOCKED``) for
    ``ARONA_MEMORY_OUTBOX_CLAIM_S``; the claim is dropped with the row once Philia stored
    it, or given back on failure. The claim of a replica that died runs out, and another
    replica replays the episode. :meth:`refresh` reads what other replicas queued, so a
    replica that never failed still helps drain it.
    """

    shared = True

    def __init__(self, pool: Any, url: str, max_entries: int, claim_s: float) -> None:
        if max_entries < 1:
            raise ValueError("the outbox needs room for at least one episode")
        self._pool = pool
        self._url = url
        self._max = max_entries
        self._claim_s = claim_s
        self._owner = f"replica-{uuid.uuid4().hex[:12]}"
        super().__init__()
        self._closed = False
        self._writes: set[asyncio.Task[int | None]] = set()
        self._drops = FailureLog(logger, "the outbox")

    @property
    def where(self) -> str:
        return f"table outbox at {redact_url(self._url)}"

    async def load(self) -> None:
        await self.refresh()

    async def refresh(self) -> None:
        row = await self._fetchrow(
            "SELECT (SELECT count(*) FROM outbox),"
            " coalesce((SELECT value FROM outbox_counters WHERE name = 'dropped'), 0)"
        )
        self._depth, self._dropped = int(row[0]), int(row[1])

    def put(
        self,
        text: str,
        node_type: str,
        scope_id: str = "",
        episode_id: str = "",
        *,
        occurred_us: int | None = None,
        unless_queued: bool = False,
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
    ) -> int | None:
        async def work(conn: Any) -> tuple[int | None, int, int]:
            async with conn.transaction():
                seq = await conn.fetchval(
                    PG_PUT_UNLESS_QUEUED if unless_queued else PG_PUT,
                    text,
                    node_type,
                    scope_id,
                    int(time.time() * 1_000_000),
                    episode_id,
                    occurred_us,
                )
                if seq is None:  # already queued: nothing changed
                    return None, self._depth, self._dropped
                depth = await conn.fetchval("SELECT count(*) FROM outbox")
                overflow = depth - self._max
                if overflow > 0:
                    await conn.execute(
                        "DELETE FROM outbox WHERE seq IN"
                        " (SELECT seq FROM outbox ORDER BY seq LIMIT $1)",
                        overflow,
                    )
                    await conn.execute(
                        "INSERT INTO outbox_counters (name, value) VALUES ('dropped', $1)"
                        " ON CONFLICT (name) DO UPDATE"
                        " SET value = outbox_counters.value + excluded.value",
                        overflow,
                    )
                dropped = await conn.fetchval(
                    "SELECT coalesce((SELECT value FROM outbox_counters WHERE name = 'dropped'), 0)"
                )
                return int(seq), int(depth) - max(0, overflow), int(dropped)

        seq, depth, dropped = await self._run(work)
        before = self._dropped
        self._depth, self._dropped = depth, dropped
        if dropped > before:
            self._drops.failed(
                f"outbox full: dropped {dropped - before} oldest episode(s) ({dropped} in all)"
            )
        return seq

    async def oldest(self) -> OutboxEntry | None:
        """Claim the oldest unclaimed episode (or one whose claim ran out)."""
        row = await self._fetchrow(
            "UPDATE outbox SET claimed_by = $1,"
            " claimed_until = now() + make_interval(secs => $2)"
            " WHERE seq = (SELECT seq FROM outbox"
            "  WHERE claimed_until IS NULL OR claimed_until < now()"
            "  ORDER BY seq FOR UPDATE SKIP LOCKED LIMIT 1)"
            f" RETURNING {_ENTRY_COLUMNS}",
            self._owner,
            self._claim_s,
        )
        if row is None:
            await self.refresh()
            return None
        return _entry(row)

    async def remove(self, seq: int) -> None:
        row = await self._fetchrow(
            "WITH gone AS (DELETE FROM outbox WHERE seq = $1 RETURNING 1)"
            " SELECT (SELECT count(*) FROM outbox) - (SELECT count(*) FROM gone)",
            seq,
        )
        self._depth = int(row[0])

    async def release(self, seq: int) -> None:
        await self._fetchrow(
            "UPDATE outbox SET claimed_by = NULL, claimed_until = NULL"
            " WHERE seq = $1 AND claimed_by = $2 RETURNING seq",
            seq,
            self._owner,
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=5.0)

    async def _fetchrow(self, sql: str, *args: Any) -> Any:
        async def work(conn: Any) -> Any:
            return await conn.fetchrow(sql, *args)

        return await self._run(work)

    async def _run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        try:
            async with self._pool.acquire() as conn:
                return await work(conn)
        except Exception as exc:
            if is_unavailable(exc):
                raise unavailable(self._url, exc) from None
            raise


AnyOutbox = Outbox | PostgresOutbox


def open_outbox(settings: Settings, pool: Any | None) -> AnyOutbox:
    """The outbox of this deployment: the shared table with a pool, else ``outbox.db``."""
    if pool is not None:
        assert settings.database_url is not None
        return PostgresOutbox(
            pool, settings.database_url, settings.memory_outbox_max, settings.memory_outbox_claim_s
        )
    return Outbox(settings.data_dir, settings.memory_outbox_max)
