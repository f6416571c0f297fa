"""The index of the episodes this service stored: node id, scope id, time and a preview.

Philia's query results carry no node ids and Philia has no "list my nodes", so the
MemoryService keeps its own record of each episode it stored, by scope. That is what
``List`` pages through, what ``Forget`` deletes, and what ``Delete`` checks ownership
against in ``user`` mode.

:class:`EpisodeIndex` is the interface the domain uses; :class:`SqliteEpisodeIndex` keeps
it in ``episodes.db`` under ``ARONA_DATA_DIR``. Writes are off the chat path twice over:
:meth:`EpisodeIndex.record` only queues the entry, and one worker thread commits what
has queued in one transaction. Reads run on the same thread after the writes queued before
them, so a ``List`` right after a ``Writeback`` sees its episode.
:class:`PostgresEpisodeIndex` is shared by several replicas, where a ``List`` may reach
another replica than the ``Writeback`` did: :meth:`EpisodeIndex.written` lets the writeback
answer only once its entry is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from arona_common.database import (
    database_answered,
    is_unavailable,
    sqlite_erase,
    sqlite_migrate,
    unavailable,
)
from arona_common.storage import StorageFaults

logger = logging.getLogger(__name__)

T = TypeVar("T")

INDEX_FILE = "episodes.db"
INDEX_PART = "episode index"
# What an entry the index cannot take costs.
INDEX_COST = "stored episodes are missing from memory.list and memory.forget"
PREVIEW_CHARS = 120
_SQLITE_STEPS = (
    """
    CREATE TABLE IF NOT EXISTS episodes (
        seq       INTEGER PRIMARY KEY AUTOINCREMENT,
        node_id   TEXT NOT NULL UNIQUE,
        scope_id  TEXT NOT NULL,
        at_us     INTEGER NOT NULL,
        preview   TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS episodes_by_scope ON episodes (scope_id, seq);
    """,
    # Whether an episode was stored for one user alone (ARONA_MEMORY_SCOPE=user): such an
    # index must not serve shared memory. NULL for entries older than the column (unknown).
    """
    ALTER TABLE episodes ADD COLUMN scoped INTEGER;
    CREATE INDEX episodes_scoped ON episodes (seq) WHERE scoped = 1;
    """,
    # Whose principal an episode is (the scope id of the principal itself), so that a forget
    # of a principal finds the scopes it narrowed to. NULL for older entries.
    """
    ALTER TABLE episodes ADD COLUMN principal_id TEXT;
    CREATE INDEX episodes_by_principal ON episodes (principal_id, seq);
    """,
)
_NEWEST = 2**63 - 1
# One queued entry: node id, scope id, time (microseconds), preview, stored for one user,
# principal id.
_Entry = tuple[str, str, int, str, bool, str]


@dataclass(frozen=True)
class Whose:
    """Which indexed episodes: one scope's (``scope_id``; "" for the episodes of no scope),
    every scope of one principal (``principal_id``, the scope id of the principal itself:
    its own scope and those it narrowed to), or, with neither, every episode."""

    scope_id: str | None = None
    principal_id: str | None = None

    def where(self, mark: Callable[[int], str]) -> tuple[str, list[str]]:
        """The SQL condition and its arguments; ``mark(i)`` is the placeholder of the i-th
        argument (from 0)."""
        if self.scope_id is not None:
            return f"scope_id = {mark(0)}", [self.scope_id]
        if self.principal_id is not None:
            # Entries older than the principal column: a principal's own scope has its id.
            pid = self.principal_id
            return f"(principal_id = {mark(0)} OR scope_id = {mark(1)})", [pid, pid]
        return "TRUE", []

    def holds(self, scope_id: str, principal_id: str) -> bool:
        """Whether an episode of that scope and principal is one of these."""
        if self.scope_id is not None:
            return scope_id == self.scope_id
        if self.principal_id is not None:
            return self.principal_id in (principal_id, scope_id)
        return True


EVERYONE = Whose()


class IndexUnavailable(RuntimeError):
    """The index could not be read (its file is unreadable, the disk failed)."""


@dataclass(frozen=True)
class IndexedEpisode:
    node_id: str
    preview: str
    # Wall-clock seconds since the epoch.
    at: float


@dataclass(frozen=True)
class IndexPage:
    episodes: tuple[IndexedEpisode, ...]
    # The cursor of the next (older) page; None at the end.
    next: int | None


def _entry(node_id: str, scope_id: str, text: str, scoped: bool, principal_id: str) -> _Entry:
    return (node_id, scope_id, int(time.time() * 1_000_000), preview_of(text), scoped, principal_id)


def sqlite_mark(_: int) -> str:
    """The placeholder of a SQLite statement's argument (:meth:`Whose.where`)."""
    return "?"


def postgres_mark(i: int) -> str:
    """The placeholder of a PostgreSQL statement's ``i``-th argument, from 0."""
    return f"${i + 1}"


def _contains(text: str) -> str:
    """A LIKE pattern matching ``text`` anywhere (``\\`` escapes)."""
    escaped = text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _latest(entries: list[_Entry]) -> list[_Entry]:
    """The entries with each node id once: the same node twice in one batch, the later stands."""
    latest: dict[str, _Entry] = {}
    for entry in entries:
        latest.pop(entry[0], None)
        latest[entry[0]] = entry
    return list(latest.values())


def _page(rows: list[Any], limit: int) -> IndexPage:
    """An :class:`IndexPage` of rows (seq, node_id, preview, at_us), up to ``limit + 1``."""
    more = len(rows) > limit
    rows = rows[:limit]
    return IndexPage(
        tuple(IndexedEpisode(str(r[1]), str(r[2]), r[3] / 1_000_000) for r in rows),
        int(rows[-1][0]) if more and rows else None,
    )


def preview_of(text: str, limit: int = PREVIEW_CHARS) -> str:
    """The start of ``text`` on one line, cut with ``…`` beyond ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "\u2026"


class EpisodeIndex(Protocol):
    """What the domain needs from an episode index (one implementation per backend)."""

    def record(
        self, node_id: str, scope_id: str, text: str, scoped: bool = False, principal_id: str = ""
    ) -> None:
        """Note an episode just stored (a re-stored node id becomes the newest); ``scoped``:
        stored for its scope alone (``user`` mode); ``principal_id``: the scope id of its
        scope's principal ("" for no scope)."""

    async def holds_scoped(self) -> bool:
        """Whether any indexed episode was stored for one user alone (``user`` mode)."""

    async def written(self) -> None:
        """Return once every entry recorded so far can be read by any reader of the index
        (committed, or given up on and logged)."""

    async def owner(self, node_id: str) -> str | None:
        """The scope id an episode was stored for; None if it is not indexed."""

    async def page(
        self, scope_id: str, limit: int, before: int | None, contains: str = ""
    ) -> IndexPage:
        """A scope's episodes older than ``before`` (all when None), newest first; with
        ``contains``, only those whose preview holds it (any case)."""

    async def node_ids(self, whose: Whose) -> list[str]:
        """Every indexed episode of ``whose``, newest first."""

    async def remove(self, node_ids: Sequence[str]) -> None:
        """Forget these episodes (unknown ids are ignored), leaving no trace of their
        previews in the index's files once the next :meth:`erase` returns."""

    async def erase(self) -> None:
        """Leave nothing removed so far in the index's files (its write-ahead log);
        :class:`IndexUnavailable` if that cannot be done now."""

    async def note_erasure(self, whose: Whose | None, node_ids: Sequence[str]) -> None:
        """Tell the other replicas sharing this index that ``whose`` (or these nodes) were
        forgotten (their recent events go too); nothing when no other replica shares it."""

    async def erasures_since(self, at_us: int) -> list[tuple[Whose | None, list[str]]]:
        """The erasures other replicas noted since ``at_us`` (none for an unshared index)."""

    async def aclose(self) -> None:
        """Commit what is queued and close."""


class SqliteEpisodeIndex:
    """:class:`EpisodeIndex` in one SQLite file, written by one worker thread; a write that
    fails is reported to ``storage`` (said once per fault), or logged without one."""

    def __init__(self, data_dir: Path, storage: StorageFaults | None = None) -> None:
        self.path = data_dir / INDEX_FILE
        self._storage = storage
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="episode-index")
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._queued: list[_Entry] = []
        self._flush_submitted = False
        self._closed = False

    def record(
        self, node_id: str, scope_id: str, text: str, scoped: bool = False, principal_id: str = ""
    ) -> None:
        if self._closed:
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        entry = _entry(node_id, scope_id, text, scoped, principal_id)
        with self._lock:
            self._queued.append(entry)
            if self._flush_submitted:
                return
            self._flush_submitted = True
        self._executor.submit(self._flush)

    async def written(self) -> None:
        # The file is this process's own, and every read runs on the worker thread after the
        # writes queued before it: an entry is readable as soon as it is recorded.
        return None

    async def holds_scoped(self) -> bool:
        if self._db is None and not self.path.exists():
            return False  # checked at start: no file is made for it
        row = await self._read(
            lambda db: db.execute("SELECT 1 FROM episodes WHERE scoped = 1 LIMIT 1").fetchone()
        )
        return row is not None

    async def owner(self, node_id: str) -> str | None:
        row = await self._read(
            lambda db: db.execute(
                "SELECT scope_id FROM episodes WHERE node_id = ?", (node_id,)
            ).fetchone()
        )
        return None if row is None else str(row[0])

    async def page(
        self, scope_id: str, limit: int, before: int | None, contains: str = ""
    ) -> IndexPage:
        def read(db: sqlite3.Connection) -> list[tuple[int, str, str, int]]:
            return db.execute(
                "SELECT seq, node_id, preview, at_us FROM episodes"
                " WHERE scope_id = ? AND seq < ? AND lower(preview) LIKE ? ESCAPE '\\'"
                " ORDER BY seq DESC LIMIT ?",
                (
                    scope_id,
                    before if before is not None else _NEWEST,
                    _contains(contains),
                    limit + 1,
                ),
            ).fetchall()

        return _page(await self._read(read), limit)

    async def node_ids(self, whose: Whose) -> list[str]:
        condition, args = whose.where(sqlite_mark)
        rows = await self._read(
            lambda db: db.execute(
                f"SELECT node_id FROM episodes WHERE {condition} ORDER BY seq DESC", args
            ).fetchall()
        )
        return [str(r[0]) for r in rows]

    async def remove(self, node_ids: Sequence[str]) -> None:
        ids = [(node_id,) for node_id in node_ids]

        def write(db: sqlite3.Connection) -> None:
            with db:
                db.executemany("DELETE FROM episodes WHERE node_id = ?", ids)

        if ids:
            await self._read(write)

    async def erase(self) -> None:
        if self._db is None and not self.path.exists():
            return  # never written: nothing to erase
        await self._read(sqlite_erase)

    async def note_erasure(self, whose: Whose | None, node_ids: Sequence[str]) -> None:
        return None  # the file is this process's own: no other replica reads it

    async def erasures_since(self, at_us: int) -> list[tuple[Whose | None, list[str]]]:
        return []

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close)
        self._executor.shutdown(wait=True)

    # --- the worker thread -------------------------------------------------------------

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise IndexUnavailable("the episode index is closed")

        def run() -> T:
            try:
                return fn(self._open())
            except sqlite3.Error as exc:
                logger.error("episode index %s failed: %s", self.path, exc)
                raise IndexUnavailable("the episode index could not be read") from None

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            # A removed entry's preview is zeroed in the file, not left in a freed page.
            db.execute("PRAGMA secure_delete=ON")
            sqlite_migrate(db, _SQLITE_STEPS, f"the episode index {self.path}")
            self._db = db
        return self._db

    def _flush(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, []
            self._flush_submitted = False
        if not queued:
            return
        queued = _latest(queued)
        try:
            db = self._open()
            with db:
                # A node stored again (the same episode, deduplicated by Philia) becomes the
                # newest entry: delete and insert rather than update in place.
                db.executemany("DELETE FROM episodes WHERE node_id = ?", [(e[0],) for e in queued])
                db.executemany(
                    "INSERT INTO episodes (node_id, scope_id, at_us, preview, scoped, principal_id)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    queued,
                )
        except (sqlite3.Error, OSError) as exc:
            self._said(exc)
            return
        self._said(None)

    def _said(self, exc: BaseException | None) -> None:
        """A flush's outcome, to the storage faults on the event loop (or to the log)."""
        storage, loop = self._storage, self._loop
        if storage is None or loop is None or loop.is_closed():
            if exc is not None:
                logger.error("episode index %s: entries not recorded: %s", self.path, exc)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody to tell
            if exc is None:
                if storage.failing(INDEX_PART):
                    loop.call_soon_threadsafe(storage.succeeded, INDEX_PART)
                return
            loop.call_soon_threadsafe(storage.failed, INDEX_PART, str(self.path), exc, INDEX_COST)

    def _close(self) -> None:
        self._flush()
        if self._db is not None:
            self._db.close()
            self._db = None


class PostgresEpisodeIndex:
    """:class:`EpisodeIndex` in PostgreSQL, shared by every gRPC replica.

    Entries queue in memory and one task writes what has queued in one transaction; reads
    first wait for what was queued before them.
    """

    def __init__(self, pool: Any, url: str) -> None:
        self._pool = pool
        self._url = url
        self._queued: list[_Entry] = []
        self._flushing: asyncio.Task[None] | None = None
        self._closed = False
        # Entries recorded so far, and how many of them the flushes are done with.
        self._recorded = 0
        self._done = 0
        # (entries that must be done, its waiter), oldest first.
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def record(
        self, node_id: str, scope_id: str, text: str, scoped: bool = False, principal_id: str = ""
    ) -> None:
        if self._closed:
            return
        self._queued.append(_entry(node_id, scope_id, text, scoped, principal_id))
        self._recorded += 1
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush_all())

    async def written(self) -> None:
        target = self._recorded
        if self._done >= target or self._flushing is None or self._flushing.done():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((target, waiter))
        # Shielded: a caller that gives up does not stop the others' wait.
        await asyncio.shield(waiter)

    async def holds_scoped(self) -> bool:
        return bool(await self._read("SELECT 1 FROM episodes WHERE scoped LIMIT 1"))

    async def owner(self, node_id: str) -> str | None:
        row = await self._read("SELECT scope_id FROM episodes WHERE node_id = $1", node_id)
        return None if not row else str(row[0][0])

    async def page(
        self, scope_id: str, limit: int, before: int | None, contains: str = ""
    ) -> IndexPage:
        rows = await self._read(
            "SELECT seq, node_id, preview, at_us FROM episodes"
            " WHERE scope_id = $1 AND seq < $2 AND lower(preview) LIKE $4 ESCAPE '\\'"
            " ORDER BY seq DESC LIMIT $3",
            scope_id,
            before if before is not None else _NEWEST,
            limit + 1,
            _contains(contains),
        )
        return _page(rows, limit)

    async def node_ids(self, whose: Whose) -> list[str]:
        condition, args = whose.where(postgres_mark)
        rows = await self._read(
            f"SELECT node_id FROM episodes WHERE {condition} ORDER BY seq DESC", *args
        )
        return [str(r[0]) for r in rows]

    async def remove(self, node_ids: Sequence[str]) -> None:
        if node_ids:
            await self._read("DELETE FROM episodes WHERE node_id = ANY($1::text[])", list(node_ids))

    async def erase(self) -> None:
        # The rows are deleted; PostgreSQL's own files (dead tuples until vacuumed, its
        # write-ahead log) are the database's to clean (see docs/forgetting.md).
        await self._read("VACUUM episodes")

    async def note_erasure(self, whose: Whose | None, node_ids: Sequence[str]) -> None:
        kind, key = _erasure_key(whose)
        await self._read(
            "INSERT INTO erasures (at_us, scope_id, principal_id, node_ids)"
            " VALUES ($1, $2, $3, $4::text[])",
            int(time.time() * 1_000_000),
            key if kind == "scope" else None,
            key if kind == "principal" else None,
            list(node_ids) if whose is None else [],
        )
        # Kept a day: each replica clears its events of what was forgotten since its oldest
        # event whenever it is asked for its status (MemoryDomain.clear_erased_events).
        await self._read(
            "DELETE FROM erasures WHERE at_us < $1", int((time.time() - 86400) * 1_000_000)
        )

    async def erasures_since(self, at_us: int) -> list[tuple[Whose | None, list[str]]]:
        rows = await self._read(
            "SELECT scope_id, principal_id, node_ids FROM erasures WHERE at_us >= $1", at_us
        )
        found: list[tuple[Whose | None, list[str]]] = []
        for scope, principal, node_ids in rows:
            if node_ids:
                found.append((None, [str(n) for n in node_ids]))
            else:
                found.append((Whose(scope, principal), []))
        return found

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._flushing is not None:
            await asyncio.wait({self._flushing}, timeout=5.0)

    async def _flush_all(self) -> None:
        try:
            while self._queued:
                upto = self._recorded
                queued, self._queued = _latest(self._queued), []
                try:
                    async with self._pool.acquire() as conn, conn.transaction():
                        await conn.execute(
                            "DELETE FROM episodes WHERE node_id = ANY($1::text[])",
                            [e[0] for e in queued],
                        )
                        await conn.executemany(
                            "INSERT INTO episodes"
                            " (node_id, scope_id, at_us, preview, scoped, principal_id)"
                            " VALUES ($1, $2, $3, $4, $5, $6)",
                            queued,
                        )
                except Exception as exc:
                    if is_unavailable(exc):
                        unavailable(self._url, exc)  # the outage, said once
                        logger.debug("episode index: %d entr(ies) not recorded", len(queued))
                    else:
                        logger.error(
                            "episode index: %d entr(ies) not recorded: %s",
                            len(queued),
                            type(exc).__name__,
                        )
                    return
                database_answered(self._url)
                self._written(upto)
        finally:
            # Given up (an error, shutdown) or all done: nobody waits any longer.
            self._written(self._recorded)

    def _written(self, upto: int) -> None:
        self._done = max(self._done, upto)
        while self._waiters and self._waiters[0][0] <= self._done:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def _read(self, sql: str, *args: Any) -> list[Any]:
        if self._closed:
            raise IndexUnavailable("the episode index is closed")
        if self._flushing is not None and not self._flushing.done():
            await asyncio.shield(self._flushing)
        try:
            async with self._pool.acquire() as conn:
                rows: list[Any] = await conn.fetch(sql, *args)
        except Exception as exc:
            if is_unavailable(exc):
                unavailable(self._url, exc)  # the outage, said once
                raise IndexUnavailable("the episode index's database is unavailable") from None
            raise
        database_answered(self._url)
        return rows


def _erasure_key(whose: Whose | None) -> tuple[str, str]:
    """How an erasure is noted: ``("scope", id)``, ``("principal", id)``, ``("all", "")``, or
    ``("nodes", "")`` for some nodes."""
    if whose is None:
        return "nodes", ""
    if whose.scope_id is not None:
        return "scope", whose.scope_id
    if whose.principal_id is not None:
        return "principal", whose.principal_id
    return "all", ""


def open_index(
    data_dir: Path, pool: Any | None, url: str | None, *, storage: StorageFaults | None = None
) -> EpisodeIndex:
    """PostgreSQL when a pool is given, else ``episodes.db`` under ``data_dir`` (whose write
    faults go to ``storage``)."""
    if pool is not None:
        assert url is not None
        return PostgresEpisodeIndex(pool, url)
    return SqliteEpisodeIndex(data_dir, storage)
