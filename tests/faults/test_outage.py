"""No answered turn is lost: a 60 s store outage under load, and SIGKILLs in every order.

Real processes: the embedded store (``arona-gateway store``) and the gateway
(``arona-gateway serve``, the echo model), both on loopback. Chat turns arrive at
:data:`RATE` a second from :data:`CONCURRENCY` clients while the store, the gateway or both are
killed with SIGKILL and started again on the same data directories. Every turn answered 200 is
then looked for in the store's own database file: none may be missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.faults.processes import Gateway, Load, Store, running, wait_stored

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

RATE = 120.0
CONCURRENCY = 16
OUTAGE_S = 60.0
# After the outage: the outbox replays while turns keep coming.
AFTER_S = 5.0
# The store takes the whole outage's turns back in a few seconds on an idle 2-core box; the
# bound is tenfold (and more) for a loaded one.
DRAIN_S = 120.0


@pytest_asyncio.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[Store, Gateway]]:
    async with running(tmp_path) as started:
        yield started


async def during(load: Load, seconds: float) -> tuple[float, float]:
    """Let the load run ``seconds`` (ended early if it stops); when that span began and ended."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(load.stop.wait(), seconds)
    except TimeoutError:
        pass
    return started, time.monotonic()


async def finish(load: Load, running: asyncio.Task[None], store: Store) -> None:
    """Stop the load; every turn answered must be in the store's database."""
    load.stop.set()
    await running
    assert load.answered, "no turn was answered"
    missing = await wait_stored(store.db, load.words, DRAIN_S)
    assert not missing, f"{len(missing)} of {len(load.answered)} answered turns not stored"


@pytest.mark.timeout(600)
async def test_a_60_s_store_outage_under_load_loses_no_answered_turn(
    parts: tuple[Store, Gateway],
) -> None:
    store, gateway = parts
    load = Load(RATE, CONCURRENCY, max_turns=int(RATE * (OUTAGE_S + 30)))
    load.point_at(gateway.url)
    running = asyncio.create_task(load.run())
    async with httpx.AsyncClient(timeout=30) as client:
        await during(load, 3.0)
        await store.kill()
        began, ended = await during(load, OUTAGE_S)
        in_outage = load.answered_between(began, ended)
        metrics = await gateway.metrics(client)
        await store.start()
        await during(load, AFTER_S)
        await finish(load, running, store)
        after = await gateway.metrics(client)
    print(
        f"\nstore outage of {OUTAGE_S:g} s: {in_outage} turns answered during it "
        f"({in_outage / (ended - began):.0f}/s), outbox {metrics['arona_outbox_depth']:.0f} "
        f"episodes, {metrics['arona_outbox_bytes'] / 2**20:.1f} MiB at its end"
    )
    # More than the count bound of earlier versions (1,000) waited in the outbox, and none
    # was dropped or refused.
    assert in_outage > 1000
    assert metrics["arona_outbox_depth"] > 1000
    assert after["arona_outbox_dropped_total"] == 0
    assert after["arona_outbox_dead_letters_total"] == 0
    assert after["arona_outbox_depth"] == 0


# Each order: what is killed (and when), then what is started again.
ORDERS = {
    "gateway": (["gateway"], ["gateway"]),
    "store-then-gateway": (["store", "gateway"], ["gateway", "store"]),
    "gateway-then-store": (["gateway", "store"], ["store", "gateway"]),
}
SHORT_OUTAGE_S = 5.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", list(ORDERS))
async def test_sigkills_in_any_order_lose_no_answered_turn(
    parts: tuple[Store, Gateway], order: str
) -> None:
    store, gateway = parts
    kills, restarts = ORDERS[order]
    by_name: dict[str, Store | Gateway] = {"store": store, "gateway": gateway}
    load = Load(RATE, CONCURRENCY, max_turns=int(RATE * 60))
    load.point_at(gateway.url)
    running = asyncio.create_task(load.run())
    await during(load, 3.0)
    for name in kills:
        if name == "gateway":
            load.up.clear()
        await by_name[name].kill()
        # Turns go on meanwhile wherever something still answers them.
        await during(load, SHORT_OUTAGE_S / len(kills))
    for name in restarts:
        await by_name[name].start()
        if name == "gateway":
            load.point_at(gateway.url)
        await during(load, SHORT_OUTAGE_S / len(restarts))
    await during(load, AFTER_S)
    await finish(load, running, store)
    print(f"\n{order}: {len(load.answered)} turns answered, {load.failed} failed")
