"""A hybrid store's new memories: answered before the model embeds them, found by their words
until their vector lands, embedded together when they arrive while the model is busy, never
given a vector once deleted, and embedded by the next start when the store stopped first.

Each test runs a real :class:`~arona_store.server.StoreServer` on 127.0.0.1 with the real model,
wrapped (:class:`WatchedModel`) so that a test can see what the store's embedding thread embeds
and hold it busy until the test releases it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from arona_store.server import EMBED_THREAD, StoreServer

from .conftest import TOKEN, WAIT_S, StoreClient, ws_url
from .semantic import needs_semantic

pytestmark = [needs_semantic, pytest.mark.asyncio]

FACT = "My daughter Mia is allergic to peanuts."
PARAPHRASE = "Does my kid have any food allergy?"
# The same words as FACT's own, asked as a question.
BY_ITS_WORDS = "Who is allergic to peanuts?"
DISTRACTOR = "I cooked food for my kid's birthday party."
NURSE = "I work as a nurse at St. Mary's hospital."
# How long a held run waits for its release at most: a failing test never leaves it hanging.
HOLD_MAX_S = 30.0
STORE = "Sync.MemoryStoreRequest"
QUERY = "Sync.MemoryQueryRequest"
DELETE = "Sync.MemoryDeleteRequest"


class WatchedModel:
    """A loaded model, watched: records the texts of every run on the store's embedding thread
    (the questions' runs, on other threads, pass as they are), and while held (:meth:`hold`)
    makes those runs wait for :meth:`release`, :attr:`busy` set once one does."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.runs: list[list[str]] = []
        self.busy = threading.Event()
        self._open = threading.Event()
        self._open.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def hold(self) -> None:
        self.busy.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def embed(self, texts: Sequence[str]) -> Any:
        if threading.current_thread().name.startswith(EMBED_THREAD):
            self.runs.append(list(texts))
            if not self._open.is_set():
                self.busy.set()
                self._open.wait(HOLD_MAX_S)
        return self._model.embed(texts)


@pytest.fixture(scope="module")
def loaded() -> Any:
    """The model, loaded once for the module."""
    from arona_store.embedding import Embedder

    return Embedder.load()


@pytest.fixture
def model(loaded: Any) -> WatchedModel:
    return WatchedModel(loaded)


@asynccontextmanager
async def serving(
    path: Path, model: WatchedModel
) -> AsyncIterator[tuple[StoreServer, StoreClient]]:
    """A hybrid store server on ``path`` with ``model``, and a client, handshake done."""
    async with await StoreServer.start(
        db_path=path, token=TOKEN, ranking="hybrid", embedder=model
    ) as server:
        try:
            async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
                client = StoreClient(ws)
                await client.handshake()
                yield server, client
        finally:
            # A test that failed while holding the model does not hold the stop up as well.
            model.release()


async def busy(model: WatchedModel) -> None:
    """Wait until a run of the store's embedding thread is held."""
    assert await asyncio.to_thread(model.busy.wait, WAIT_S), "the model was never busy"


async def store(client: StoreClient, text: str) -> str:
    node_id = (await client.call(STORE, {"text": text}))["node_id"]
    assert isinstance(node_id, str)
    return node_id


async def recalled(client: StoreClient, query: str) -> list[str]:
    return [r["text"] for r in (await client.call(QUERY, {"query": query}))["results"]]


def vector_rows(path: Path) -> dict[str, int]:
    """Each node id of the database file with a vector row: how many it has."""
    with closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT node_id, count(*) FROM vectors GROUP BY node_id").fetchall()
    return {str(node_id): int(count) for node_id, count in rows}


async def test_a_store_is_answered_while_the_model_is_busy_and_found_by_its_words_meanwhile(
    tmp_path: Path, model: WatchedModel
) -> None:
    async with serving(tmp_path / "s.db", model) as (server, client):
        model.hold()
        await store(client, NURSE)
        await busy(model)
        # Answered while the model is still held on the memory before it.
        await store(client, FACT)
        assert model.runs == [[NURSE]]
        assert server.store.unembedded() == 2
        # Found at once by its words, though no memory has a vector yet.
        assert (await recalled(client, BY_ITS_WORDS))[:1] == [FACT]
        model.release()
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        assert model.runs == [[NURSE], [FACT]]
        assert server.store.unembedded() == 0
        # Its vector landed: found by its meaning too.
        assert (await recalled(client, PARAPHRASE))[:1] == [FACT]


async def test_a_new_memory_is_found_by_its_words_among_memories_that_have_vectors(
    tmp_path: Path, model: WatchedModel
) -> None:
    async with serving(tmp_path / "s.db", model) as (server, client):
        for text in (DISTRACTOR, NURSE):
            await store(client, text)
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        model.hold()
        await store(client, FACT)
        await busy(model)
        # The others are compared with the question's meaning, this one only by its words.
        assert server.store.unembedded() == 1
        assert (await recalled(client, BY_ITS_WORDS))[:1] == [FACT]
        model.release()
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        assert (await recalled(client, PARAPHRASE))[:1] == [FACT]


async def test_stores_that_arrive_while_the_model_is_busy_are_embedded_in_one_run(
    tmp_path: Path, model: WatchedModel
) -> None:
    texts = [f"Note {i}: the invoice number {i} was paid on time." for i in range(5)]
    async with serving(tmp_path / "s.db", model) as (server, client):
        model.hold()
        first = await store(client, NURSE)
        await busy(model)
        ids = [await store(client, text) for text in texts]
        # A memory said again while it waits is embedded once.
        assert await store(client, texts[0]) == ids[0]
        model.release()
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
    assert model.runs[0] == [NURSE]
    assert [sorted(run) for run in model.runs[1:]] == [sorted(texts)]
    assert vector_rows(tmp_path / "s.db") == dict.fromkeys([first, *ids], 1)


async def test_a_memory_said_again_keeps_its_vector_and_costs_no_model_run(
    tmp_path: Path, model: WatchedModel
) -> None:
    async with serving(tmp_path / "s.db", model) as (server, client):
        first = await store(client, FACT)
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        assert await store(client, FACT) == first
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        assert model.runs == [[FACT]]
        assert server.store.unembedded() == 0


async def test_a_memory_deleted_before_its_vector_lands_gets_none(
    tmp_path: Path, model: WatchedModel
) -> None:
    path = tmp_path / "s.db"
    async with serving(path, model) as (server, client):
        model.hold()
        # One deleted while the model embeds it, one while it waits for the model.
        embedding = await store(client, NURSE)
        await busy(model)
        waiting = await store(client, FACT)
        for node_id in (embedding, waiting):
            assert await client.call(DELETE, {"node_id": node_id}) == {"deleted": True}
        model.release()
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        assert await recalled(client, BY_ITS_WORDS) == []
        assert await recalled(client, "Where do I work as a nurse?") == []
        assert server.store.count() == 0
    # The one deleted while it waited was never embedded; neither has a vector row.
    assert model.runs == [[NURSE]]
    assert vector_rows(path) == {}


async def test_memories_still_waiting_for_the_model_at_a_stop_get_their_vectors_next_start(
    tmp_path: Path, model: WatchedModel, loaded: Any
) -> None:
    path = tmp_path / "s.db"
    async with serving(path, model) as (server, client):
        model.hold()
        embedding = await store(client, NURSE)
        await busy(model)
        waiting = await store(client, FACT)
        stopping = asyncio.create_task(server.stop())
        # The stop has begun once it closes the connection; then the model is let go.
        await asyncio.wait_for(client.ws.wait_closed(), WAIT_S)
        model.release()
        await asyncio.wait_for(stopping, WAIT_S)
    # The batch in hand was finished; the memory behind it is stored, without a vector.
    assert vector_rows(path) == {embedding: 1}
    again = WatchedModel(loaded)
    async with serving(path, again) as (server, client):
        assert (await recalled(client, BY_ITS_WORDS))[:1] == [FACT]
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        assert (await recalled(client, PARAPHRASE))[:1] == [FACT]
    assert again.runs == [[FACT]]
    assert vector_rows(path) == {embedding: 1, waiting: 1}
