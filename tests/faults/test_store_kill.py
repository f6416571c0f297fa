"""A store killed in the middle of its writes: every memory it acknowledged is recalled after.

The embedded store runs as a real process (``arona-gateway store``). Several clients store
memories over the wire, each holding a word of its own; the process is killed with SIGKILL
while they write, started again on the same database, and each memory whose store it
answered is recalled by its word: through the word engine, which the store builds again from
the database when it starts (nothing of it outlives the process).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from urllib.parse import urlencode

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from tests.arona_store.conftest import StoreClient
from tests.faults.processes import TOKEN, Store

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

WRITERS = 8
# Stores answered before the kill; each writer stops at its own bound.
KILL_AFTER = 150
PER_WRITER = 400


async def connected(store: Store) -> tuple[contextlib.AsyncExitStack, StoreClient]:
    stack = contextlib.AsyncExitStack()
    url = f"{store.url}?{urlencode({'token': TOKEN})}"
    ws = await stack.enter_async_context(connect(url, proxy=None, open_timeout=30))
    client = StoreClient(ws)
    assert (await client.handshake(TOKEN))["ok"] is True
    return stack, client


async def test_every_acknowledged_memory_is_recalled_after_a_sigkill(tmp_path: Path) -> None:
    store = Store(data_dir=tmp_path / "store", logs=tmp_path / "logs")
    await store.start()
    acknowledged: list[str] = []
    enough = asyncio.Event()

    async def write(writer: int) -> None:
        stack, client = await connected(store)
        async with stack:
            for i in range(PER_WRITER):
                word = f"zqk{writer}w{i}"
                try:
                    await client.call(
                        "Sync.MemoryStoreRequest",
                        {"text": f"User: remember the code {word}\nAssistant: noted"},
                    )
                except (WebSocketException, OSError, TimeoutError, AssertionError):
                    return  # the store is gone: this store was never answered
                acknowledged.append(word)
                if len(acknowledged) >= KILL_AFTER:
                    enough.set()

    writers = [asyncio.create_task(write(n)) for n in range(WRITERS)]
    try:
        await asyncio.wait_for(enough.wait(), 120)
        await store.kill()
        await asyncio.gather(*writers)
    finally:
        for task in writers:
            task.cancel()
    assert len(acknowledged) >= KILL_AFTER
    assert len(acknowledged) < WRITERS * PER_WRITER, "the kill came after every write"

    await store.start()
    try:
        stack, client = await connected(store)
        async with stack:
            missing = []
            for word in acknowledged:
                result = await client.call("Sync.MemoryQueryRequest", {"query": word, "limit": 3})
                texts = [hit["text"] for hit in result["results"]]
                if not any(word in text for text in texts):
                    missing.append(word)
        assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged: {missing[:5]}"
    finally:
        await store.stop()
