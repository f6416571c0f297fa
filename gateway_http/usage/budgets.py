"""Monthly budgets: a principal whose month is spent is refused before any upstream call.

A budget is a number of tokens (prompt + completion), a cost (when the backends file prices
the model), or both, per principal (an API key's ``key:<name>``, a JWT ``sub``) per calendar
month in UTC. Budgets are kept in the usage store, so every replica enforces the same ones;
the budget under :data:`~gateway_http.usage.records.DEFAULT_BUDGET` is every other principal's.
``arona-gateway budget`` sets them.

What a check compares with the budget: the month's spending as last read from the store, plus
what this process's turns spent since (as soon as a turn ends when its upstream reported its
usage, once the meter counted it when it did not). The store is read by a background task every
``ARONA_USAGE_REFRESH_S`` (2 s), so a chat turn makes no query; with 0 the store is read on
every turn of a principal who has a budget (one or two queries a turn, and no staleness but
the meter's). A turn is let through while the budget is not used up, and its own tokens are
known only once it ended: how far a principal can go over is in docs/usage.md (Budgets).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from arona_common.database import DatabaseUnavailable
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.metrics import GatewayMetrics
from gateway_http.usage.records import (
    DEFAULT_BUDGET,
    MICRO,
    Budget,
    Spent,
    month_of,
    next_month,
)
from gateway_http.usage.store import UsageStore

logger = logging.getLogger(__name__)


class Budgets:
    """The budgets of every principal and what each spent this month, as this process knows."""

    def __init__(self, store: UsageStore, refresh_s: float, metrics: GatewayMetrics) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._metrics = metrics
        self._budgets: dict[str, Budget] = {}
        self._month = month_of(datetime.now(UTC))
        # The month's spending as last read; this process's turns not stored yet, and those
        # stored since that read.
        self._read: dict[str, Spent] = {}
        self._pending: dict[str, Spent] = {}
        self._stored: dict[str, Spent] = {}
        # Held while a batch is stored and while the store is read, so a read never sees a
        # batch that is also still counted in _stored.
        self.lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> bool:
        """Whether any budget is set (if none, nothing is tracked and no turn is checked)."""
        return bool(self._budgets) or self._refresh_s == 0

    async def start(self) -> None:
        """Read the budgets and this month's spending, then keep them fresh."""
        try:
            await self.refresh()
        except Exception as exc:
            # The refreshing task reads them as soon as the store answers.
            _unread(exc)
        if self._refresh_s > 0:
            self._task = asyncio.create_task(self._refreshing(), name="usage-budgets")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check(self, principal: str) -> None:
        """Refuse (429 ``insufficient_quota``) a turn of a principal whose month is spent."""
        if not self.active:
            return
        if self._refresh_s == 0:
            try:
                await self.refresh(principal)
            except Exception as exc:
                # Like a memory outage, an unreadable store never fails a chat: the last
                # spending known stands.
                logger.warning("budgets could not be read: %s", exc)
        budget = self._budgets.get(principal) or self._budgets.get(DEFAULT_BUDGET)
        if budget is None:
            return
        spent = self.spent_of(principal)
        if spent.over(budget):
            self._metrics.budget_refused()
            raise GatewayError(
                ErrorKind.QUOTA,
                _refusal(principal, budget, spent, self._month),
                "insufficient_quota",
            )

    def spent_of(self, principal: str) -> Spent:
        """What ``principal`` spent this month, as this process knows now."""
        nothing = Spent()
        return (
            self._read.get(principal, nothing)
            + self._pending.get(principal, nothing)
            + self._stored.get(principal, nothing)
        )

    def budget_of(self, principal: str) -> Budget | None:
        return self._budgets.get(principal) or self._budgets.get(DEFAULT_BUDGET)

    def spending(self, principal: str, spent: Spent) -> None:
        """A turn of ``principal`` spent this (the meter tells, before storing it)."""
        if self.active and (spent.tokens or spent.cost_micro):
            _add(self._pending, principal, spent)

    def stored(self, spent: dict[str, Spent]) -> None:
        """The meter stored turns that spent this (under :attr:`lock`)."""
        for principal, amount in spent.items():
            left = self._pending.get(principal, Spent()) - amount
            if left.tokens > 0 or left.cost_micro > 0:
                self._pending[principal] = left
            else:
                self._pending.pop(principal, None)
            _add(self._stored, principal, amount)

    async def refresh(self, principal: str | None = None) -> None:
        """Read the budgets and the month's spending of the principals who have one (with
        ``principal``: that one's only) from the store."""
        async with self.lock:
            budgets = await self._store.budgets()
            month = month_of(datetime.now(UTC))
            if principal is not None:
                who: list[str] | None = [principal]
            else:
                who = None if DEFAULT_BUDGET in budgets else list(budgets)
            read = await self._store.spent(month, who) if budgets else {}
            self._budgets = budgets
            if principal is not None and month == self._month:
                self._read[principal] = read.get(principal, Spent())
                self._stored.pop(principal, None)
            else:
                self._read = read
                self._stored = {}
            self._month = month

    async def _refreshing(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception as exc:
                # The last known budgets and spending stand until the store answers again.
                _unread(exc)


def _unread(exc: Exception) -> None:
    # A database outage is said once, by arona_common.database; anything else here.
    level = logging.DEBUG if isinstance(exc, DatabaseUnavailable) else logging.WARNING
    logger.log(level, "budgets could not be read: %s", exc)


def _add(into: dict[str, Spent], principal: str, spent: Spent) -> None:
    into[principal] = into.get(principal, Spent()) + spent


def _refusal(principal: str, budget: Budget, spent: Spent, month: str) -> str:
    renews = next_month(datetime.strptime(month + "-01", "%Y-%m-%d").replace(tzinfo=UTC))
    if budget.tokens is not None and spent.tokens >= budget.tokens:
        used = f"its {budget.tokens:,} tokens ({spent.tokens:,} spent)"
    else:
        assert budget.cost_micro is not None
        used = (
            f"its cost of {budget.cost_micro / MICRO:,.2f} ({spent.cost_micro / MICRO:,.2f} spent)"
        )
    return (
        f"You exceeded your current quota: the monthly budget of {principal} for {month} is "
        f"used up, {used}; it renews on {renews:%Y-%m-%d} (UTC)"
    )
