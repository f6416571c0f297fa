"""Routing models to several backends, end to end: a backends file naming two or three fake
OpenAI-compatible upstreams (real uvicorn each), the real gateway under uvicorn, the real gRPC
service and a scripted Philia.

What a client sees: its model answered by the backend that serves it (by exact name, glob or
alias, the upstream getting the rewritten name), in ``X-Arona-Backend``; a backend that is down,
answers 5xx or 429 replaced by the next one while nothing was sent to the client, never once a
stream has started, and never after another 4xx (the client gets that one as the backend said
it); 404 ``model_not_found`` for a model no backend serves; ``/v1/models``
listing what is routable; one recall per turn however many backends were asked; every attempt
counted on ``/metrics`` by backend and outcome.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_http.upstream.backends_file import load_backends
from tests.e2e.stack import ASK_TEXT, SURFACES, Stack, running_stack
from tests.support.fake_philia import QUERY
from tests.support.fake_upstream import Fail, FakeUpstream, Hang, Stream
from tests.support.log_watch import watching

pytestmark = pytest.mark.asyncio

ASK = [{"role": "user", "content": ASK_TEXT}]
MEMORIES = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83}]
SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
KEY_A = "sk-backend-a-0123456789"
KEY_B = "sk-backend-b-9876543210"

# Two providers: `a` serves GPT models by name, by glob and one alias; `b` serves Claude
# models by glob and an alias, and is gpt-4o's fallback under its own name for it.
TWO_PROVIDERS = """
[backends.a]
base_url = "{a}"
api_key_env = "ROUTING_TEST_KEY_A"
models = ["gpt-4o", "gpt-*"]
aliases = {{ fast = "gpt-4o-mini" }}

[backends.b]
base_url = "{b}"
api_key_env = "ROUTING_TEST_KEY_B"
models = ["claude-*"]
aliases = {{ sonnet = "claude-3-5-sonnet-20241022", "gpt-4o" = "openai/gpt-4o" }}

[fallbacks]
"gpt-4o" = ["b"]
"""


@dataclass
class Routed:
    stack: Stack
    a: FakeUpstream
    b: FakeUpstream

    async def chat(self, surface: str, model: str, **extra: Any) -> Any:
        return await self.stack.turn(surface, ASK, extra={"model": model, **extra})


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    # Bound but never listening: connecting is refused, and no other test can take the port.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def routed_stack(
    tmp_path: Path, text: str = TWO_PROVIDERS, *, a_url: str | None = None, **urls: str
) -> AsyncIterator[Routed]:
    """Two fake upstreams and the gateway routing to them through ``text`` (a backends file
    whose ``{a}`` and ``{b}`` are their URLs; ``a_url`` replaces a's, other ``urls`` fill
    further placeholders)."""
    async with (
        FakeUpstream.start(api_key=KEY_A) as a,
        FakeUpstream.start(api_key=KEY_B) as b,
    ):
        path = tmp_path / "backends.toml"
        path.write_text(text.format(a=a_url or a.base_url, b=b.base_url, **urls))
        env = {"ROUTING_TEST_KEY_A": KEY_A, "ROUTING_TEST_KEY_B": KEY_B}
        backends = load_backends(path, env)
        async with running_stack(tmp_path / "data", backends=backends) as stack:
            stack.philia.memories = list(MEMORIES)
            yield Routed(stack, a, b)


def backend_of(turn: Any) -> str | None:
    """The backend a turn says answered it: the header on REST, the result on chat.send."""
    if turn.headers is not None:
        return turn.headers.get("x-arona-backend")
    result = turn.body.get("result") if isinstance(turn.body, dict) else None
    return result.get("backend") if isinstance(result, dict) else None


@pytest.mark.parametrize(
    ("model", "backend", "sent"),
    [
        ("gpt-4o", "a", "gpt-4o"),  # exact name
        ("gpt-3.5-turbo", "a", "gpt-3.5-turbo"),  # glob
        ("fast", "a", "gpt-4o-mini"),  # alias: the upstream gets the name it knows
        ("claude-3-haiku", "b", "claude-3-haiku"),  # glob on the second backend
        ("sonnet", "b", "claude-3-5-sonnet-20241022"),  # alias on the second backend
    ],
)
async def test_a_model_goes_to_the_backend_that_serves_it_under_its_name(
    tmp_path: Path, model: str, backend: str, sent: str
) -> None:
    async with routed_stack(tmp_path) as routed:
        for surface in SURFACES:
            turn = await routed.chat(surface, model)
            assert (turn.status, turn.content) == (200, "reply to: what tea do I like?"), surface
            assert backend_of(turn) == backend, surface
        chosen, other = (routed.a, routed.b) if backend == "a" else (routed.b, routed.a)
        assert [r.body["model"] for r in chosen.chat_requests] == [sent] * len(SURFACES)
        assert other.chat_requests == []
        # Each backend got its own key, and the memory section like any upstream.
        assert {r.authorization for r in chosen.chat_requests} == {
            f"Bearer {KEY_A if backend == 'a' else KEY_B}"
        }
        assert chosen.last_body["messages"][0] == {"role": "system", "content": SECTION}


async def test_without_a_backends_file_the_one_upstream_answers_as_before(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        for surface in SURFACES:
            turn = await stack.turn(surface, ASK, extra={"model": "any-model-at-all"})
            assert turn.status == 200
            assert backend_of(turn) == "upstream"
        assert {r.body["model"] for r in stack.upstream.chat_requests} == {"any-model-at-all"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_refused_connection_falls_back_to_the_next_backend(
    tmp_path: Path, stream: bool
) -> None:
    with refused_port() as port, watching("gateway_http") as logs:
        async with routed_stack(tmp_path, a_url=f"http://127.0.0.1:{port}/v1") as routed:
            turn = await routed.chat("sse" if stream else "rest", "gpt-4o")
            assert (turn.status, turn.content) == (200, "reply to: what tea do I like?")
            assert backend_of(turn) == "b"
            # b serves gpt-4o under its own name for it.
            assert routed.b.last_body["model"] == "openai/gpt-4o"
    [fell_back] = logs.matching("trying backend b")
    assert "backend a failed for model gpt-4o (unreachable)" in fell_back.getMessage()
    [answered] = logs.matching("answered by backend")
    assert answered.getMessage().startswith(
        "model gpt-4o answered by backend b as openai/gpt-4o (2 attempts"
    )


@pytest.mark.parametrize("status", [500, 503, 429])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_5xx_and_429_fall_back_before_anything_reached_the_client(
    tmp_path: Path, status: int, stream: bool
) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script(Fail(status, "busy"))
        turn = await routed.chat("sse" if stream else "rest", "gpt-4o")
        assert (turn.status, turn.content) == (200, "reply to: what tea do I like?")
        assert backend_of(turn) == "b"
        assert len(routed.a.chat_requests) == len(routed.b.chat_requests) == 1
        if stream:
            # The client's stream is b's alone: no error event, one [DONE].
            assert not any(isinstance(e, dict) and "error" in e for e in turn.events)
            assert turn.events.count("[DONE]") == 1


# a also serves gpt-4o as `omni`; a Claude model falls back to a's gpt-4o.
ALIASES_FALL_BACK = (
    TWO_PROVIDERS.replace(
        'aliases = {{ fast = "gpt-4o-mini" }}',
        'aliases = {{ fast = "gpt-4o-mini", omni = "gpt-4o" }}',
    )
    + '"claude-*" = [{{ backend = "a", model = "gpt-4o" }}]\n'
)


@pytest.mark.parametrize(
    ("alias", "named", "standing_in", "sent"),
    [
        # gpt-4o's own key names b, which b serves under its own name for it.
        ("omni", "gpt-4o", "b", "openai/gpt-4o"),
        # Asked as sonnet, sent as claude-3-5-sonnet-20241022: the "claude-*" key.
        ("sonnet", "claude-3-5-sonnet-20241022", "a", "gpt-4o"),
    ],
)
async def test_an_alias_falls_back_as_the_model_it_names(
    tmp_path: Path, alias: str, named: str, standing_in: str, sent: str
) -> None:
    with watching("gateway_http") as logs:
        async with routed_stack(tmp_path, ALIASES_FALL_BACK) as routed:
            down, up = (routed.b, routed.a) if standing_in == "a" else (routed.a, routed.b)
            for surface in SURFACES:
                down.script(Fail(503, "overloaded"))
                turn = await routed.chat(surface, alias)
                assert (turn.status, turn.content) == (200, "reply to: what tea do I like?"), (
                    surface
                )
                assert backend_of(turn) == standing_in, surface
            # The alias's backend was asked for the model it names, then the fallback for
            # that model as it serves it: the same turn as asking for the model itself.
            assert [r.body["model"] for r in down.chat_requests] == [named] * len(SURFACES)
            assert [r.body["model"] for r in up.chat_requests] == [sent] * len(SURFACES)
    answered = [record.getMessage() for record in logs.matching("answered by backend")]
    assert len(answered) == len(SURFACES)
    assert all(
        line.startswith(f"model {alias} answered by backend {standing_in} as {sent} (2 attempts")
        for line in answered
    )


@pytest.mark.parametrize("surface", ["rest", "sse", "rpc"])
async def test_a_4xx_is_not_retried_elsewhere(tmp_path: Path, surface: str) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script(Fail(400, "context length exceeded"))
        turn = await routed.chat(surface, "gpt-4o")
        if surface == "rpc":
            error = turn.body["error"]
            assert error["code"] == -32000
            assert error["data"] == {"code": "upstream_error", "status": 400, "backend": "a"}
        else:
            # a's own answer, from a.
            assert turn.status == 400
            assert turn.body["error"]["message"] == "context length exceeded"
            assert turn.headers is not None and turn.headers["x-arona-backend"] == "a"
        assert routed.b.chat_requests == []


async def test_when_every_backend_is_rate_limited_the_client_gets_the_last_429(
    tmp_path: Path,
) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script(Fail(429, "a is busy"))
        routed.b.script(Fail(429, "b is busy"))
        client = openai.AsyncOpenAI(
            base_url=f"{routed.stack.base_url}/v1", api_key="unused", max_retries=0
        )
        async with client:
            with pytest.raises(openai.RateLimitError) as raised:
                await client.chat.completions.create(model="gpt-4o", messages=ASK)  # type: ignore[arg-type]
        assert len(routed.a.chat_requests) == len(routed.b.chat_requests) == 1
    assert raised.value.body == {"message": "b is busy", "type": "server_error", "code": None}
    assert raised.value.response.headers["x-arona-backend"] == "b"


async def test_a_backend_that_says_nothing_in_time_is_replaced(tmp_path: Path) -> None:
    a_times_out = '"ROUTING_TEST_KEY_A"\ntimeout_s = 0.5'
    text = TWO_PROVIDERS.replace('"ROUTING_TEST_KEY_A"', a_times_out, 1)
    async with routed_stack(tmp_path, text) as routed:
        hang = Hang()
        routed.a.script(hang)
        turn = await routed.chat("rest", "gpt-4o")
        assert (turn.status, backend_of(turn)) == (200, "b")
        # The first request was given up, not left running.
        await hang.closed.wait()


async def test_when_every_backend_fails_the_client_gets_the_last_error(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script(Fail(500, "a is down"))
        routed.b.script(Fail(503, "b is down too"))
        turn = await routed.chat("rest", "gpt-4o")
        assert turn.status == 502
        assert turn.body["error"]["message"] == "upstream returned HTTP 503: b is down too"
        assert len(routed.a.chat_requests) == len(routed.b.chat_requests) == 1


async def test_a_stream_that_started_is_never_replayed(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        # One chunk of content, then the connection drops.
        routed.a.script(Stream(pieces=["The first words"], end="break"))
        turn = await routed.chat("sse", "gpt-4o")
        assert turn.status == 200
        assert backend_of(turn) == "a"
        # What a sent, then the error event and the end: nothing of b's.
        assert turn.content == "The first words"
        assert turn.events[-1] == "[DONE]"
        error = turn.events[-2]
        assert error["error"]["code"] == "upstream_error"
        assert routed.b.chat_requests == []


async def test_a_websocket_chat_send_is_not_replayed_either(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script(Stream(pieces=["partial"], end="break"))
        turn = await routed.chat("rpc_ws", "gpt-4o")
        tokens = [e["params"]["token"] for e in turn.events if e.get("method") == "chat.stream"]
        assert tokens == ["partial"]
        assert turn.body["error"]["data"] == {"code": "upstream_error"}
        assert routed.b.chat_requests == []


@pytest.mark.parametrize("surface", SURFACES)
async def test_an_unknown_model_is_404_model_not_found_before_recall(
    tmp_path: Path, surface: str
) -> None:
    async with routed_stack(tmp_path) as routed:
        conversation = await routed.stack.create_conversation(surface)
        turn = await routed.stack.turn(
            surface, ASK, extra={"model": "llama-9000"}, conversation_id=conversation
        )
        if surface.startswith("rpc"):
            error = turn.body["error"]
            assert (error["code"], error["data"]) == (-32000, {"code": "model_not_found"})
        else:
            assert turn.status == 404
            assert turn.headers is not None and turn.headers["X-Arona-Memory"] == "disabled"
            assert turn.body == {
                "error": {
                    "message": "The model 'llama-9000' does not exist or no backend serves it",
                    "type": "invalid_request_error",
                    "code": "model_not_found",
                }
            }
        assert routed.a.chat_requests == routed.b.chat_requests == []
        # Refused before anything else: no recall, nothing added to the conversation.
        assert routed.stack.philia.frames_of(QUERY) == []
        stored = await routed.stack.app.state.gateway.conversations.messages(conversation)
        assert stored == []


async def test_v1_models_lists_names_and_aliases_not_globs(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        response = await routed.stack.http.get("/v1/models")
        assert response.status_code == 200
        listed = [(m["id"], m["owned_by"]) for m in response.json()["data"]]
        assert listed == [("gpt-4o", "a"), ("fast", "a"), ("sonnet", "b")]
        # The openai SDK reads it, and every listed model answers.
        client = openai.AsyncOpenAI(base_url=f"{routed.stack.base_url}/v1", api_key="unused")
        try:
            ids = [model.id async for model in client.models.list()]
            for model in ids:
                reply = await client.chat.completions.create(model=model, messages=ASK)
                assert reply.choices[0].message.content == "reply to: what tea do I like?"
        finally:
            await client.close()
        # Listing asks no upstream.
        assert not [r for r in routed.a.requests + routed.b.requests if r.method == "GET"]


THREE_DEEP = (
    TWO_PROVIDERS.replace('"gpt-4o" = ["b"]', '"gpt-4o" = ["c", "b"]')
    + """
[backends.c]
base_url = "{c}"
aliases = {{ "gpt-4o" = "gpt-4o-on-c" }}
"""
)


@pytest.mark.parametrize("surface", SURFACES)
async def test_recall_runs_once_per_turn_however_many_backends_are_asked(
    tmp_path: Path, surface: str
) -> None:
    async with (
        FakeUpstream.start() as c,
        routed_stack(tmp_path, THREE_DEEP, c=c.base_url) as routed,
    ):
        routed.a.script(Fail(502, "bad gateway"))
        c.script(Fail(429, "slow down"))
        turn = await routed.chat(surface, "gpt-4o")
        assert (turn.status, turn.content) == (200, "reply to: what tea do I like?")
        assert turn.memory == "enabled"
        assert backend_of(turn) == "b"
        # One recall, and each backend got the same injected section.
        assert len(routed.stack.philia.frames_of(QUERY)) == 1
        for upstream in (routed.a, c, routed.b):
            [request] = upstream.chat_requests
            assert request.body["messages"][0] == {"role": "system", "content": SECTION}
        sent = [r.body["model"] for r in (*routed.a.chat_requests, *c.chat_requests)]
        assert sent == ["gpt-4o", "gpt-4o-on-c"]
        assert routed.b.last_body["model"] == "openai/gpt-4o"


def attempts_on_metrics(text: str) -> dict[tuple[str, str], float]:
    """``arona_upstream_attempts_total`` of an exposition, by (backend, outcome)."""
    return {
        (sample.labels["backend"], sample.labels["outcome"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "arona_upstream_attempts_total"
    }


async def test_metrics_count_every_attempt_by_backend_and_outcome(tmp_path: Path) -> None:
    # gpt-4o: a (refused), then c, then b.
    with refused_port() as port:
        async with (
            FakeUpstream.start() as c,
            routed_stack(
                tmp_path, THREE_DEEP, a_url=f"http://127.0.0.1:{port}/v1", c=c.base_url
            ) as routed,
        ):
            c.script(Fail(500, "c is down"))
            first = await routed.chat("rest", "gpt-4o")
            c.script(Fail(429, "slow down"))
            second = await routed.chat("sse", "gpt-4o")
            third = await routed.chat("rpc", "gpt-4o")
            assert [backend_of(turn) for turn in (first, second, third)] == ["b", "b", "c"]
            response = await routed.stack.http.get("/metrics")
            assert response.status_code == 200
    # Each fallback shows as a failed attempt on one backend beside an answer on the next; no
    # model or principal in the labels.
    assert attempts_on_metrics(response.text) == {
        ("a", "connect_error"): 3,
        ("c", "status_5xx"): 1,
        ("c", "status_429"): 1,
        ("c", "answered"): 1,
        ("b", "answered"): 2,
    }
