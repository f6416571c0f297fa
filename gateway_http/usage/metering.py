"""Usage for one gateway process: the store, the meter and the budgets, opened and closed
together by the app's lifespan (``ARONA_USAGE=false``: none of them)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from arona_grpc.config import Settings
from gateway_http.metrics import GatewayMetrics
from gateway_http.usage.budgets import Budgets
from gateway_http.usage.meter import EndedTurn, PriceOf, UsageMeter
from gateway_http.usage.records import Budget, Spent, UsageQuery, UsageSummary, month_of
from gateway_http.usage.store import UsageStore, open_usage_store


class Metering:
    def __init__(self, store: UsageStore, meter: UsageMeter, budgets: Budgets) -> None:
        self.store = store
        self.meter = meter
        self.budgets = budgets

    @classmethod
    async def open(
        cls,
        settings: Settings,
        pool: Any | None,
        metrics: GatewayMetrics,
        price_of: PriceOf | None = None,
    ) -> Metering:
        store = open_usage_store(settings.data_dir, pool, settings.database_url)
        try:
            budgets = Budgets(store, settings.usage_refresh_s, metrics)
            await budgets.start()
        except BaseException:
            await store.aclose()
            raise
        meter = UsageMeter(store, budgets, metrics, price_of=price_of)
        try:
            await meter.start()
        except BaseException:
            await budgets.aclose()
            await store.aclose()
            raise
        return cls(store, meter, budgets)

    async def check(self, principal: str) -> None:
        """Refuse a turn of ``principal`` if its month is spent (429 insufficient_quota)."""
        await self.budgets.check(principal)

    def record(self, turn: EndedTurn) -> None:
        self.meter.record(turn)

    async def summary(self, query: UsageQuery) -> UsageSummary:
        """What the records say, this process's last turns included."""
        await self.meter.flush()
        return await self.store.summary(query)

    def budget_of(self, principal: str) -> Budget | None:
        return self.budgets.budget_of(principal)

    async def spent_this_month(self, principal: str) -> Spent:
        """What ``principal`` spent this month, read from the store."""
        await self.meter.flush()
        month = month_of(datetime.now(UTC))
        return (await self.store.spent(month, [principal])).get(principal, Spent())

    async def aclose(self) -> None:
        try:
            await self.meter.aclose()
            await self.budgets.aclose()
        finally:
            await self.store.aclose()
