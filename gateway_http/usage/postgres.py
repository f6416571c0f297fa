""":class:`~gateway_http.usage.store.UsageStore` in PostgreSQL, shared by every replica.

Its tables come with the other shared state's migrations
(:data:`arona_common.database.PG_MIGRATIONS`, number 5). A batch is one statement: the records
go in with ``ON CONFLICT (turn_id) DO NOTHING`` and only those that went in are added to their
months' spending, so a batch sent again after a lost commit counts each turn once. Two
replicas adding to the same principal's month wait on its row in turn; a deadlock between
their batches (rows taken in another order) is retried, which is safe for the same reason.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from arona_common.database import run_on
from gateway_http.usage.records import (
    Budget,
    Spent,
    UsageQuery,
    UsageRecord,
    UsageSummary,
    micros_now,
    summary_of,
    summary_sql,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DEADLOCK_RETRIES = 3

_ADD = """
WITH added AS (
    INSERT INTO usage_records (turn_id, at_us, day, principal, user_name, model, backend,
        surface, outcome, prompt_tokens, completion_tokens, memory_tokens, estimated,
        latency_ms, cost_micro)
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[],
        $6::text[], $7::text[], $8::text[], $9::text[], $10::bigint[], $11::bigint[],
        $12::bigint[], $13::boolean[], $14::float8[], $15::bigint[])
    ON CONFLICT (turn_id) DO NOTHING
    RETURNING principal, left(day, 7) AS month, prompt_tokens + completion_tokens AS tokens,
        coalesce(cost_micro, 0) AS cost_micro
), months AS (
    INSERT INTO usage_months (principal, month, tokens, cost_micro)
    SELECT principal, month, sum(tokens), sum(cost_micro) FROM added
    GROUP BY principal, month ORDER BY principal, month
    ON CONFLICT (principal, month) DO UPDATE
    SET tokens = usage_months.tokens + excluded.tokens,
        cost_micro = usage_months.cost_micro + excluded.cost_micro
)
SELECT count(*) FROM added
"""


class PostgresUsageStore:
    """Usage records and budgets in PostgreSQL; see the module docstring."""

    def __init__(self, pool: Any, url: str) -> None:
        self._pool = pool
        self._url = url

    async def add(self, records: Sequence[UsageRecord]) -> int:
        if not records:
            return 0
        columns = (
            [r.turn_id for r in records],
            [r.at_us for r in records],
            [r.day for r in records],
            [r.principal for r in records],
            [r.user for r in records],
            [r.model for r in records],
            [r.backend for r in records],
            [r.surface for r in records],
            [r.outcome for r in records],
            [r.prompt_tokens for r in records],
            [r.completion_tokens for r in records],
            [r.memory_tokens for r in records],
            [r.estimated for r in records],
            [r.latency_ms for r in records],
            [r.cost_micro for r in records],
        )

        async def work(conn: Any) -> int:
            import asyncpg

            for attempt in range(_DEADLOCK_RETRIES + 1):
                try:
                    added: int = await conn.fetchval(_ADD, *columns)
                    return added
                except asyncpg.DeadlockDetectedError:
                    if attempt == _DEADLOCK_RETRIES:
                        raise
                    logger.info("usage batch met another replica's batch (deadlock); again")
            raise AssertionError("unreachable")

        return await self._run(work)

    async def summary(self, query: UsageQuery) -> UsageSummary:
        sql, args = summary_sql(query, "$")

        async def work(conn: Any) -> UsageSummary:
            rows = await conn.fetch(sql, *args)
            return summary_of([tuple(row) for row in rows], len(query.group_by))

        return await self._run(work)

    async def spent(self, month: str, principals: Sequence[str] | None = None) -> dict[str, Spent]:
        if principals is not None and not principals:
            return {}

        async def work(conn: Any) -> dict[str, Spent]:
            if principals is None:
                rows = await conn.fetch(
                    "SELECT principal, tokens, cost_micro FROM usage_months WHERE month = $1",
                    month,
                )
            else:
                rows = await conn.fetch(
                    "SELECT principal, tokens, cost_micro FROM usage_months"
                    " WHERE month = $1 AND principal = ANY($2::text[])",
                    month,
                    list(principals),
                )
            return {row[0]: Spent(row[1], row[2]) for row in rows}

        return await self._run(work)

    async def budgets(self) -> dict[str, Budget]:
        async def work(conn: Any) -> dict[str, Budget]:
            rows = await conn.fetch("SELECT principal, tokens, cost_micro FROM usage_budgets")
            return {row[0]: Budget(row[1], row[2]) for row in rows}

        return await self._run(work)

    async def set_budget(self, principal: str, budget: Budget | None) -> None:
        async def work(conn: Any) -> None:
            if budget is None:
                await conn.execute("DELETE FROM usage_budgets WHERE principal = $1", principal)
                return
            await conn.execute(
                "INSERT INTO usage_budgets (principal, tokens, cost_micro, updated_us)"
                " VALUES ($1, $2, $3, $4) ON CONFLICT (principal) DO UPDATE SET"
                " tokens = excluded.tokens, cost_micro = excluded.cost_micro,"
                " updated_us = excluded.updated_us",
                principal,
                budget.tokens,
                budget.cost_micro,
                micros_now(),
            )

        await self._run(work)

    async def aclose(self) -> None:
        """The pool belongs to the process; nothing of its own to close."""

    async def _run(self, work: Callable[[Any], Awaitable[T]]) -> T:
        return await run_on(self._pool, self._url, work)
