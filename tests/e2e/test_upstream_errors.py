"""An upstream's errors as clients see them, end to end: the real gateway under uvicorn, the real
gRPC service, a scripted Philia and recording fake upstreams, asked through the real ``openai``
SDK (sync and async, JSON and streams, its default retries), LangChain's ``ChatOpenAI`` and
JSON-RPC.

What a user sees: an upstream's 4xx about the request reaches the SDK as the upstream said it
(``BadRequestError`` with its ``code`` and ``param``, ``RateLimitError`` with ``retry-after`` and
``x-ratelimit-*``, ``NotFoundError``), asked of the upstream once, with the gateway's memory
headers and request id beside it; an upstream's 401 or 403 is the gateway's 502 naming the
backend, never a 401 about the client's key; ``chat.send`` says the upstream's status and code in
its error's data; a backend that refuses ``stream_options`` still streams, its refusal never seen
by a client that did not send them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain_openai import ChatOpenAI

from gateway_http.upstream.backends_file import load_backends
from tests.e2e.stack import ASK_TEXT, Stack, running_stack
from tests.support.fake_upstream import (
    STREAM_OPTIONS_REFUSAL,
    FakeUpstream,
    Refuse,
    default_content,
    openai_error,
)
from tests.support.log_watch import watching

pytestmark = pytest.mark.asyncio

ASK = [{"role": "user", "content": ASK_TEXT}]
ANSWER = default_content({"messages": ASK})
MEMORIES = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83}]
CONTEXT_LENGTH = openai_error(
    "This model's maximum context length is 8192 tokens. However, your messages resulted in "
    "9120 tokens. Please reduce the length of the messages.",
    "invalid_request_error",
    "context_length_exceeded",
    "messages",
)
RATE_LIMITED = openai_error(
    "Rate limit reached for fake-model on requests per min (RPM): Limit 3, Used 3, "
    "Requested 1. Please try again in 1s.",
    "requests",
    "rate_limit_exceeded",
)
RATE_HEADERS = (
    ("retry-after", "1"),
    ("x-ratelimit-limit-requests", "3"),
    ("x-ratelimit-remaining-requests", "0"),
    ("x-ratelimit-reset-requests", "1s"),
    # The upstream's own request id: the client gets the gateway's.
    ("x-request-id", "req_upstream_0123"),
)
MODEL_NOT_FOUND = openai_error(
    "The model `fake-model` does not exist or you do not have access to it.",
    "invalid_request_error",
    "model_not_found",
)
WRONG_KEY = openai_error(
    "Incorrect API key provided: sk-proj-****wxyz. You can find your API key at "
    "https://platform.openai.com/account/api-keys.",
    "invalid_request_error",
    "invalid_api_key",
)
MODES = ["sync-json", "sync-stream", "async-json", "async-stream"]


async def ask(stack: Stack, mode: str, **options: Any) -> str:
    """One turn through the ``openai`` SDK as the stack's user (its default retries, unless
    ``max_retries`` is given): the reply's text, or the SDK's exception."""
    base_url = f"{stack.base_url}/v1"
    retries = {"max_retries": options.pop("max_retries")} if "max_retries" in options else {}
    stream = mode.endswith("stream")
    request: dict[str, Any] = {"model": "fake-model", "messages": ASK, **options}
    if mode.startswith("sync"):

        def run() -> str:
            with openai.OpenAI(base_url=base_url, api_key=stack.jwt, **retries) as client:
                if not stream:
                    reply = client.chat.completions.create(**request)
                    return reply.choices[0].message.content or ""
                chunks = client.chat.completions.create(**request, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        return await asyncio.to_thread(run)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=stack.jwt, **retries) as client:
        if not stream:
            reply = await client.chat.completions.create(**request)
            return reply.choices[0].message.content or ""
        chunks = await client.chat.completions.create(**request, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


async def usage_totals(stack: Stack) -> dict[str, Any]:
    reply = await stack.rpc("usage.summary", {})
    totals: dict[str, Any] = reply["result"]["totals"]
    return totals


@contextlib.asynccontextmanager
async def remembering(tmp_path: Path, **overrides: Any) -> AsyncIterator[Stack]:
    """The stack, with one memory to recall for every turn."""
    async with running_stack(tmp_path, **overrides) as stack:
        stack.philia.memories = list(MEMORIES)
        yield stack


def gaps(upstream: FakeUpstream) -> list[float]:
    """How long the client waited between its tries, as the upstream saw them arrive."""
    times = [request.received for request in upstream.chat_requests]
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


@pytest.mark.parametrize("mode", MODES)
async def test_a_context_length_400_is_a_bad_request_with_its_code_asked_once(
    tmp_path: Path, mode: str
) -> None:
    refusal = Refuse(400, CONTEXT_LENGTH)
    async with remembering(tmp_path) as stack:
        stack.upstream.script(refusal)
        with pytest.raises(openai.BadRequestError) as raised:
            await ask(stack, mode)
        # Not retried by the SDK (nor by the gateway): it can never succeed.
        assert len(stack.upstream.chat_requests) == 1
        # Not an answered turn: no usage.
        assert (await usage_totals(stack))["turns"] == 0

    error = raised.value
    assert (error.status_code, error.type, error.code, error.param) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
    )
    response = error.response
    assert response.content == refusal.raw
    assert response.headers["content-type"] == "application/json"
    # As on every /v1 answer: what memory did for the turn, and the request's id.
    assert response.headers["x-arona-memory"] == "enabled"
    assert response.headers["x-arona-memory-count"] == "1"
    assert response.headers["x-arona-backend"] == "upstream"
    assert response.headers["x-request-id"]


@pytest.mark.parametrize("mode", ["sync-json", "async-stream"])
async def test_a_429_is_a_rate_limit_error_with_its_headers_and_the_sdk_waits_as_told(
    tmp_path: Path, mode: str
) -> None:
    refusals = [Refuse(429, RATE_LIMITED, RATE_HEADERS) for _ in range(3)]
    async with remembering(tmp_path) as stack:
        stack.upstream.script(*refusals)
        with pytest.raises(openai.RateLimitError) as raised:
            await ask(stack, mode)
        # The SDK's two retries, each after the second retry-after asked for.
        assert len(stack.upstream.chat_requests) == 3
        assert all(gap >= 1.0 for gap in gaps(stack.upstream))

    error = raised.value
    assert (error.status_code, error.code) == (429, "rate_limit_exceeded")
    headers = error.response.headers
    assert headers["retry-after"] == "1"
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1s"
    assert headers["x-request-id"] != "req_upstream_0123"
    assert error.response.content == refusals[-1].raw


async def test_the_sdk_retries_a_429_and_gets_the_answer(tmp_path: Path) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.script(Refuse(429, RATE_LIMITED, RATE_HEADERS))
        assert await ask(stack, "async-json") == ANSWER
        assert len(stack.upstream.chat_requests) == 2
        assert gaps(stack.upstream)[0] >= 1.0
        # Only the answered try is a turn.
        assert (await usage_totals(stack))["turns"] == 1


@pytest.mark.parametrize("mode", ["async-json", "sync-stream"])
async def test_an_upstream_model_not_found_is_not_found(tmp_path: Path, mode: str) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.script(Refuse(404, MODEL_NOT_FOUND))
        with pytest.raises(openai.NotFoundError) as raised:
            await ask(stack, mode)
        assert len(stack.upstream.chat_requests) == 1
    assert (raised.value.status_code, raised.value.code) == (404, "model_not_found")


TWO_BACKENDS = """
[backends.primary]
base_url = "{a}"
models = ["fake-model"]
{a_settings}

[backends.standby]
base_url = "{b}"
models = ["fake-model"]

[fallbacks]
"fake-model" = ["standby"]
"""


@contextlib.asynccontextmanager
async def two_backends(
    tmp_path: Path, a_settings: str = ""
) -> AsyncIterator[tuple[Stack, FakeUpstream, FakeUpstream]]:
    """The gateway routing ``fake-model`` to backend ``primary``, then ``standby``."""
    async with FakeUpstream.start() as a, FakeUpstream.start() as b:
        path = tmp_path / "backends.toml"
        path.write_text(TWO_BACKENDS.format(a=a.base_url, b=b.base_url, a_settings=a_settings))
        async with remembering(tmp_path / "data", backends=load_backends(path, {})) as stack:
            yield stack, a, b


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("mode", ["async-json", "async-stream"])
async def test_an_upstream_refusing_the_gateways_key_is_a_502_naming_the_backend(
    tmp_path: Path, status: int, mode: str
) -> None:
    async with two_backends(tmp_path) as (stack, primary, standby):
        primary.script(Refuse(status, WRONG_KEY))
        with pytest.raises(openai.InternalServerError) as raised:
            await ask(stack, mode, max_retries=0)
        # Another 4xx: not asked of the fallback either.
        assert (len(primary.chat_requests), len(standby.chat_requests)) == (1, 0)

    error = raised.value
    assert error.status_code == 502
    assert error.code == "upstream_error"
    assert f"backend primary refused the gateway's credentials (HTTP {status})" in error.message
    # Nothing of what the upstream said about the operator's key.
    assert "sk-proj" not in error.response.text
    assert "invalid_api_key" not in error.response.text


async def test_chat_send_names_the_backend_that_refused_the_gateways_key(tmp_path: Path) -> None:
    async with two_backends(tmp_path) as (stack, primary, standby):
        primary.script(Refuse(401, WRONG_KEY))
        error = (await stack.turn("rpc", ASK)).body["error"]
        assert standby.chat_requests == []
    assert error["code"] == -32000
    assert error["data"] == {"code": "upstream_error", "status": 401, "backend": "primary"}
    assert error["message"].startswith("backend primary refused the gateway's credentials")


@pytest.mark.parametrize("surface", ["rpc", "rpc_ws"])
async def test_chat_send_says_the_upstreams_status_and_code(tmp_path: Path, surface: str) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.script(Refuse(400, CONTEXT_LENGTH), Refuse(429, RATE_LIMITED, RATE_HEADERS))
        too_long = (await stack.turn(surface, ASK)).body["error"]
        limited = (await stack.turn(surface, ASK)).body["error"]
        assert len(stack.upstream.chat_requests) == 2
        assert (await usage_totals(stack))["turns"] == 0

    assert too_long["code"] == limited["code"] == -32000
    assert too_long["data"] == {
        "code": "upstream_error",
        "status": 400,
        "upstream_code": "context_length_exceeded",
        "param": "messages",
        "backend": "upstream",
    }
    assert "maximum context length is 8192 tokens" in too_long["message"]
    assert limited["data"] == {
        "code": "upstream_error",
        "status": 429,
        "upstream_code": "rate_limit_exceeded",
        "retry_after": "1",
        "backend": "upstream",
    }


@pytest.mark.parametrize("mode", ["sync-stream", "async-stream"])
async def test_a_backend_refusing_stream_options_streams_without_them(
    tmp_path: Path, mode: str
) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.refuses_stream_options = True
        assert await ask(stack, mode) == ANSWER
        # Asked for the usage, refused, asked again at once without.
        first, again = stack.upstream.chat_requests
        assert first.body["stream_options"] == {"include_usage": True}
        assert "stream_options" not in again.body
        assert first.body["messages"] == again.body["messages"]

        # Remembered: the next turn goes without them straight away.
        assert await ask(stack, mode) == ANSWER
        assert len(stack.upstream.chat_requests) == 3
        assert "stream_options" not in stack.upstream.last_body

        totals = await usage_totals(stack)
    assert (totals["turns"], totals["estimated_turns"]) == (2, 2)
    assert totals["completion_tokens"] > 0


async def test_a_refused_stream_options_is_retried_before_any_byte_of_a_raw_stream(
    tmp_path: Path,
) -> None:
    with watching("gateway_http") as logs:
        async with remembering(tmp_path) as stack:
            stack.upstream.refuses_stream_options = True
            turn = await stack.turn("sse", ASK)
            assert (turn.status, turn.content) == (200, ANSWER)
            # One clean stream: chunks, then [DONE]; no error event, no usage.
            chunks = [event for event in turn.events if isinstance(event, dict)]
            assert all("error" not in chunk and "usage" not in chunk for chunk in chunks)
            assert turn.events.count("[DONE]") == 1 and turn.events[-1] == "[DONE]"
            assert len(stack.upstream.chat_requests) == 2

            # chat.send over a WebSocket streams too: straight without them.
            pushed = await stack.turn("rpc_ws", ASK)
            assert pushed.content == ANSWER
            assert len(stack.upstream.chat_requests) == 3
    # Said once, for the operator.
    [refused] = logs.matching("refused stream_options")
    assert refused.getMessage().startswith("backend upstream refused stream_options")


async def test_stream_usage_false_sends_no_stream_options(tmp_path: Path) -> None:
    async with two_backends(tmp_path, "stream_usage = false") as (stack, primary, standby):
        primary.refuses_stream_options = True
        assert await ask(stack, "async-stream") == ANSWER
        [sent] = primary.chat_requests
        assert "stream_options" not in sent.body
        assert standby.chat_requests == []
        totals = await usage_totals(stack)
    assert (totals["turns"], totals["estimated_turns"]) == (1, 1)


async def test_a_clients_own_stream_options_gets_the_backends_refusal(tmp_path: Path) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.refuses_stream_options = True
        with pytest.raises(openai.BadRequestError) as raised:
            await ask(stack, "async-stream", stream_options={"include_usage": True})
        assert len(stack.upstream.chat_requests) == 1
    assert raised.value.message.endswith("Unrecognized request argument supplied: stream_options")
    assert raised.value.response.content == Refuse(400, STREAM_OPTIONS_REFUSAL).raw


async def test_langchain_sees_the_400_as_openais_bad_request(tmp_path: Path) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.script(Refuse(400, CONTEXT_LENGTH))
        model = ChatOpenAI(model="fake-model", base_url=f"{stack.base_url}/v1", api_key=stack.jwt)
        with pytest.raises(openai.BadRequestError) as raised:
            await model.ainvoke(ASK_TEXT)
        assert len(stack.upstream.chat_requests) == 1
    assert (raised.value.code, raised.value.param) == ("context_length_exceeded", "messages")


async def test_a_4xx_body_that_is_not_json_keeps_its_status_in_openais_shape(
    tmp_path: Path,
) -> None:
    page = b"<html><body><h1>413 Request Entity Too Large</h1></body></html>"
    async with remembering(tmp_path) as stack:
        stack.upstream.script(Refuse(413, page, content_type="text/html"))
        response = await stack.http.post(
            "/v1/chat/completions", json={"model": "fake-model", "messages": ASK}
        )
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_error")
    assert error["message"] == "upstream returned HTTP 413"


@pytest.mark.parametrize("status", [402, 405, 408])
async def test_other_4xx_of_the_upstream_are_the_gateways_502(tmp_path: Path, status: int) -> None:
    async with remembering(tmp_path) as stack:
        stack.upstream.script(Refuse(status, openai_error("no", "invalid_request_error")))
        response = await stack.http.post(
            "/v1/chat/completions", json={"model": "fake-model", "messages": ASK}
        )
    assert response.status_code == 502
    assert response.json()["error"] == {
        "message": f"upstream returned HTTP {status}: no",
        "type": "upstream_error",
        "code": "upstream_error",
    }
