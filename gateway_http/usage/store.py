"""Where usage records and budgets are kept: :class:`UsageStore`, one per backend.

:func:`open_usage_store` picks PostgreSQL (shared by every replica) when the process has a
pool on ``ARONA_DATABASE_URL``, else the SQLite file ``usage.db`` under ``ARONA_DATA_DIR``
(shared by the HTTP workers of one machine). Either way a record is stored once per
``turn_id`` however often its batch is sent, and each month's spending per principal is kept
beside the records, added in the same transaction as the records that make it, so a budget
check reads one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from gateway_http.usage.records import Budget, Spent, UsageQuery, UsageRecord, UsageSummary

USAGE_FILE = "usage.db"


class UsageStore(Protocol):
    """What the meter, the budgets, usage.summary and the command line need."""

    async def add(self, records: Sequence[UsageRecord]) -> int:
        """Store the records not stored yet (by ``turn_id``) and add them to their months'
        spending, in one transaction; how many were new."""
        ...

    async def summary(self, query: UsageQuery) -> UsageSummary: ...

    async def spent(self, month: str, principals: Sequence[str] | None = None) -> dict[str, Spent]:
        """What each principal (of ``principals``, or every one) spent in ``month``
        (``YYYY-MM``, UTC); a principal that spent nothing is absent."""
        ...

    async def budgets(self) -> dict[str, Budget]:
        """Every budget set, by principal (:data:`~gateway_http.usage.records.DEFAULT_BUDGET`
        for the default)."""
        ...

    async def set_budget(self, principal: str, budget: Budget | None) -> None:
        """Set (None: remove) a principal's budget."""
        ...

    async def aclose(self) -> None: ...


def open_usage_store(data_dir: Path, pool: Any | None, url: str | None) -> UsageStore:
    """PostgreSQL when a pool is given, else ``usage.db`` under ``data_dir``."""
    if pool is not None:
        from gateway_http.usage.postgres import PostgresUsageStore

        assert url is not None
        return PostgresUsageStore(pool, url)
    from gateway_http.usage.sqlite import SqliteUsageStore

    return SqliteUsageStore.open(data_dir / USAGE_FILE)
