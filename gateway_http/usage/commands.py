"""``arona-gateway usage`` and ``arona-gateway budget``: the usage store read and the budgets set
from the command line, on the database the gateway uses (``ARONA_DATABASE_URL``, else
``usage.db`` under ``ARONA_DATA_DIR``). Each returns the text to print; :class:`CommandError`
is a one-line refusal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from arona_common.database import DatabaseUnavailable, SchemaRefused, command_pool
from arona_grpc.config import Settings
from gateway_http.usage import report
from gateway_http.usage.records import DEFAULT_BUDGET, MICRO, Budget, month_of
from gateway_http.usage.store import UsageStore, open_usage_store


class CommandError(Exception):
    """A refusal in one line, safe to print."""


@asynccontextmanager
async def _store(settings: Settings) -> AsyncIterator[UsageStore]:
    try:
        async with command_pool(settings.database_url) as pool:
            store = open_usage_store(settings.data_dir, pool, settings.database_url)
            try:
                yield store
            finally:
                await store.aclose()
    except (DatabaseUnavailable, SchemaRefused) as exc:
        raise CommandError(str(exc)) from None


async def usage_command(
    settings: Settings,
    start: str | None,
    end: str | None,
    group_by: str,
    principal: str | None,
    *,
    as_csv: bool,
) -> str:
    """The usage table (or CSV) of a period, as usage.summary answers it."""
    try:
        when = report.period(start, end)
        groups = report.group_by([g.strip() for g in group_by.split(",") if g.strip()])
    except report.BadQuery as exc:
        raise CommandError(str(exc)) from None
    async with _store(settings) as store:
        summary = await store.summary(report.query(when, groups, principal))
    if as_csv:
        return report.csv_text(summary, groups).rstrip("\n")
    heading = f"usage from {report.rfc3339(when.start)} to {report.rfc3339(when.end)}"
    if principal is not None:
        heading += f" of {principal}"
    return f"{heading}\n{report.table(summary, groups)}"


@dataclass(frozen=True)
class BudgetChange:
    principal: str | None  # None: the default budget
    tokens: int | None = None
    cost: float | None = None


async def budget_set(settings: Settings, change: BudgetChange) -> str:
    if change.tokens is None and change.cost is None:
        raise CommandError("give --tokens, --cost or both")
    if change.tokens is not None and change.tokens <= 0:
        raise CommandError("--tokens must be a positive whole number")
    if change.cost is not None and not change.cost > 0:
        raise CommandError("--cost must be a positive amount")
    who = _principal(change.principal)
    cost_micro = round(change.cost * MICRO) if change.cost is not None else None
    async with _store(settings) as store:
        await store.set_budget(who, Budget(change.tokens, cost_micro))
    return f"budget of {_shown(who)}: {_budget_text(Budget(change.tokens, cost_micro))} a month"


async def budget_clear(settings: Settings, principal: str | None) -> str:
    who = _principal(principal)
    async with _store(settings) as store:
        had = who in await store.budgets()
        await store.set_budget(who, None)
    return f"budget of {_shown(who)} removed" if had else f"{_shown(who)} had no budget"


async def budget_list(settings: Settings) -> str:
    """Every budget and what its principal spent this month."""
    month = month_of(datetime.now(UTC))
    async with _store(settings) as store:
        budgets = await store.budgets()
        spent = await store.spent(month)
    if not budgets:
        return "no budgets set"
    lines = [f"budgets for {month} (UTC):"]
    for who in sorted(budgets):
        line = f"  {_shown(who)}: {_budget_text(budgets[who])}"
        if who != DEFAULT_BUDGET:
            used = spent.get(who)
            line += f"; spent {used.tokens:,} tokens" if used else "; spent nothing"
            if used and used.cost_micro:
                line += f", cost {used.cost_micro / MICRO:,.2f}"
        lines.append(line)
    return "\n".join(lines)


def _principal(principal: str | None) -> str:
    if principal is None:
        return DEFAULT_BUDGET
    principal = principal.strip()
    if not principal or any(not c.isprintable() or c.isspace() for c in principal):
        raise CommandError(
            "PRINCIPAL must be a principal as the gateway names it (key:NAME, a JWT sub)"
        )
    return principal


def _shown(principal: str) -> str:
    return "every principal without its own (default)" if principal == DEFAULT_BUDGET else principal


def _budget_text(budget: Budget) -> str:
    parts = []
    if budget.tokens is not None:
        parts.append(f"{budget.tokens:,} tokens")
    if budget.cost_micro is not None:
        parts.append(f"cost {budget.cost_micro / MICRO:,.2f}")
    return " and ".join(parts)
