"""The gateway given several store URLs: two stores serving the same memories, on each backend
(ONE SQLite file; one PostgreSQL database with pgvector), both real servers on 127.0.0.1,
behind the real gRPC service and the real app under uvicorn.

A memory written through either store is recalled through the other; with one store stopped
in the middle of turns every turn still recalls (``X-Arona-Memory: enabled``), every turn's
episode is recalled later and ``memory.status`` names the store that is down; with both
stopped turns are ``offline`` as with one store; a store started again is used again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from arona_store.server import StoreServer
from tests.e2e.stack import PHILIA_TOKEN, Stack, running_stack

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

SEED = "User: I prefer oolong tea\nAssistant: noted"
TURNS = 8


class Stores:
    """Two stores on one database (a file, or PostgreSQL at ``database_url``), each stopped
    and started again at will (on the port it had, so the gateway finds it where its URL
    says)."""

    def __init__(self, db: Path, database_url: str | None = None) -> None:
        self.db = db
        self.database_url = database_url
        self.servers: list[StoreServer | None] = [None, None]
        self.ports = [0, 0]

    async def start(self, i: int) -> StoreServer:
        server = await StoreServer.start(
            db_path=self.db,
            token=PHILIA_TOKEN,
            ranking="lexical",
            port=self.ports[i],
            database_url=self.database_url,
        )
        self.servers[i], self.ports[i] = server, server.port
        return server

    async def stop(self, i: int) -> None:
        server, self.servers[i] = self.servers[i], None
        if server is not None:
            await server.stop()

    def url(self, i: int) -> str:
        return f"ws://127.0.0.1:{self.ports[i]}/ws"

    @property
    def memory_url(self) -> str:
        return f"{self.url(0)},{self.url(1)}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str | None:
    """Each test on both backends: None (one SQLite file) or a PostgreSQL database."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("store_database_url")
    return url


@contextlib.asynccontextmanager
async def two_stores_and_a_gateway(
    tmp_path: Path, database_url: str | None
) -> AsyncIterator[tuple[Stores, Stack]]:
    stores = Stores(tmp_path / "memory.db", database_url)
    try:
        for i in (0, 1):
            await stores.start(i)
        async with running_stack(
            tmp_path / "gateway",
            memory_url=stores.memory_url,
            # A stopped store is checked again (and found back) every 0.2 s.
            memory_breaker_cooldown_s=0.2,
            memory_breaker_failures=2,
        ) as stack:
            yield stores, stack
    finally:
        for i in (0, 1):
            await stores.stop(i)


async def ask(stack: Stack, question: str) -> tuple[str | None, str]:
    """One REST turn: its ``X-Arona-Memory`` and the memory section the model was given."""
    turn = await stack.turn("rest", [{"role": "user", "content": question}])
    assert turn.status == 200, turn.body
    first = stack.upstream.last_body["messages"][0]
    return turn.memory, first["content"] if first["role"] == "system" else ""


async def status(stack: Stack) -> dict[str, Any]:
    reply = await stack.rpc("memory.status")
    assert PHILIA_TOKEN not in str(reply)
    result: dict[str, Any] = reply["result"]
    return result


async def store_states(stack: Stack) -> list[tuple[str, str]]:
    return [(s["url"], s["state"]) for s in (await status(stack))["stores"]]


async def until_state(stack: Stack, wanted: list[tuple[str, str]], within_s: float = 20) -> None:
    """Until ``memory.status`` shows the stores so (a stopped store's check runs on its own
    timer, every 0.2 s here): asked every 50 ms, for at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while (found := await store_states(stack)) != wanted:
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def test_memories_written_through_either_store_are_recalled_through_each(
    tmp_path: Path, database_url: str | None
) -> None:
    async with two_stores_and_a_gateway(tmp_path, database_url) as (stores, stack):
        codes = [f"zq{i}k" for i in range(4)]
        for code in codes:
            memory, _ = await ask(stack, f"Remember that my locker code is {code}")
        await stack.drain_writebacks()
        # The four turns' writebacks went two through each store; each store alone recalls
        # every one of them.
        for alone in (1, 0):
            gone = 1 - alone
            await stores.stop(gone)
            if alone == 0:
                await stores.start(alone)
            for code in codes:
                memory, section = await ask(stack, f"what about locker code {code}?")
                assert memory == "enabled" and code in section, (alone, section)
            states = await store_states(stack)
            assert states[alone] == (stores.url(alone), "up")
            assert states[gone] == (stores.url(gone), "down")


async def test_a_store_stopped_under_turns_loses_nothing_then_offline_then_back(
    tmp_path: Path, database_url: str | None
) -> None:
    async with two_stores_and_a_gateway(tmp_path, database_url) as (stores, stack):
        memory, _ = await ask(stack, "Remember: I prefer oolong tea")
        await stack.drain_writebacks()
        assert await store_states(stack) == [
            (stores.url(0), "up"),
            (stores.url(1), "up"),
        ]

        # Turns in flight while the first store stops: each recalls the tea (through the
        # other store when its call is cut) and is stored.
        async def turn(i: int) -> str | None:
            question = f"what tea do I like? my parcel number is pq{i}x"
            return (await stack.turn("rest", [{"role": "user", "content": question}])).memory

        turns = [asyncio.create_task(turn(i)) for i in range(TURNS)]
        # The tea turn, then three of these at the model: the rest are on their way.
        await stack.upstream.wait_requests(4, timeout_s=30)
        await stores.stop(0)
        assert await asyncio.gather(*turns) == ["enabled"] * TURNS
        await stack.drain_writebacks()

        result = await status(stack)
        down, up = result["stores"]
        assert (down["url"], down["state"], up["state"]) == (stores.url(0), "down", "up")
        assert down["error"] and up["error"] is None
        assert result["breaker"] == "closed"
        assert any(
            e["kind"] == "error" and f"memory store 1 ({stores.url(0)}) is down" in e["detail"]
            for e in result["events"]
        )
        # No writeback was lost: each turn's parcel number is recalled.
        for i in range(TURNS):
            memory, section = await ask(stack, f"which parcel is pq{i}x?")
            assert memory == "enabled" and f"pq{i}x" in section

        # Both stores down: offline, as with one store.
        await stores.stop(1)
        assert (await ask(stack, "what tea do I like?"))[0] == "offline"
        assert [state for _, state in await store_states(stack)] == ["down", "down"]

        # The first one back: found by its check and used again, with every memory.
        await stores.start(0)
        await until_state(stack, [(stores.url(0), "up"), (stores.url(1), "down")])
        for i in range(TURNS):
            memory, section = await ask(stack, f"which parcel is pq{i}x?")
            assert memory == "enabled" and f"pq{i}x" in section
