"""One chat turn, one trace: what the gateway exports to an OTLP/HTTP receiver.

The stack is real (uvicorn, grpc.aio, the scripted upstream, on 127.0.0.1) and the spans
reach a real OTLP/HTTP receiver (tests/support/otlp_receiver.py), which decodes them with the
official protobuf messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.e2e.stack import Stack, running_stack
from tests.support.otlp_receiver import OtlpReceiver, exported, named, traced_here

CHAT_SPAN = "POST /v1/chat/completions"


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as receiver:
        yield receiver


@pytest_asyncio.fixture
async def stack(tmp_path: Path, receiver: OtlpReceiver) -> AsyncIterator[Stack]:
    async with traced_here(receiver), running_stack(tmp_path) as stack:
        yield stack


@pytest.mark.asyncio
async def test_a_rest_turn_is_one_trace(stack: Stack, receiver: OtlpReceiver) -> None:
    turn = await stack.turn("rest", [{"role": "user", "content": "hello there"}])
    assert turn.status == 200
    await stack.drain_writebacks()
    await exported()
    [root] = named(receiver.spans, CHAT_SPAN)
    assert root.parent_id == ""
    assert root.kind == "server"
    assert root.service == "arona-gateway"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["arona.request_id"] == turn.headers["x-request-id"]
    # Every span of the turn is in its trace.
    assert {s.trace_id for s in receiver.spans} == {root.trace_id}
