"""The outbox as a PostgreSQL table every gRPC replica shares (``ARONA_DATABASE_URL``), replayed
together by claims that run out.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from arona_common.database import run_on
from arona_common.redact import redact_url
from arona_grpc.episodes import Whose, postgres_mark
from arona_grpc.outbox.model import (
    DEAD_COLUMNS,
    DEAD_LETTERS_KEPT,
    DEAD_LETTERS_SHOWN,
    ENTRY_COLUMNS,
    Counts,
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


class PostgresOutbox(Kept):
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
        async def work(conn: Any) -> Counts:
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

        async def work(conn: Any) -> tuple[int | None, Counts]:
            async with conn.transaction():
                total = int(await conn.fetchval(_PG_LOCK) or 0)
                seq = await conn.fetchval(
                    PG_PUT_UNLESS_QUEUED if unless_queued else PG_PUT,
                    text,
                    node_type,
                    scope_id,
                    now_us(),
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
                    f" RETURNING {ENTRY_COLUMNS}",
                    self._owner,
                    self._claim_s,
                    limit,
                )
            )

        rows = await self._run(work)
        if not rows:
            await self.refresh()
        return sorted((entry_of(row) for row in rows), key=lambda entry: entry.seq)

    async def remove(self, *seqs: int) -> None:
        if not seqs:
            return

        async def work(conn: Any) -> Counts:
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
        async def work(conn: Any) -> Counts:
            async with conn.transaction():
                await conn.fetchval(_PG_LOCK)
                size = await conn.fetchval(
                    "WITH gone AS (DELETE FROM outbox WHERE seq = $1 RETURNING *),"
                    f" kept AS (INSERT INTO outbox_dead_letters ({DEAD_COLUMNS}, dead_us, reason)"
                    f" SELECT {DEAD_COLUMNS}, $2, $3 FROM gone RETURNING 1)"
                    " SELECT bytes FROM gone",
                    seq,
                    now_us(),
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

        async def work(conn: Any) -> Counts:
            now = now_us()
            async with conn.transaction():
                await conn.fetchval(_PG_LOCK)
                await conn.execute(
                    f"INSERT INTO outbox_dead_letters ({DEAD_COLUMNS}, dead_us, reason)"
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
        vacuumed away (PostgreSQL's own log is the database's: docs/forgetting.md)."""
        condition, args = whose.where(postgres_mark)

        async def work(conn: Any) -> Counts:
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
    async def _read_counts(conn: Any) -> Counts:
        depth, size, dropped, dead = await conn.fetchrow(_PG_COUNTS)
        recent = dead_letters_of(await conn.fetch(_PG_RECENT))
        return Counts(int(depth), int(dropped), int(size), int(dead), recent)

    async def _run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        return await run_on(self._pool, self._url, work)
