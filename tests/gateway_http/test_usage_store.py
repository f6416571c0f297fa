"""The usage stores on both backends: a SQLite file under ``tmp_path`` and a real PostgreSQL
database."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from arona_common.database import open_pool
from gateway_http.usage.records import (
    DEFAULT_BUDGET,
    Budget,
    Spent,
    UsageQuery,
    UsageRecord,
    micros,
)
from gateway_http.usage.store import USAGE_FILE, UsageStore, open_usage_store
from tests.support.usage import usage_record

DEC_1 = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
DEC_2 = datetime(2026, 12, 2, 23, 59, 59, tzinfo=UTC)
NOV_30 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
ALL = UsageQuery(micros(datetime(2026, 1, 1, tzinfo=UTC)), micros(datetime(2027, 1, 1, tzinfo=UTC)))


def record(
    principal: str = "alice",
    *,
    at: datetime = DEC_1,
    prompt: int = 100,
    completion: int = 20,
    memory: int = 30,
    **fields: Any,
) -> UsageRecord:
    return usage_record(principal, prompt, completion, at=at, memory_tokens=memory, **fields)


@pytest_asyncio.fixture
async def store(backend: str | None, tmp_path: Path) -> AsyncIterator[UsageStore]:
    pool = await open_pool(backend) if backend else None
    opened = open_usage_store(tmp_path / "data", pool, backend)
    yield opened
    await opened.aclose()
    if pool is not None:
        await pool.close()


def table(rows: Any) -> list[tuple[Any, ...]]:
    return [
        (*r.groups, r.turns, r.prompt_tokens, r.completion_tokens, r.memory_tokens) for r in rows
    ]


@pytest.mark.asyncio
async def test_a_summary_adds_up_the_records_by_each_grouping(store: UsageStore) -> None:
    await store.add(
        [
            record("alice", model="gpt-4o", backend="openai", prompt=100, completion=20),
            record("alice", model="llama", backend="local", prompt=50, completion=5, at=DEC_2),
            record("bob", model="gpt-4o", backend="openai", prompt=7, completion=3, memory=0),
        ]
    )

    whole = (await store.summary(ALL)).rows
    assert table(whole) == [(3, 157, 28, 60)]
    assert whole[0].total_tokens == 185
    by_principal = await store.summary(UsageQuery(ALL.start_us, ALL.end_us, ("principal",)))
    assert table(by_principal.rows) == [("alice", 2, 150, 25, 60), ("bob", 1, 7, 3, 0)]
    by_model_day = await store.summary(UsageQuery(ALL.start_us, ALL.end_us, ("day", "model")))
    assert table(by_model_day.rows) == [
        ("2026-12-01", "gpt-4o", 2, 107, 23, 30),
        ("2026-12-02", "llama", 1, 50, 5, 30),
    ]
    by_backend = await store.summary(UsageQuery(ALL.start_us, ALL.end_us, ("backend",)))
    assert [r.groups for r in by_backend.rows] == [("local",), ("openai",)]


@pytest.mark.asyncio
async def test_a_summary_keeps_to_its_period_and_principal(store: UsageStore) -> None:
    await store.add([record("alice", at=NOV_30), record("alice", at=DEC_1), record("bob")])

    december = UsageQuery(micros(datetime(2026, 12, 1, tzinfo=UTC)), ALL.end_us)
    assert (await store.summary(december)).rows[0].turns == 2
    mine = UsageQuery(ALL.start_us, ALL.end_us, principal="alice")
    assert (await store.summary(mine)).rows[0].turns == 2
    # The end is exclusive: a record at exactly the end is the next period's.
    upto = UsageQuery(ALL.start_us, micros(DEC_1))
    assert table((await store.summary(upto)).rows) == [(1, 100, 20, 30)]
    nobody = UsageQuery(ALL.start_us, ALL.end_us, ("model",), principal="carol")
    assert (await store.summary(nobody)).rows == ()


@pytest.mark.asyncio
async def test_a_batch_stored_twice_counts_each_turn_once(store: UsageStore) -> None:
    batch = [record("alice"), record("alice", prompt=5, completion=5)]

    assert await store.add(batch) == 2
    # A batch sent again (its commit's answer was lost) and one that repeats one turn.
    assert await store.add(batch) == 0
    assert await store.add([batch[0], record("alice", prompt=1, completion=0)]) == 1

    assert (await store.summary(ALL)).rows[0].turns == 3
    assert await store.spent("2026-12") == {"alice": Spent(131, 0)}


@pytest.mark.asyncio
async def test_spending_is_kept_per_principal_and_calendar_month(store: UsageStore) -> None:
    await store.add(
        [
            record("alice", at=NOV_30, prompt=1000, completion=0),
            record("alice", prompt=40, completion=2, cost_micro=1500),
            record("alice", prompt=8, completion=0, cost_micro=None),
            record("bob", prompt=3, completion=3),
        ]
    )

    assert await store.spent("2026-12") == {"alice": Spent(50, 1500), "bob": Spent(6, 0)}
    assert await store.spent("2026-11", ["alice", "bob"]) == {"alice": Spent(1000, 0)}
    assert await store.spent("2026-12", ["bob"]) == {"bob": Spent(6, 0)}
    assert await store.spent("2026-12", []) == {}


@pytest.mark.asyncio
async def test_costs_add_up_and_no_price_is_no_cost(store: UsageStore) -> None:
    await store.add([record("alice", model="priced", cost_micro=2500)] * 1)
    await store.add(
        [record("alice", model="priced", cost_micro=500), record("alice", model="free")]
    )

    rows = (await store.summary(UsageQuery(ALL.start_us, ALL.end_us, ("model",)))).rows
    assert [(r.groups, r.cost_micro) for r in rows] == [(("free",), None), (("priced",), 3000)]


@pytest.mark.asyncio
async def test_estimated_turns_are_counted(store: UsageStore) -> None:
    await store.add([record(estimated=True), record(estimated=False), record(estimated=True)])

    assert (await store.summary(ALL)).rows[0].estimated_turns == 2


@pytest.mark.asyncio
async def test_budgets_are_set_replaced_and_removed(store: UsageStore) -> None:
    assert await store.budgets() == {}
    await store.set_budget("key:team", Budget(tokens=1000))
    await store.set_budget(DEFAULT_BUDGET, Budget(tokens=50, cost_micro=2_000_000))
    await store.set_budget("key:team", Budget(tokens=5000))

    assert await store.budgets() == {
        "key:team": Budget(tokens=5000),
        DEFAULT_BUDGET: Budget(tokens=50, cost_micro=2_000_000),
    }
    await store.set_budget("key:team", None)
    assert await store.budgets() == {DEFAULT_BUDGET: Budget(tokens=50, cost_micro=2_000_000)}


@pytest.mark.asyncio
async def test_two_writers_sending_the_same_turns_store_them_once(
    backend: str | None, tmp_path: Path
) -> None:
    """Two processes (replicas, or HTTP workers on one file) race with overlapping batches."""
    pools = [await open_pool(backend) for _ in range(2)] if backend else [None, None]
    stores = [open_usage_store(tmp_path, pool, backend) for pool in pools]
    try:
        turns = [record(f"p{i % 7}", prompt=i, completion=1) for i in range(300)]
        batches = [turns[i : i + 60] for i in range(0, 300, 60)]
        added = await asyncio.gather(
            *(stores[0].add(b) for b in batches), *(stores[1].add(b) for b in reversed(batches))
        )

        assert sum(added) == 300
        spent = await stores[1].spent("2026-12")
        assert sum(s.tokens for s in spent.values()) == sum(r.tokens for r in turns)
        assert spent["p3"].tokens == sum(r.tokens for r in turns if r.principal == "p3")
    finally:
        for opened in stores:
            await opened.aclose()
        for pool in pools:
            if pool is not None:
                await pool.close()


@pytest.mark.asyncio
async def test_the_sqlite_file_is_versioned(tmp_path: Path) -> None:
    opened = open_usage_store(tmp_path, None, None)
    await opened.aclose()

    with sqlite3.connect(tmp_path / USAGE_FILE) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (1,)
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="newer version"):
        open_usage_store(tmp_path, None, None)


@pytest.mark.asyncio
async def test_an_older_sqlite_without_returning_stores_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite before 3.35 has no RETURNING: records go in one at a time, to the same end."""
    from gateway_http.usage import sqlite as usage_sqlite

    monkeypatch.setattr(usage_sqlite, "_RETURNING", False)
    store = open_usage_store(tmp_path, None, None)
    try:
        batch = [record("alice", prompt=10, completion=1), record("bob", prompt=5, completion=0)]
        assert await store.add(batch) == 2
        assert await store.add([*batch, record("alice", prompt=1, completion=0)]) == 1
        assert await store.spent("2026-12") == {"alice": Spent(12, 0), "bob": Spent(5, 0)}
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_a_large_batch_is_stored_whole(store: UsageStore) -> None:
    batch = [record(f"p{i % 3}", prompt=i, completion=0) for i in range(1000)]

    assert await store.add(batch) == 1000
    assert sum(s.tokens for s in (await store.spent("2026-12")).values()) == sum(range(1000))
