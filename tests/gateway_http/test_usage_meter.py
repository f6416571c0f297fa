"""The usage meter and the budgets over real stores (a SQLite file, a PostgreSQL database)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client import generate_latest

from arona_common.database import DatabaseUnavailable, open_pool
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.metrics import GatewayMetrics
from gateway_http.usage.budgets import Budgets
from gateway_http.usage.meter import EndedTurn, UsageMeter
from gateway_http.usage.records import (
    DEFAULT_BUDGET,
    Budget,
    Price,
    Spent,
    UsageQuery,
    UsageRecord,
    UsageSummary,
    micros,
    month_of,
)
from gateway_http.usage.store import UsageStore, open_usage_store
from gateway_http.usage.tokens import TokenCounter

SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
EVER = UsageQuery(0, micros(datetime(2100, 1, 1, tzinfo=UTC)))
THIS_MONTH = month_of(datetime.now(UTC))


def ended(
    principal: str = "alice",
    *,
    usage: Any = None,
    prompt: list[Any] | None = None,
    reply: str = "",
    section: str = "",
    backend: str = "openai",
    model: str = "gpt-4o",
    user: str = "",
) -> EndedTurn:
    return EndedTurn(
        turn_id=uuid.uuid4().hex,
        principal=principal,
        user=user,
        model=model,
        backend=backend,
        surface="rest",
        outcome="ok",
        latency_ms=3.5,
        usage=usage,
        prompt=prompt if prompt is not None else [{"role": "user", "content": "hello world"}],
        reply=reply,
        reply_message=None,
        section=section,
    )


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


@pytest_asyncio.fixture
async def store(backend: str | None, tmp_path: Path) -> AsyncIterator[UsageStore]:
    pool = await open_pool(backend) if backend else None
    opened = open_usage_store(tmp_path, pool, backend)
    yield opened
    await opened.aclose()
    if pool is not None:
        await pool.close()


@pytest_asyncio.fixture
async def meter_parts(
    store: UsageStore,
) -> AsyncIterator[tuple[UsageMeter, Budgets, GatewayMetrics]]:
    metrics = GatewayMetrics()
    budgets = Budgets(store, 0.05, metrics)
    await budgets.start()
    meter = UsageMeter(
        store,
        budgets,
        metrics,
        price_of=lambda backend, model: Price(2.5, 10.0) if model == "priced" else None,
    )
    await meter.start()
    yield meter, budgets, metrics
    await meter.aclose()
    await budgets.aclose()


def exposition(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.registry()).decode()


@pytest.mark.asyncio
async def test_reported_usage_is_stored_as_reported(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, _, metrics = meter_parts
    meter.record(ended(usage=usage(1234, 56), section=SECTION))
    meter.record(ended("bob", usage={**usage(7, 8), "total_tokens": 15}, backend="local"))
    await meter.flush()

    rows = (await store.summary(UsageQuery(EVER.start_us, EVER.end_us, ("principal",)))).rows
    assert [(r.groups, r.prompt_tokens, r.completion_tokens, r.estimated_turns) for r in rows] == [
        (("alice",), 1234, 56, 0),
        (("bob",), 7, 8, 0),
    ]
    # The memory section's share, counted with cl100k_base as a system message of its own.
    assert rows[0].memory_tokens == TokenCounter().count(SECTION) + 4
    text = exposition(metrics)
    assert 'arona_tokens_total{backend="openai",kind="prompt"} 1234.0' in text
    assert 'arona_tokens_total{backend="local",kind="completion"} 8.0' in text
    assert "alice" not in text


@pytest.mark.asyncio
async def test_a_turn_without_usage_is_counted_and_marked_estimated(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, _, _ = meter_parts
    for bad in (None, {}, {"prompt_tokens": 5}, {"prompt_tokens": -1, "completion_tokens": 2}):
        meter.record(ended(usage=bad, reply="hello world"))
    await meter.flush()

    summary = await store.summary(EVER)
    # "hello world" is 2 tokens of cl100k_base; the prompt [user: hello world] is 9.
    assert summary.rows[0].turns == 4
    assert summary.rows[0].estimated_turns == 4
    assert summary.rows[0].prompt_tokens == 4 * 9
    assert summary.rows[0].completion_tokens == 4 * 2


@pytest.mark.asyncio
async def test_a_priced_model_is_costed(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, _, _ = meter_parts
    meter.record(ended(model="priced", usage=usage(1_000_000, 100_000)))
    meter.record(ended(model="free", usage=usage(10, 10)))
    await meter.flush()

    rows = (await store.summary(UsageQuery(EVER.start_us, EVER.end_us, ("model",)))).rows
    # 1M prompt tokens at 2.50 and 100k completion tokens at 10.00 per million: 3.50.
    assert [(r.groups, r.cost_micro) for r in rows] == [(("free",), None), (("priced",), 3_500_000)]


class FlakyStore:
    """A usage store that is unreachable for its first ``failures`` batches."""

    def __init__(self, inner: UsageStore, failures: int) -> None:
        self.inner = inner
        self.failures = failures
        self.tried = asyncio.Event()

    async def add(self, records: Sequence[UsageRecord]) -> int:
        self.tried.set()
        if self.failures:
            self.failures -= 1
            raise DatabaseUnavailable("the database at postgresql://***@db is unavailable")
        return await self.inner.add(records)

    async def summary(self, query: UsageQuery) -> UsageSummary:
        return await self.inner.summary(query)

    async def spent(self, month: str, principals: Sequence[str] | None = None) -> dict[str, Spent]:
        return await self.inner.spent(month, principals)

    async def budgets(self) -> dict[str, Budget]:
        return await self.inner.budgets()

    async def set_budget(self, principal: str, budget: Budget | None) -> None:
        await self.inner.set_budget(principal, budget)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.asyncio
async def test_records_wait_while_the_store_is_down_and_are_stored_once_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway_http.usage.meter")
    inner = open_usage_store(tmp_path, None, None)
    flaky = FlakyStore(inner, failures=2)
    metrics = GatewayMetrics()
    budgets = Budgets(flaky, 5.0, metrics)
    meter = UsageMeter(flaky, budgets, metrics)
    await meter.start()
    try:
        meter.record(ended(usage=usage(10, 1)))
        await meter.flush()
        assert (await inner.summary(EVER)).rows == ()
        assert meter.unsaved == 1
        meter.record(ended(usage=usage(20, 2)))
        await meter.flush()
        await meter.flush()

        rows = (await inner.summary(EVER)).rows
        assert (rows[0].turns, rows[0].prompt_tokens) == (2, 30)
        assert meter.unsaved == 0
        # A database outage is the database module's to say (one WARNING per outage): the
        # meter's own line about it is a debug record; its recovery an INFO line.
        [failed] = [r for r in caplog.records if "could not be stored" in r.getMessage()]
        assert failed.levelno == logging.DEBUG
        assert "usage records are stored again" in caplog.text
    finally:
        await meter.aclose()
        await inner.aclose()


@pytest.mark.asyncio
async def test_a_stopping_meter_stores_what_waits(tmp_path: Path) -> None:
    store = open_usage_store(tmp_path, None, None)
    metrics = GatewayMetrics()
    meter = UsageMeter(store, Budgets(store, 5.0, metrics), metrics)
    await meter.start()
    for n in range(700):
        meter.record(ended(usage=usage(n, 1)))
    await meter.aclose()

    rows = (await store.summary(EVER)).rows
    await store.aclose()
    assert (rows[0].turns, rows[0].prompt_tokens) == (700, sum(range(700)))


@pytest.mark.asyncio
async def test_a_spent_budget_refuses_its_principal_only(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, budgets, metrics = meter_parts
    await store.set_budget("key:team", Budget(tokens=100))
    await budgets.refresh()
    await budgets.check("key:team")

    # Known as soon as the turn ended, before the meter stored it.
    meter.record(ended("key:team", usage=usage(90, 10)))
    with pytest.raises(GatewayError) as refused:
        await budgets.check("key:team")
    assert refused.value.kind is ErrorKind.QUOTA
    assert refused.value.code == "insufficient_quota"
    assert refused.value.mapping.http_status == 429
    assert f"the monthly budget of key:team for {THIS_MONTH} is used up" in refused.value.message
    assert "its 100 tokens (100 spent)" in refused.value.message
    await budgets.check("key:other")
    assert "arona_budget_refusals_total 1.0" in exposition(metrics)

    # Still refused once stored and read back.
    await meter.flush()
    await budgets.refresh()
    with pytest.raises(GatewayError):
        await budgets.check("key:team")


@pytest.mark.asyncio
async def test_the_default_budget_is_everyones_without_their_own(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, budgets, _ = meter_parts
    await store.set_budget(DEFAULT_BUDGET, Budget(tokens=50))
    await store.set_budget("key:big", Budget(tokens=1000))
    await budgets.refresh()
    for who in ("alice", "key:big"):
        meter.record(ended(who, usage=usage(60, 0)))

    with pytest.raises(GatewayError):
        await budgets.check("alice")
    await budgets.check("key:big")
    await budgets.check("carol")


@pytest.mark.asyncio
async def test_an_estimated_turn_counts_against_the_budget_once_counted(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, budgets, _ = meter_parts
    await store.set_budget("alice", Budget(tokens=10))
    await budgets.refresh()
    meter.record(ended("alice", usage=None, reply="hello world"))
    await budgets.check("alice")

    await meter.flush()
    with pytest.raises(GatewayError):
        await budgets.check("alice")


@pytest.mark.asyncio
async def test_a_cost_budget_refuses_once_the_cost_is_spent(
    store: UsageStore, meter_parts: tuple[UsageMeter, Budgets, GatewayMetrics]
) -> None:
    meter, budgets, _ = meter_parts
    await store.set_budget("alice", Budget(cost_micro=1_000_000))
    await budgets.refresh()
    meter.record(ended("alice", model="priced", usage=usage(100_000, 25_000)))
    await budgets.check("alice")
    meter.record(ended("alice", model="priced", usage=usage(0, 50_000)))

    with pytest.raises(GatewayError) as refused:
        await budgets.check("alice")
    assert "its cost of 1.00 (1.00 spent)" in refused.value.message


@pytest.mark.asyncio
async def test_replicas_share_one_budget(database_url: str) -> None:
    """Two gateways on one PostgreSQL database: what one spent refuses the other."""
    pools = [await open_pool(database_url) for _ in range(2)]
    stores = [open_usage_store(Path("."), pool, database_url) for pool in pools]
    metrics = GatewayMetrics()
    # 0: the store is read on every budgeted turn.
    budgets = [Budgets(store, 0, metrics) for store in stores]
    meters = [UsageMeter(store, b, metrics) for store, b in zip(stores, budgets, strict=True)]
    try:
        await stores[0].set_budget("key:shared", Budget(tokens=100))
        for each, meter in zip(budgets, meters, strict=True):
            await each.start()
            await meter.start()
        meters[0].record(ended("key:shared", usage=usage(60, 0)))
        await meters[0].flush()
        await budgets[1].check("key:shared")
        meters[1].record(ended("key:shared", usage=usage(60, 0)))
        await meters[1].flush()

        for each in budgets:
            with pytest.raises(GatewayError):
                await each.check("key:shared")
    finally:
        for meter in meters:
            await meter.aclose()
        for each in budgets:
            await each.aclose()
        for pool in pools:
            await pool.close()
