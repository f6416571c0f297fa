"""One chat turn, one trace: what the gateway exports to an OTLP/HTTP receiver.

The stack is real (uvicorn, grpc.aio, the embedded memory store, the scripted upstream, on
127.0.0.1) and the spans reach a real OTLP/HTTP receiver (tests/support/otlp_receiver.py),
which decodes them with the official protobuf messages. In-process tests share one tracer
provider for the gateway, the gRPC service and the store, as ``arona-gateway up`` does; the
last test runs ``serve`` and ``store`` as processes, each exporting on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from arona_store.server import StoreServer
from tests.e2e.stack import JWT_SECRET, PHILIA_TOKEN, Stack, running_stack
from tests.e2e.test_routing import KEY_A, KEY_B, routed_stack
from tests.support.fake_upstream import Fail
from tests.support.otlp_receiver import (
    OtlpReceiver,
    ReceivedSpan,
    exported,
    named,
    traced_here,
)
from tests.support.served import gateway_env

pytestmark = pytest.mark.asyncio

CHAT_SPAN = "POST /v1/chat/completions"
RECALL = "arona.memory.v1.MemoryService/Recall"
WRITEBACK = "arona.memory.v1.MemoryService/Writeback"
FACT = "I prefer oolong tea"
QUESTION = "Which tea do I prefer?"
# A client's own trace, continued by the gateway.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
GRPC_TOKEN = "grpc-service-token-0123456789"

# What a memory turn is made of, each span with its kind.
RECALL_TREE = """\
  arona.memory.v1.MemoryService/Recall [client]
    arona.memory.v1.MemoryService/Recall [server]
      Sync.MemoryQueryRequest [client]
        Sync.MemoryQueryRequest [server]
          memory.retrieve [internal]
          memory.rank [internal]"""
WRITEBACK_TREE = """\
  arona.memory.v1.MemoryService/Writeback [client]
    arona.memory.v1.MemoryService/Writeback [server]
      Sync.MemoryStoreRequest [client]
        Sync.MemoryStoreRequest [server]"""


def with_kind(span: ReceivedSpan) -> str:
    return f"{span.name} [{span.kind}]"


def turn_roots(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.name in (CHAT_SPAN, "chat.send")]


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as receiver:
        yield receiver


@contextlib.asynccontextmanager
async def memory_stack(tmp_path: Path, **overrides: Any) -> AsyncIterator[Stack]:
    """The stack on the embedded store (lexical ranking), which continues the traces."""
    store = await StoreServer.start(
        db_path=tmp_path / "memory.db", token=PHILIA_TOKEN, ranking="lexical", port=0
    )
    try:
        async with running_stack(
            tmp_path / "gateway", memory_url=f"ws://127.0.0.1:{store.port}/ws", **overrides
        ) as stack:
            yield stack
    finally:
        await store.stop()


@pytest_asyncio.fixture
async def stack(tmp_path: Path, receiver: OtlpReceiver) -> AsyncIterator[Stack]:
    async with traced_here(receiver), memory_stack(tmp_path) as stack:
        yield stack


async def remembered(stack: Stack, surface: str = "rest") -> None:
    """A turn that states the fact, written back: the next question recalls it."""
    told = await stack.turn(surface, [{"role": "user", "content": FACT}])
    assert told.status == 200
    await stack.drain_writebacks()


async def test_a_rest_turn_is_one_trace_from_the_gateway_to_the_store_and_the_upstream(
    stack: Stack, receiver: OtlpReceiver
) -> None:
    await remembered(stack)
    asked = await stack.turn("rest", [{"role": "user", "content": QUESTION}])
    assert (asked.status, asked.memory) == (200, "enabled")
    await stack.drain_writebacks()
    await exported()

    first, second = named(receiver.spans, CHAT_SPAN)
    assert first.trace_id != second.trace_id
    assert receiver.tree(second.trace_id, show=with_kind) == "\n".join(
        [
            "POST /v1/chat/completions [server]",
            RECALL_TREE,
            "  chat fake-model [client]",
            WRITEBACK_TREE,
        ]
    )
    assert second.parent_id == ""
    assert second.attributes == {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "http.response.status_code": 200,
        "arona.request_id": asked.headers["x-request-id"] if asked.headers else None,
        "arona.surface": "rest",
        "arona.outcome": "ok",
        "arona.memory": "enabled",
        "arona.memory.count": 1,
        "arona.upstream.attempts": 1,
        "gen_ai.request.model": "fake-model",
        "arona.backend": "upstream",
    }
    spans = receiver.trace(second.trace_id)
    [attempt] = named(spans, "chat fake-model")
    assert attempt.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "upstream",
        "gen_ai.request.model": "fake-model",
        # The fake upstream counts words: the question, and "reply to: " the question.
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 7,
        "gen_ai.response.finish_reasons": ("stop",),
        "arona.upstream.attempt": 1,
        "arona.upstream.outcome": "answered",
    }
    [store_query] = [s for s in named(spans, "Sync.MemoryQueryRequest") if s.kind == "server"]
    assert store_query.attributes["arona.store.hits"] == 1
    [retrieve] = named(spans, "memory.retrieve")
    assert retrieve.scope == "arona_store"
    assert retrieve.attributes["arona.store.ranking"] == "lexical"
    [client_query] = [s for s in named(spans, "Sync.MemoryQueryRequest") if s.kind == "client"]
    assert client_query.attributes["server.address"] == "127.0.0.1"
    [recall_server] = [s for s in named(spans, RECALL) if s.kind == "server"]
    assert recall_server.scope == "arona_grpc"
    assert recall_server.attributes["arona.memory.state"] == "enabled"
    # The writeback ends after the answer: a child of the turn that also links to it.
    [writeback] = [s for s in named(spans, WRITEBACK) if s.kind == "client"]
    assert writeback.links == ((second.trace_id, second.span_id),)
    assert writeback.end_ns > second.end_ns
    assert writeback.attributes["arona.writeback.taken"] is True
    assert not any(s.failed for s in spans)


@pytest.mark.parametrize(
    ("surface", "root", "writes_back"),
    [("sse", CHAT_SPAN, False), ("rpc", "chat.send", True), ("rpc_ws", "chat.send", True)],
)
async def test_every_chat_surface_makes_the_same_trace(
    stack: Stack, receiver: OtlpReceiver, surface: str, root: str, writes_back: bool
) -> None:
    await remembered(stack, surface="rpc")
    asked = await stack.turn(surface, [{"role": "user", "content": QUESTION}])
    assert (asked.status, asked.memory) == (200, "enabled")
    await stack.drain_writebacks()
    await exported()

    turn = named(receiver.spans, root)[-1]
    assert turn.kind == "server"
    assert turn.attributes["arona.surface"] == {"sse": "rest_stream"}.get(surface, surface)
    expected = [f"{root} [server]", RECALL_TREE, "  chat fake-model [client]"]
    if writes_back:
        expected.append(WRITEBACK_TREE)
    assert receiver.tree(turn.trace_id, show=with_kind) == "\n".join(expected)
    [attempt] = named(receiver.trace(turn.trace_id), "chat fake-model")
    assert attempt.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    if surface == "sse":
        # A stream's span lasts to its end and marks its first chunk.
        assert attempt.events == ("first chunk",)
        # The client did not ask for usage; the gateway asked for the meter, and says it.
        assert attempt.attributes["gen_ai.usage.output_tokens"] == 7


async def test_on_unary_grpc_calls_the_trace_crosses_the_same_way(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    # ARONA_GRPC_STREAMS=0: the recall and the writeback are unary calls, the trace context
    # their metadata (as an internal service calling Recall would send it).
    async with traced_here(receiver), memory_stack(tmp_path, grpc_streams=0) as stack:
        await remembered(stack)
        asked = await stack.turn("rest", [{"role": "user", "content": QUESTION}])
        assert (asked.status, asked.memory) == (200, "enabled")
        await stack.drain_writebacks()
        await exported()
    turn = named(receiver.spans, CHAT_SPAN)[-1]
    assert receiver.tree(turn.trace_id, show=with_kind) == "\n".join(
        [CHAT_SPAN + " [server]", RECALL_TREE, "  chat fake-model [client]", WRITEBACK_TREE]
    )


@pytest.mark.parametrize("surface", ["rest", "sse", "rpc"])
async def test_an_incoming_traceparent_is_continued_and_carried_upstream(
    stack: Stack, receiver: OtlpReceiver, surface: str
) -> None:
    stack.http.headers["traceparent"] = TRACEPARENT
    asked = await stack.turn(surface, [{"role": "user", "content": QUESTION}])
    assert asked.status == 200
    await stack.drain_writebacks()
    await exported()

    [turn] = turn_roots(receiver.spans)
    assert (turn.trace_id, turn.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert {s.trace_id for s in receiver.spans} == {CLIENT_TRACE}
    # The upstream request carries the trace too, as the child of the attempt's span.
    [attempt] = named(receiver.spans, "chat fake-model")
    [request] = stack.upstream.chat_requests
    assert request.headers["traceparent"] == f"00-{CLIENT_TRACE}-{attempt.span_id}-01"


async def test_a_traceparent_that_is_not_one_starts_a_trace_of_its_own(
    stack: Stack, receiver: OtlpReceiver
) -> None:
    stack.http.headers["traceparent"] = "00-not-a-trace-01"
    asked = await stack.turn("rest", [{"role": "user", "content": QUESTION}])
    assert asked.status == 200
    await exported()
    [turn] = turn_roots(receiver.spans)
    assert turn.parent_id == ""
    assert turn.trace_id != CLIENT_TRACE


@pytest.mark.parametrize("surface", ["rest", "sse"])
async def test_a_fallback_shows_both_attempts(
    tmp_path: Path, receiver: OtlpReceiver, surface: str
) -> None:
    async with traced_here(receiver), routed_stack(tmp_path) as routed:
        routed.a.script(Fail(503, "a is overloaded"))
        turn = await routed.chat(surface, "gpt-4o")
        assert turn.status == 200
        await routed.stack.drain_writebacks()
        await exported()

    [root] = turn_roots(receiver.spans)
    spans = receiver.trace(root.trace_id)
    failed, answered = named(spans, "chat gpt-4o") + named(spans, "chat openai/gpt-4o")
    assert (failed.parent_id, answered.parent_id) == (root.span_id, root.span_id)
    assert failed.failed
    assert failed.attributes["gen_ai.system"] == "a"
    assert failed.attributes["arona.upstream.attempt"] == 1
    assert failed.attributes["arona.upstream.outcome"] == "status_5xx"
    assert failed.attributes["error.type"] == "status_5xx"
    assert failed.attributes["http.response.status_code"] == 503
    assert not answered.failed
    assert answered.attributes["gen_ai.system"] == "b"
    assert answered.attributes["gen_ai.request.model"] == "openai/gpt-4o"
    assert answered.attributes["arona.upstream.attempt"] == 2
    assert answered.attributes["arona.upstream.outcome"] == "answered"
    assert root.attributes["arona.backend"] == "b"
    assert root.attributes["arona.upstream.attempts"] == 2


async def test_the_export_holds_no_user_text_no_memory_and_no_secret(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    async with traced_here(receiver), memory_stack(tmp_path, grpc_token=GRPC_TOKEN) as stack:
        await remembered(stack)
        for surface in ("rest", "sse", "rpc", "rpc_ws"):
            asked = await stack.turn(surface, [{"role": "user", "content": QUESTION}])
            assert (asked.status, asked.memory) == (200, "enabled"), surface
        await stack.drain_writebacks()
        await exported()
        jwt = stack.jwt

    assert len(turn_roots(receiver.spans)) == 5
    # The store's part of each turn is in the export searched below.
    assert len(named(receiver.spans, "memory.retrieve")) == 5
    export = b"".join(receiver.bodies)
    for secret in (
        # What the user said, what the store remembers of it, and the answer.
        "oolong",
        "prefer",
        "reply to",
        # The memory token (on the store's upgrade URL and in its handshake), the gRPC
        # service's token, the JWT and its secret.
        PHILIA_TOKEN,
        "token=",
        GRPC_TOKEN,
        jwt,
        JWT_SECRET,
    ):
        assert secret.encode() not in export, secret


async def test_a_backends_api_key_never_reaches_the_export(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    async with traced_here(receiver), routed_stack(tmp_path) as routed:
        routed.a.script(Fail(503, "a is overloaded"))
        assert (await routed.chat("rest", "gpt-4o")).status == 200
        assert (await routed.chat("rest", "claude-3-haiku")).status == 200
        await exported()
    export = b"".join(receiver.bodies)
    assert len(turn_roots(receiver.spans)) == 2
    for secret in (KEY_A, KEY_B, "overloaded"):
        assert secret.encode() not in export, secret


async def test_without_tracing_nothing_is_sent_and_no_traceparent_goes_upstream(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    async with memory_stack(tmp_path) as stack:
        stack.http.headers["traceparent"] = TRACEPARENT
        asked = await stack.turn("rest", [{"role": "user", "content": QUESTION}])
        assert asked.status == 200
        [request] = stack.upstream.chat_requests
        assert "traceparent" not in request.headers
    assert receiver.bodies == []


async def _until(pattern: str, stream: asyncio.StreamReader, seen: list[str]) -> re.Match[str]:
    while True:
        raw = await asyncio.wait_for(stream.readline(), 60)
        assert raw, "the process stopped:\n" + "\n".join(seen)
        seen.append(raw.decode().rstrip())
        found = re.search(pattern, seen[-1])
        if found:
            return found


async def test_serve_and_store_each_export_their_part_of_the_trace_and_flush_when_they_stop(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        # Batches wait for the stop: only the flush on the way out sends these spans.
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
    }
    command = str(Path(sys.executable).parent / "arona-gateway")
    store_env = gateway_env(tmp_path / "store", {**otel, "ARONA_MEMORY_TOKEN": PHILIA_TOKEN})
    store = await asyncio.create_subprocess_exec(
        command, "store", "--port", "0", env=store_env, stdout=asyncio.subprocess.PIPE
    )
    assert store.stdout is not None
    store_lines: list[str] = []
    gateway: asyncio.subprocess.Process | None = None
    try:
        found = await _until(r"(ws://127\.0\.0\.1:\d+/ws)", store.stdout, store_lines)
        gateway_env_ = gateway_env(
            tmp_path / "gateway",
            {**otel, "ARONA_MEMORY_URL": found.group(1), "ARONA_MEMORY_TOKEN": PHILIA_TOKEN},
        )
        gateway = await asyncio.create_subprocess_exec(
            command, "serve", env=gateway_env_, stderr=asyncio.subprocess.PIPE
        )
        assert gateway.stderr is not None
        lines: list[str] = []
        url = (await _until(r"serving on (http://[\d.:]+)", gateway.stderr, lines)).group(1)
        await _until("Application startup complete", gateway.stderr, lines)
        assert any("exporting traces to " + receiver.url + "/v1/traces" in line for line in lines)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            reply = await client.post(
                "/v1/chat/completions",
                json={"model": "echo", "messages": [{"role": "user", "content": FACT}]},
                headers={"traceparent": TRACEPARENT},
            )
            assert reply.status_code == 200
        assert receiver.spans == []
    finally:
        for process in (gateway, store):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(process.wait(), 60) == 0

    # Both flushed on the way out: the gateway's part and the store's, one trace.
    services = {(s.service, s.name) for s in receiver.spans if s.trace_id == CLIENT_TRACE}
    assert {
        ("arona-gateway", CHAT_SPAN),
        ("arona-gateway", RECALL),
        ("arona-gateway", "Sync.MemoryQueryRequest"),
        ("arona-gateway", "chat echo"),
        ("arona-gateway", WRITEBACK),
        ("arona-memory-store", "Sync.MemoryStoreRequest"),
    } <= services
    assert {s.trace_id for s in receiver.spans} == {CLIENT_TRACE}
