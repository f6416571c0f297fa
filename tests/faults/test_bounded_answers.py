"""Bounded answers: a small request cannot make the gateway build a huge one.

A batch of 200 ``memory.status`` calls (16.5 KB) once came back as 300 MB, because recall
events kept whole questions and batches had no item limit. Over the real stack: a batch over
``ARONA_RPC_MAX_BATCH`` is one ``-32600``, a batch at the limit is answered whole, and after
turns asking 900,000-character questions every status detail is a few hundred characters, so
the largest batch of the largest status answers stays within a few megabytes.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from websockets.asyncio.client import connect

from arona_grpc.config import DEFAULT_RPC_MAX_BATCH, DEFAULT_STATUS_DETAIL_CHARS
from arona_grpc.service import EVENT_BUFFER_SIZE
from tests.e2e.stack import Stack, running_stack

pytestmark = pytest.mark.asyncio

# The shortening marker ("[… 123,456 characters omitted …]") on top of the detail's characters.
MARKER_CHARS = 40
# One status event's JSON beyond its detail: kind, at, scope_id and punctuation.
EVENT_OVERHEAD_BYTES = 200


def status_batch(count: int) -> bytes:
    return orjson.dumps(
        [
            {"jsonrpc": "2.0", "id": i, "method": "memory.status", "params": {"limit": 100}}
            for i in range(count)
        ]
    )


async def post_rpc(stack: Stack, body: bytes) -> bytes:
    response = await stack.http.post(
        "/api/rpc",
        content=body,
        headers={**stack.rpc_headers(), "Content-Type": "application/json"},
    )
    assert response.status_code == 200
    return response.content


async def test_a_batch_over_the_limit_is_one_invalid_request_and_at_the_limit_is_answered(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack:
        refused = orjson.loads(await post_rpc(stack, status_batch(200)))
        assert refused["id"] is None
        assert refused["error"]["code"] == -32600
        assert f"at most {DEFAULT_RPC_MAX_BATCH} calls" in refused["error"]["message"]

        answered = orjson.loads(await post_rpc(stack, status_batch(DEFAULT_RPC_MAX_BATCH)))
        assert [a["id"] for a in answered] == list(range(DEFAULT_RPC_MAX_BATCH))
        assert all("events" in a["result"] for a in answered)

        url = stack.base_url.replace("http://", "ws://") + f"/api/rpc?token={stack.jwt}"
        async with connect(url, proxy=None) as ws:
            await ws.send(status_batch(DEFAULT_RPC_MAX_BATCH + 1).decode())
            over_ws = orjson.loads(await ws.recv())
        assert over_ws["error"]["code"] == -32600


async def test_status_details_are_short_and_the_largest_batch_of_them_is_bounded(
    tmp_path: Path,
) -> None:
    question = "Which tea do I like? " + "padding " * 112_500  # 900,021 characters
    async with running_stack(tmp_path) as stack:
        for _ in range(3):
            turn = await stack.turn("rest", [{"role": "user", "content": question}])
            assert turn.status == 200
        # Make the event buffer full: each turn records a recall (and a writeback).
        for _ in range(EVENT_BUFFER_SIZE):
            assert (await stack.turn("rest", [{"role": "user", "content": "tea?"}])).status == 200
        for _ in range(3):
            assert (await stack.turn("rest", [{"role": "user", "content": question}])).status == 200
        await stack.drain_writebacks()

        status = (await stack.rpc("memory.status", {"limit": 100}))["result"]
        details = [event["detail"] for event in status["events"]]
        recalls = [e["detail"] for e in status["events"] if e["kind"] == "recall"]
        assert len(details) == EVENT_BUFFER_SIZE
        assert max(len(d) for d in details) <= DEFAULT_STATUS_DETAIL_CHARS + MARKER_CHARS
        # A long question is shown shortened, with a marker saying so.
        assert any("characters omitted" in d for d in recalls)

        largest = await post_rpc(stack, status_batch(DEFAULT_RPC_MAX_BATCH))
        per_event = DEFAULT_STATUS_DETAIL_CHARS + MARKER_CHARS + EVENT_OVERHEAD_BYTES
        assert len(largest) < DEFAULT_RPC_MAX_BATCH * EVENT_BUFFER_SIZE * per_event
