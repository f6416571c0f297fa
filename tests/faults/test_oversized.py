"""Oversized input harms no one: an oversized turn is stored shortened while later ones keep
flowing, and oversized questions leave the breaker closed.

Real processes (the embedded store, which refuses frames over 1 MiB, and ``arona-gateway
serve``), with other users chatting all along: none of their turns may go ``offline``, the
one Philia connection is never dropped, and every one of their turns is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import DEFAULT_EPISODE_CHARS
from tests.faults.processes import Gateway, Load, Store, running, wait_stored

pytestmark = pytest.mark.asyncio

# Other users' turns meanwhile: a few a second is enough to meet any dropped connection.
RATE = 20.0
# Everything here answers within a second or two on an idle 2-core box.
STORED_S = 60.0
MARKER = re.compile(r"\[\u2026 ([\d,]+) characters omitted \u2026\]")


@pytest_asyncio.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[Store, Gateway]]:
    async with running(tmp_path) as started:
        yield started


@contextlib.asynccontextmanager
async def others_chatting(gateway: Gateway) -> AsyncIterator[Load]:
    """Other users' turns, all along the block (bounded)."""
    load = Load(RATE, 4, max_turns=int(RATE * 300))
    load.point_at(gateway.url)
    running = asyncio.create_task(load.run())
    try:
        # A few answered first: memory is up and the link open before the oversized input.
        await load.wait_answered(10, STORED_S)
        yield load
    finally:
        load.stop.set()
        await running


@contextlib.asynccontextmanager
async def memory_service(gateway: Gateway) -> AsyncIterator[pb_grpc.MemoryServiceAsyncStub]:
    """The gateway's gRPC MemoryService, called directly (no token on loopback)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        yield pb_grpc.MemoryServiceStub(channel)


def stored_texts(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return [str(row[0]) for row in conn.execute("SELECT text FROM nodes")]


async def turn(client: httpx.AsyncClient, gateway: Gateway, text: str) -> httpx.Response:
    return await client.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": text}]},
    )


async def others_unharmed(gateway: Gateway, store: Store, load: Load) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        metrics = await gateway.metrics(client)
    assert load.offline == 0, f"{load.offline} other turns went offline"
    assert metrics["arona_memory_breaker_state:closed"] == 1
    # The one link to the store was never dropped.
    assert metrics["arona_philia_reconnects_total"] == 0
    assert metrics["arona_outbox_dead_letters_total"] == 0
    assert not await wait_stored(store.db, load.words, STORED_S)


@pytest.mark.timeout(180)
async def test_an_oversized_turn_is_stored_shortened_and_blocks_nobody(
    parts: tuple[Store, Gateway],
) -> None:
    store, gateway = parts
    async with others_chatting(gateway) as load:
        async with httpx.AsyncClient(timeout=60) as client:
            # 600 KB of user text (and as much again in the echo's reply) on REST...
            big = await turn(client, gateway, "big-rest " + "x" * 600_000)
            assert big.status_code == 200
            assert big.headers["x-arona-memory"] != "offline"
        # ...and a 2 MB Writeback straight to the gRPC service.
        async with memory_service(gateway) as stub:
            reply = await stub.Writeback(
                pb.WritebackRequest(user="big-grpc " + "y" * 2_000_000, assistant="noted"),
                timeout=60,
            )
        assert reply.stored
        # Later turns keep flowing.
        await load.wait_answered(len(load.answered) + 20, STORED_S)
    await others_unharmed(gateway, store, load)

    texts = stored_texts(store.db)
    [rest] = [t for t in texts if t.startswith("User: big-rest ")]
    [direct] = [t for t in texts if t.startswith("User: big-grpc ")]
    for text in (rest, direct):
        # Each long side kept to the cap, with the marker saying what was left out.
        assert MARKER.search(text), text[:200]
        assert len(text) < 2 * DEFAULT_EPISODE_CHARS + 200
    assert direct.endswith("y" * 100 + "\nAssistant: noted")
    omitted = [int(m.group(1).replace(",", "")) for m in MARKER.finditer(direct)]
    assert omitted == [2_000_009 - DEFAULT_EPISODE_CHARS]


@pytest.mark.timeout(180)
async def test_three_oversized_questions_leave_the_breaker_closed(
    parts: tuple[Store, Gateway],
) -> None:
    store, gateway = parts
    async with others_chatting(gateway) as load:
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(3):
                # A question of a million characters, far past what a recall asks with.
                asked = await turn(client, gateway, "q" * 1_000_000 + f" which tea {i}?")
                assert asked.status_code == 200
                assert asked.headers["x-arona-memory"] != "offline"
        async with memory_service(gateway) as stub:
            recalled = await stub.Recall(
                pb.RecallRequest(query="r" * 1_100_000 + " which tea?"), timeout=60
            )
        assert recalled.state != pb.MEMORY_STATE_OFFLINE
        async with httpx.AsyncClient(timeout=60) as client:
            status = await gateway.metrics(client)
        assert status["arona_memory_breaker_state:closed"] == 1
    await others_unharmed(gateway, store, load)
