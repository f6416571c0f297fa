""":class:`~gateway_http.usage.store.UsageStore` in one SQLite file (``usage.db``).

One worker thread owns the connection: a commit may wait on the disk and must never stall the
event loop. The HTTP workers of ``serve --workers`` share the file (WAL, a busy timeout), each
batch in one write transaction. The schema's steps are numbered below, applied in order from
the file's ``user_version``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from arona_common.database import SqliteThread, sqlite_open
from gateway_http.usage.records import (
    Budget,
    Spent,
    UsageQuery,
    UsageRecord,
    UsageSummary,
    micros_now,
    spent_of,
    summary_of,
    summary_sql,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SQLITE_STEPS = (
    # 1: records, each month's spending per principal, budgets.
    """
    CREATE TABLE IF NOT EXISTS usage_records (
        turn_id            TEXT PRIMARY KEY,
        at_us              INTEGER NOT NULL,  -- microseconds since the epoch, UTC
        day                TEXT NOT NULL,     -- YYYY-MM-DD, UTC
        principal          TEXT NOT NULL,
        user_name          TEXT NOT NULL,
        model              TEXT NOT NULL,
        backend            TEXT NOT NULL,
        surface            TEXT NOT NULL,
        outcome            TEXT NOT NULL,
        prompt_tokens      INTEGER NOT NULL,
        completion_tokens  INTEGER NOT NULL,
        memory_tokens      INTEGER NOT NULL,
        estimated          INTEGER NOT NULL,
        latency_ms         REAL NOT NULL,
        cost_micro         INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS usage_by_time ON usage_records (at_us);
    CREATE INDEX IF NOT EXISTS usage_by_principal ON usage_records (principal, at_us);
    CREATE TABLE IF NOT EXISTS usage_months (
        principal   TEXT NOT NULL,
        month       TEXT NOT NULL,  -- YYYY-MM, UTC
        tokens      INTEGER NOT NULL,
        cost_micro  INTEGER NOT NULL,
        PRIMARY KEY (principal, month)
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS usage_budgets (
        principal   TEXT PRIMARY KEY,
        tokens      INTEGER,
        cost_micro  INTEGER,
        updated_us  INTEGER NOT NULL
    );
    """,
)

_INSERT_HEAD = (
    "INSERT OR IGNORE INTO usage_records (turn_id, at_us, day, principal, user_name, model,"
    " backend, surface, outcome, prompt_tokens, completion_tokens, memory_tokens, estimated,"
    " latency_ms, cost_micro) VALUES "
)
_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_INSERT = _INSERT_HEAD + _ROW
# What the rows a statement inserted spent (RETURNING reports only rows inserted: SQLite 3.35).
_RETURNED = " RETURNING principal, day, prompt_tokens + completion_tokens, coalesce(cost_micro, 0)"
_RETURNING = sqlite3.sqlite_version_info >= (3, 35, 0)
# Rows one statement inserts (15 values each, well within SQLite's 32,766 variables).
_ROWS_PER_INSERT = 256
_ADD_MONTH = (
    "INSERT INTO usage_months (principal, month, tokens, cost_micro) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (principal, month) DO UPDATE"
    " SET tokens = tokens + excluded.tokens, cost_micro = cost_micro + excluded.cost_micro"
)


class SqliteUsageStore:
    """Usage records and budgets in one SQLite file; see the module docstring."""

    def __init__(self, path: Path) -> None:
        """Open (creating if needed) the database at ``path`` and bring its schema up to date."""
        self._thread = SqliteThread(path, _connect, "arona-usage", "the usage store")

    @classmethod
    def open(cls, path: Path) -> SqliteUsageStore:
        return cls(path)

    async def add(self, records: Sequence[UsageRecord]) -> int:
        rows = [
            (
                r.turn_id,
                r.at_us,
                r.day,
                r.principal,
                r.user,
                r.model,
                r.backend,
                r.surface,
                r.outcome,
                r.prompt_tokens,
                r.completion_tokens,
                r.memory_tokens,
                int(r.estimated),
                r.latency_ms,
                r.cost_micro,
            )
            for r in records
        ]

        def work(db: sqlite3.Connection) -> int:
            months: dict[tuple[str, str], Spent] = defaultdict(Spent)
            added = 0
            with db:
                if _RETURNING:
                    # A statement per 256 records, the new ones reported back: the records'
                    # own B-tree work is all that is left per record.
                    for start in range(0, len(rows), _ROWS_PER_INSERT):
                        chunk = rows[start : start + _ROWS_PER_INSERT]
                        sql = _INSERT_HEAD + ", ".join([_ROW] * len(chunk)) + _RETURNED
                        values = [value for row in chunk for value in row]
                        for principal, day, tokens, cost in db.execute(sql, values):
                            added += 1
                            months[principal, day[:7]] += Spent(tokens, cost)
                else:
                    for record, row in zip(records, rows, strict=True):
                        if db.execute(_INSERT, row).rowcount:
                            added += 1
                            months[record.principal, record.month] += spent_of(record)
                db.executemany(
                    _ADD_MONTH,
                    [(p, m, s.tokens, s.cost_micro) for (p, m), s in sorted(months.items())],
                )
            return added

        return await self._run(work)

    async def summary(self, query: UsageQuery) -> UsageSummary:
        sql, args = summary_sql(query, "?")
        return await self._run(
            lambda db: summary_of(db.execute(sql, args).fetchall(), len(query.group_by))
        )

    async def spent(self, month: str, principals: Sequence[str] | None = None) -> dict[str, Spent]:
        def work(db: sqlite3.Connection) -> dict[str, Spent]:
            sql = "SELECT principal, tokens, cost_micro FROM usage_months WHERE month = ?"
            args: list[str] = [month]
            if principals is not None:
                if not principals:
                    return {}
                sql += f" AND principal IN ({', '.join('?' for _ in principals)})"
                args.extend(principals)
            return {p: Spent(t, c) for p, t, c in db.execute(sql, args)}

        return await self._run(work)

    async def budgets(self) -> dict[str, Budget]:
        def work(db: sqlite3.Connection) -> dict[str, Budget]:
            rows = db.execute("SELECT principal, tokens, cost_micro FROM usage_budgets")
            return {p: Budget(t, c) for p, t, c in rows}

        return await self._run(work)

    async def set_budget(self, principal: str, budget: Budget | None) -> None:
        def work(db: sqlite3.Connection) -> None:
            with db:
                if budget is None:
                    db.execute("DELETE FROM usage_budgets WHERE principal = ?", (principal,))
                    return
                db.execute(
                    "INSERT INTO usage_budgets (principal, tokens, cost_micro, updated_us)"
                    " VALUES (?, ?, ?, ?) ON CONFLICT (principal) DO UPDATE SET"
                    " tokens = excluded.tokens, cost_micro = excluded.cost_micro,"
                    " updated_us = excluded.updated_us",
                    (principal, budget.tokens, budget.cost_micro, micros_now()),
                )

        await self._run(work)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the database; idempotent. Work already submitted finishes first."""
        self._thread.close()

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await self._thread.run(work)


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite_open(path, _SQLITE_STEPS, f"the usage database {path}")
