"""Metrics, request ids and the memory headers, end to end in one process.

``/metrics`` of the HTTP listener and of the gRPC service's own listener
(``ARONA_GRPC_METRICS_PORT``) are scraped before and after known turns and parsed with
``prometheus_client``'s own parser; every counter and histogram must have moved by exactly
what happened, and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from gateway_http.auth import mint_token
from tests.e2e.stack import ASK_TEXT, JWT_SECRET, SURFACES, Stack, running_stack
from tests.support.fake_philia import QUERY, STORE, Step
from tests.support.fake_upstream import Fail, Stream

pytestmark = pytest.mark.asyncio

MEMORIES = [
    {"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83},
    {"node_type": "episode", "text": "I live in Lyon", "score": 0.41},
]
ASK = [{"role": "user", "content": ASK_TEXT}]
# The stack's surface names -> the `surface` label.
LABEL = {"rest": "rest", "sse": "rest_stream", "rpc": "rpc", "rpc_ws": "rpc_ws"}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and sorted labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def scrape(http: httpx.AsyncClient, url: str = "/metrics") -> Samples:
    response = await http.get(url)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


async def scrape_all(stack: Stack) -> Samples:
    """The HTTP layer's and the gRPC service's samples together."""
    assert stack.grpc is not None and stack.grpc.metrics_port is not None
    own = await scrape(stack.http)
    grpc = await scrape(stack.http, f"http://127.0.0.1:{stack.grpc.metrics_port}/metrics")
    assert not set(own) & set(grpc)
    return {**own, **grpc}


def moved(before: Samples, after: Samples) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples that changed (counts and totals only: not sums of seconds, not gauges)."""
    changes = {}
    for key, value in after.items():
        name = key[0]
        if name.endswith("_sum") or name.endswith("_created") or name.endswith("_bucket"):
            continue
        if name.startswith(
            ("arona_memory_breaker_state", "arona_outbox_depth", "arona_outbox_bytes")
        ):
            continue
        delta = value - before.get(key, 0.0)
        if delta:
            changes[key] = delta
    return changes


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def turn_moves(surface: str, memory: str, outcome: str) -> dict[Any, float]:
    return {key("arona_turns_total", surface=surface, memory=memory, outcome=outcome): 1}


def answered(surface: str) -> dict[Any, float]:
    """The timings every answered turn records, and its one attempt on the upstream."""
    return {
        key("arona_turn_overhead_seconds_count", surface=surface): 1,
        key("arona_upstream_first_byte_seconds_count", surface=surface): 1,
        **attempt("answered"),
    }


def attempt(outcome: str) -> dict[Any, float]:
    return {key("arona_upstream_attempts_total", backend="upstream", outcome=outcome): 1}


def philia(method: str, outcome: str) -> dict[Any, float]:
    return {
        key("arona_philia_calls_total", method=method, outcome=outcome): 1,
        key("arona_philia_call_seconds_count", method=method): 1,
    }


def writes_back(surface: str) -> bool:
    # The REST stream writes back only with a conversation (none here).
    return surface != "sse"


@pytest.mark.parametrize("surface", SURFACES)
async def test_memory_enabled_turn_moves_exactly_its_metrics(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0) as stack:
        stack.philia.memories = list(MEMORIES)
        before = await scrape_all(stack)
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "enabled")
        await stack.drain_writebacks()
        after = await scrape_all(stack)
        label = LABEL[surface]
        expected = {
            **turn_moves(label, "enabled", "ok"),
            **answered(label),
            key("arona_recall_seconds_count", memory="enabled"): 1,
            **philia("query", "ok"),
        }
        if writes_back(surface):
            expected[key("arona_writebacks_total", outcome="stored")] = 1
            expected.update(philia("store", "ok"))
        assert moved(before, after) == expected
        # The first connection to Philia is not a reconnect.
        assert after[key("arona_philia_reconnects_total")] == 0
        assert after[key("arona_memory_breaker_state", state="closed")] == 1


@pytest.mark.parametrize("surface", SURFACES)
async def test_memory_disabled_turn_recalls_nothing(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0, memory_writeback=False) as stack:
        stack.philia.memories = list(MEMORIES)
        before = await scrape_all(stack)
        turn = await stack.turn(surface, ASK, memory=False)
        assert (turn.status, turn.memory) == (200, "disabled")
        await stack.drain_writebacks()
        after = await scrape_all(stack)
        label = LABEL[surface]
        expected = {**turn_moves(label, "disabled", "ok"), **answered(label)}
        if writes_back(surface):
            # Writeback off: the service stores nothing.
            expected[key("arona_writebacks_total", outcome="not_stored")] = 1
        assert moved(before, after) == expected


@pytest.mark.parametrize("surface", SURFACES)
async def test_memory_offline_turn_counts_the_failed_recall(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0, memory_writeback=False) as stack:
        stack.philia.script(QUERY, Step(error=(-32603, "stalled handler")))
        before = await scrape_all(stack)
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "offline")
        await stack.drain_writebacks()
        after = await scrape_all(stack)
        label = LABEL[surface]
        expected = {
            **turn_moves(label, "offline", "ok"),
            **answered(label),
            key("arona_recall_seconds_count", memory="offline"): 1,
            **philia("query", "error"),
        }
        # Writeback is off, and the service said so on its stream: no writeback was asked
        # for, so none is counted.
        assert moved(before, after) == expected


@pytest.mark.parametrize("surface", SURFACES)
async def test_upstream_error_turn_records_no_answer_timings(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0) as stack:
        stack.philia.memories = list(MEMORIES)
        stack.upstream.script(Fail(status=500))
        before = await scrape_all(stack)
        turn = await stack.turn(surface, ASK)
        if surface in ("rest", "sse"):
            assert turn.status == 502
        else:
            assert turn.body["error"]["data"]["code"] == "upstream_error"
        await stack.drain_writebacks()
        after = await scrape_all(stack)
        assert moved(before, after) == {
            **turn_moves(LABEL[surface], "enabled", "upstream_error"),
            key("arona_recall_seconds_count", memory="enabled"): 1,
            **philia("query", "ok"),
            **attempt("status_5xx"),
        }


@pytest.mark.parametrize("surface", SURFACES)
async def test_client_errors_are_counted_as_such(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0) as stack:
        before = await scrape_all(stack)
        turn = await stack.turn(surface, ASK, conversation_id="conv_that_does_not_exist")
        if surface in ("rest", "sse"):
            assert turn.status == 404
        else:
            assert turn.body["error"]["data"]["code"] == "conversation_not_found"
        after = await scrape_all(stack)
        assert moved(before, after) == turn_moves(LABEL[surface], "disabled", "client_error")


@pytest.mark.parametrize("surface", ["rpc", "rpc_ws"])
async def test_chat_send_with_invalid_params_is_a_client_error(
    tmp_path: Path, surface: str
) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0) as stack:
        before = await scrape_all(stack)
        turn = await stack.turn(surface, ASK, extra={"temperature": "hot"})
        assert turn.body["error"]["code"] == -32602
        after = await scrape_all(stack)
        assert moved(before, after) == turn_moves(surface, "disabled", "client_error")


async def test_a_stream_the_client_leaves_is_cancelled(tmp_path: Path) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0, memory_writeback=False) as stack:
        reply = Stream(pieces=["a ", "b ", "c"], pause_after=1)
        stack.upstream.script(reply)
        before = await scrape_all(stack)
        body = {"model": "m", "messages": ASK, "stream": True, "memory": False}
        async with stack.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
            await asyncio.wait_for(reply.paused.wait(), 5)
        await asyncio.wait_for(reply.closed.wait(), 5)
        cancelled = key(
            "arona_turns_total", surface="rest_stream", memory="disabled", outcome="cancelled"
        )
        # The stream's end is recorded by the server as it unwinds; nothing to await here.
        for _ in range(200):
            after = await scrape_all(stack)
            if after[cancelled]:
                break
            await asyncio.sleep(0.01)
        # The upstream request ended with the client's leaving, before the turn was recorded.
        assert moved(before, after) == {cancelled: 1, **attempt("cancelled")}


async def test_breaker_open_skips_philia_and_the_outbox_keeps_the_episode(
    tmp_path: Path,
) -> None:
    async with running_stack(
        tmp_path,
        grpc_metrics_port=0,
        memory_breaker_failures=1,
        memory_breaker_cooldown_s=600.0,
    ) as stack:
        stack.philia.script(QUERY, Step(error=(-32603, "stalled handler")))
        first = await stack.turn("rpc", ASK)
        assert first.memory == "offline"
        # The turn's writeback finds the breaker open: kept in the outbox, failed.
        await stack.drain_writebacks()
        before = await scrape_all(stack)
        assert before[key("arona_memory_breaker_state", state="open")] == 1
        assert before[key("arona_memory_breaker_state", state="closed")] == 0
        assert before[key("arona_outbox_depth")] == 1
        assert before[key("arona_writebacks_total", outcome="failed")] == 1
        second = await stack.turn("rest", ASK)
        assert second.memory == "offline"
        await stack.drain_writebacks()
        after = await scrape_all(stack)
        # No Philia call at all: the breaker answered.
        assert moved(before, after) == {
            **turn_moves("rest", "offline", "ok"),
            **answered("rest"),
            key("arona_recall_seconds_count", memory="offline"): 1,
            key("arona_writebacks_total", outcome="failed"): 1,
        }
        assert after[key("arona_outbox_depth")] == 2
        # Two episodes' bytes, each its text and fields plus a fixed overhead.
        assert after[key("arona_outbox_bytes")] > before[key("arona_outbox_bytes")] > 100
        assert after[key("arona_outbox_dropped_total")] == 0
        assert after[key("arona_outbox_dead_letters_total")] == 0


async def test_a_recall_its_caller_gives_up_on_is_a_cancelled_call(tmp_path: Path) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0, memory_writeback=False) as stack:
        assert stack.grpc is not None
        stack.philia.script(QUERY, Step(action="hang"))
        before = await scrape_all(stack)
        async with grpc.aio.insecure_channel(stack.grpc.target) as channel:
            call = pb_grpc.MemoryServiceStub(channel).Recall(pb.RecallRequest(query="which tea?"))
            await asyncio.wait_for(stack.philia.wait_frames(QUERY), 30)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        cancelled = key("arona_philia_calls_total", method="query", outcome="cancelled")
        # The service unwinds the call after the client's cancel reaches it: a bounded poll.
        for _ in range(500):
            after = await scrape_all(stack)
            if after.get(cancelled):
                break
            await asyncio.sleep(0.01)
        assert moved(before, after) == philia("query", "cancelled")


async def test_a_lost_philia_link_is_a_reconnect(tmp_path: Path) -> None:
    async with running_stack(tmp_path, grpc_metrics_port=0, memory_writeback=False) as stack:
        await stack.turn("rest", ASK)
        await stack.philia.close_connections()
        await stack.philia.wait_all_closed()
        await stack.turn("rest", ASK)
        after = await scrape_all(stack)
        assert after[key("arona_philia_reconnects_total")] == 1
        assert after[key("arona_philia_calls_total", method="query", outcome="ok")] == 2
        assert STORE not in {f.get("method") for f in stack.philia.frames}


async def test_memory_headers_on_json_and_sse_and_memory_count_on_chat_send(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        for stream in (False, True):
            body = {"model": "fake-model", "messages": ASK, "stream": stream}
            started = time.perf_counter()
            async with stack.http.stream("POST", "/v1/chat/completions", json=body) as response:
                await response.aread()
            measured_ms = (time.perf_counter() - started) * 1000
            assert response.status_code == 200
            headers = response.headers
            assert headers["X-Arona-Memory"] == "enabled"
            assert headers["X-Arona-Memory-Count"] == "2"
            recall_ms = float(headers["X-Arona-Recall-Ms"])
            overhead_ms = float(headers["X-Arona-Overhead-Ms"])
            # The gateway's own time holds the recall and is within what the client saw.
            assert 0 < recall_ms <= overhead_ms <= measured_ms
        for surface in ("rpc", "rpc_ws"):
            turn = await stack.turn(surface, ASK)
            assert turn.body["result"]["memory_count"] == 2
        # Without memory the headers say so.
        response = await stack.http.post(
            "/v1/chat/completions", json={"model": "fake-model", "messages": ASK, "memory": False}
        )
        assert response.headers["X-Arona-Memory"] == "disabled"
        assert response.headers["X-Arona-Memory-Count"] == "0"
        assert float(response.headers["X-Arona-Recall-Ms"]) == 0
        turn = await stack.turn("rpc", ASK, memory=False)
        assert turn.body["result"]["memory_count"] == 0


async def test_request_ids_on_every_rest_response(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        sent = "client-7f3a/turn.1"
        ok = await stack.http.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": ASK},
            headers={"X-Request-Id": sent},
        )
        assert ok.headers["X-Request-Id"] == sent
        # Not sane (too long, or not printable ASCII): replaced, never an error.
        bad_ids: tuple[str | bytes, ...] = ("x" * 129, "caf\u00e9".encode(), "a\tb")
        for bad in bad_ids:
            response = await stack.http.post(
                "/v1/chat/completions",
                json={"model": "fake-model", "messages": ASK},
                headers={"X-Request-Id": bad},
            )
            assert response.status_code == 200
            generated = response.headers["X-Request-Id"]
            assert len(generated) == 32 and generated.isalnum()
        generated_ids = set()
        for method, path, body in (
            ("POST", "/v1/chat/completions", b"{not json"),
            ("GET", "/v1/models", None),
            ("GET", "/healthz", None),
            ("GET", "/nowhere", None),
            ("GET", "/metrics", None),
            ("POST", "/api/rpc", b'{"jsonrpc":"2.0","id":1,"method":"memory.status"}'),
        ):
            response = await stack.http.request(method, path, content=body)
            generated_ids.add(response.headers["X-Request-Id"])
            echoed = await stack.http.request(
                method, path, content=body, headers={"X-Request-Id": f"mine{path}"}
            )
            assert echoed.headers["X-Request-Id"] == f"mine{path}"
        assert len(generated_ids) == 6


async def test_metrics_token_guards_the_exposition(tmp_path: Path) -> None:
    async with running_stack(tmp_path, metrics_token="a-metrics-token") as stack:
        refused = await stack.http.get("/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
        allowed = await stack.http.get(
            "/metrics", headers={"Authorization": "Bearer a-metrics-token"}
        )
        assert allowed.status_code == 200
        assert key("arona_turns_total", surface="rest", memory="enabled", outcome="ok") in parse(
            allowed.text
        )
        # A JWT that may read memory.status may read the metrics too (shared mode: any).
        with_jwt = await stack.http.get("/metrics", headers=stack.rpc_headers())
        assert with_jwt.status_code == 200
        wrong = await stack.http.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401


async def test_metrics_token_and_user_scope_admit_only_an_admin_jwt(tmp_path: Path) -> None:
    async with running_stack(
        tmp_path, metrics_token="a-metrics-token", memory_scope="user"
    ) as stack:
        user = await stack.http.get("/metrics", headers=stack.rpc_headers())
        assert user.status_code == 401
        admin = mint_token(JWT_SECRET, "ops", 600, admin=True)
        allowed = await stack.http.get("/metrics", headers={"Authorization": f"Bearer {admin}"})
        assert allowed.status_code == 200


async def test_metrics_off_records_and_exposes_nothing(tmp_path: Path) -> None:
    async with running_stack(tmp_path, metrics=False, grpc_metrics_port=0) as stack:
        turn = await stack.turn("rest", ASK)
        assert turn.status == 200
        assert (await stack.http.get("/metrics")).status_code == 404
        assert stack.grpc is not None and stack.grpc.metrics_port is None
