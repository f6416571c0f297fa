"""The embedded store continues a caller's trace: the handshake says it may, the params carry
the ``traceparent``, and anything else there is ignored, never refused."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from websockets.asyncio.client import connect

from arona_store.server import StoreServer
from tests.support.otlp_receiver import spans_in_memory

from .conftest import TOKEN, WAIT_S, StoreClient, ws_url

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with spans_in_memory() as exporter:
        yield exporter


@pytest_asyncio.fixture(params=["sqlite", "postgres"])
async def either_client(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[StoreClient]:
    """A handshaken client of the embedded store, on SQLite or on PostgreSQL."""
    url = request.getfixturevalue("store_database_url") if request.param == "postgres" else None
    async with (
        await StoreServer.start(
            db_path=tmp_path / "store.db", token=TOKEN, database_url=url
        ) as server,
        connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws,
    ):
        client = StoreClient(ws)
        await client.handshake()
        yield client


@pytest.mark.asyncio
async def test_the_handshake_says_requests_may_carry_a_traceparent(
    raw_client: StoreClient,
) -> None:
    result = await raw_client.handshake()
    assert result["capabilities"] == ["trace_context"]


@pytest.mark.asyncio
async def test_a_query_and_a_store_continue_the_callers_trace(
    either_client: StoreClient, spans: InMemorySpanExporter
) -> None:
    client = either_client
    traceparent = f"00-{TRACE}-{CALLER}-01"
    stored = await client.request(
        "Sync.MemoryStoreRequest", {"text": "I prefer oolong tea", "traceparent": traceparent}
    )
    assert "node_id" in stored["result"]
    found = await client.request(
        "Sync.MemoryQueryRequest", {"query": "oolong tea", "limit": 5, "traceparent": traceparent}
    )
    assert [r["text"] for r in found["result"]["results"]] == ["I prefer oolong tea"]

    served = [s for s in spans.get_finished_spans() if s.name.startswith("Sync.")]
    assert [s.name for s in served] == ["Sync.MemoryStoreRequest", "Sync.MemoryQueryRequest"]
    for span in served:
        assert span.parent is not None
        assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (TRACE, CALLER)
        assert span.kind.name == "SERVER"
    query = served[1]
    assert query.attributes is not None and query.attributes["arona.store.hits"] == 1
    steps = [s for s in spans.get_finished_spans() if s.parent is not None]
    assert {s.name for s in steps if s.parent.span_id == query.context.span_id} == {
        "memory.retrieve",
        "memory.rank",
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("traceparent", [42, None, "00-garbage-01", ["00-x"]])
async def test_a_traceparent_that_is_not_one_is_ignored_and_the_call_answered(
    client: StoreClient, spans: InMemorySpanExporter, traceparent: object
) -> None:
    found = await client.request(
        "Sync.MemoryQueryRequest", {"query": "tea", "limit": 5, "traceparent": traceparent}
    )
    assert found["result"]["results"] == []
    [served] = [s for s in spans.get_finished_spans() if s.name == "Sync.MemoryQueryRequest"]
    # A trace of its own.
    assert served.parent is None
