"""A scripted OpenAI-compatible upstream that records every request, served by real uvicorn.

Tests start it with ``async with FakeUpstream.start() as up:`` and point the gateway at
``up.base_url`` (``http://127.0.0.1:<port>/v1``). It answers ``POST /v1/chat/completions`` and
``GET /v1/models`` and records each request (method, path, headers, parsed JSON body) in
``up.requests``, so a test can assert the exact messages the gateway sent upstream (the injected
memory section, forwarded unknown fields) and the ``Authorization`` header.

Without a script every chat request gets a normal answer whose content is derived from the
request (:func:`default_content`: ``"reply to: <last user text>"``), streamed word by word when
the request asks for a stream. ``up.script(...)`` queues replies consumed one per chat request:

* :class:`Complete` — a ``chat.completion`` (content given or derived);
* :class:`Stream` — SSE chunks, optionally pausing after ``pause_after`` content chunks until the
  test sets ``resume`` (``paused`` tells it the pause was reached), and ending with ``[DONE]``
  (``end="done"``), a finish chunk but no ``[DONE]`` (``"no-done"``), a clean end of the body
  with neither (``"truncated"``), an OpenAI error event (``"error"``), a dropped connection
  (``"break"``), a malformed event (``"garbage"``) or no end at all (``"hang"``);
* :class:`Fail` — an HTTP error status with an OpenAI-shaped (or raw) body;
* :class:`Refuse` — an HTTP error with the whole error body and headers given (an OpenAI error
  with its ``code`` and ``param``, ``retry-after``, ``x-ratelimit-*``), sent byte for byte;
* :class:`Garbage` — a 200 whose body is not JSON;
* :class:`Hang` — never answers;
* :class:`Choices` — several choices (``n``), streamed with their chunks interleaved (each
  chunk one choice, by its ``index``) or whole.

Both answers report ``usage`` (word counts, unless scripted otherwise or left out with
``usage=None``); a stream does so only when the request asks (``stream_options.include_usage``),
as OpenAI does: ``"usage": null`` on each chunk, then one last chunk with no choices.

The OpenAI routes beside chat (:data:`OTHER_ROUTES`: embeddings, completions, moderations,
audio, image generation) get answers derived from the request (:func:`_route_answer`: an
embedding per input, ``completed: <prompt>`` whole or streamed, :data:`SPEECH` as audio in
pieces, ``<route> of <n> bytes`` for an upload); ``up.script_routes(...)`` queues
:class:`Fail`, :class:`Hang`, :class:`Garbage`, :class:`Cut` (a 200 that breaks off) or
:class:`Trickle` (a 200 that stops sending until the client leaves) for them, and
``up.requests_to(route)`` lists what each received.

``up.latency_s`` (0 by default) holds every chat answer that long before it starts, as a
model's time to think would: a floor under each turn's duration, for tests that bound how many
turns a client can make in a given time.

``up.refuses_stream_options`` (False by default) makes it answer any chat request carrying
``stream_options`` as older Azure OpenAI deployments do (:data:`STREAM_OPTIONS_REFUSAL`), before
the script is consulted.

``Stream.closed`` and ``Hang.closed`` are set when the client goes away before the reply was
finished: the proof a test needs that a disconnect cancelled the upstream request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from tests.support.fake_responses import RESPONSES_PATH, FakeResponses
from tests.support.uvicorn_server import serve_app

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_WORDS = re.compile(r"\s*\S+\s*")
_JSON = [(b"content-type", b"application/json")]


def last_user_text(body: Any) -> str:
    """The text of the last ``user`` message of a chat request body (content parts joined)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text" and "text" in p
                )
            return ""
    return ""


def default_content(body: Any) -> str:
    """What the fake answers when no content was scripted: tells turns apart by their text."""
    return f"reply to: {last_user_text(body)}"


def split_words(text: str) -> list[str]:
    """Word-sized pieces that join back to ``text`` exactly."""
    return _WORDS.findall(text) or ([text] if text else [])


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any  # the parsed JSON body, or None when there was none or it was not JSON
    raw_body: bytes
    client_port: int | None = None  # the same port twice = a reused keep-alive connection
    # time.monotonic() when it was recorded: how long a client waited between two tries.
    received: float = field(default_factory=time.monotonic)

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


@dataclass
class Reply:
    """Base of the scripted replies; ``arrived`` is set when the request reached the fake."""

    arrived: asyncio.Event = field(default_factory=asyncio.Event, kw_only=True)


# A reply's usage: word counts of the request and the reply ("words"), these numbers, or none.
Usage = dict[str, Any] | Literal["words"] | None


@dataclass
class Complete(Reply):
    content: str | None = None  # None = default_content(request)
    finish_reason: str = "stop"
    message: dict[str, Any] | None = None  # the whole message instead (tool calls…)
    usage: Usage = "words"


@dataclass
class Fail(Reply):
    status: int = 500
    message: str = "the fake upstream failed on purpose"
    raw: bytes | None = None  # sent instead of the OpenAI-shaped error body


@dataclass
class Refuse(Reply):
    """An HTTP error answered exactly as given: ``body`` (a JSON value, encoded once, or bytes
    sent as they are) and ``headers`` beside its content type."""

    status: int = 400
    body: Any = None
    headers: Sequence[tuple[str, str]] = ()
    content_type: str = "application/json"

    @property
    def raw(self) -> bytes:
        """The body's bytes as sent."""
        return self.body if isinstance(self.body, bytes) else orjson.dumps(self.body)


def openai_error(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI error body with all four of its members."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# What an older Azure OpenAI deployment answers a request carrying stream_options.
STREAM_OPTIONS_REFUSAL = openai_error(
    "Unrecognized request argument supplied: stream_options", "invalid_request_error"
)


@dataclass
class Garbage(Reply):
    body: bytes = b"<html>definitely not json</html>"


@dataclass
class Hang(Reply):
    """Never answers; ``closed`` is set when the client gives up on the request."""

    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Stream(Reply):
    pieces: Sequence[str] | None = None  # None = default_content(request) split into words
    pause_after: int | None = None  # pause once this many content chunks were sent
    end: Literal["done", "no-done", "truncated", "error", "break", "garbage", "hang"] = "done"
    comment: bool = False  # start with an SSE comment line, as some servers do
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    sent: list[dict[str, Any]] = field(default_factory=list)  # the chunks sent so far
    deltas: Sequence[dict[str, Any]] | None = None  # raw deltas instead of content pieces
    # Sent as OpenAI does when the request asks (stream_options.include_usage): "usage": null
    # on every chunk, then a last chunk with no choices and the usage.
    usage: Usage = "words"


class FakeUpstream:
    """The fake upstream; use :meth:`start` to run it."""

    def __init__(
        self, *, api_key: str | None = None, models: Sequence[str] = ("fake-model",)
    ) -> None:
        self.api_key = api_key
        self.models = list(models)
        self.requests: list[RecordedRequest] = []
        self.base_url = ""
        self.latency_s = 0.0
        self.refuses_stream_options = False
        self._script: deque[Reply] = deque()
        self._route_script: deque[Reply] = deque()
        self._recorded = asyncio.Condition()
        # POST /v1/responses (its own script: tests.support.fake_responses).
        self.responses = FakeResponses()

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls, *, api_key: str | None = None, models: Sequence[str] = ("fake-model",)
    ) -> AsyncIterator[FakeUpstream]:
        """Serve a fake on ``127.0.0.1`` port 0; ``api_key`` set = other bearers get 401."""
        fake = cls(api_key=api_key, models=models)
        async with serve_app(fake) as url:
            fake.base_url = f"{url}/v1"
            yield fake

    def script(self, *replies: Reply) -> None:
        """Queue replies for the next chat requests, in order."""
        self._script.extend(replies)

    def script_routes(self, *replies: Reply) -> None:
        """Queue replies for the next requests to the routes beside chat (OTHER_ROUTES), in
        order: :class:`Fail`, :class:`Hang`, :class:`Garbage`, or :class:`Complete` for the
        route's normal answer."""
        self._route_script.extend(replies)

    def requests_to(self, route: str) -> list[RecordedRequest]:
        """The requests to ``/v1/<route>``."""
        return [r for r in self.requests if r.path == f"/v1/{route}"]

    async def _other_route(self, request: RecordedRequest, receive: Receive, send: Send) -> None:
        reply = self._route_script.popleft() if self._route_script else Complete()
        reply.arrived.set()
        if isinstance(reply, Complete):
            await _route_answer(request, receive, send)
        elif isinstance(reply, Cut):
            await _cut(reply, send)
        elif isinstance(reply, Trickle):
            await _trickle(reply, receive, send)
        else:
            await _answer(reply, {}, receive, send)

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    @property
    def responses_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == RESPONSES_PATH]

    @property
    def last_body(self) -> Any:
        """The JSON body of the last chat request."""
        return self.chat_requests[-1].body

    async def wait_requests(self, count: int, timeout_s: float = 5.0) -> list[RecordedRequest]:
        """Wait until at least ``count`` requests were recorded."""
        async with self._recorded:
            await asyncio.wait_for(
                self._recorded.wait_for(lambda: len(self.requests) >= count), timeout_s
            )
        return list(self.requests)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        raw = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            body: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        request = RecordedRequest(
            method=scope["method"],
            path=scope["path"],
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]},
            body=body,
            raw_body=bytes(raw),
            client_port=scope["client"][1] if scope.get("client") else None,
        )
        async with self._recorded:
            self.requests.append(request)
            self._recorded.notify_all()

        if self.api_key is not None and request.authorization != f"Bearer {self.api_key}":
            await _send_json(send, 401, _error("Incorrect API key provided", "invalid_api_key"))
            return
        if request.method == "GET" and request.path == "/v1/models":
            data = [
                {"id": m, "object": "model", "created": 1700000000, "owned_by": "fake"}
                for m in self.models
            ]
            await _send_json(send, 200, {"object": "list", "data": data})
            return
        if request.method == "POST" and request.path == RESPONSES_PATH:
            await self.responses.answer(body, receive, send)
        if request.method == "POST" and request.path in OTHER_ROUTES:
            await self._other_route(request, receive, send)
            return
        if request.method != "POST" or request.path != "/v1/chat/completions":
            await _send_json(send, 404, _error("no such route"))
            return
        if not isinstance(body, dict):
            await _send_json(send, 400, _error("body must be a JSON object"))
            return

        if self.refuses_stream_options and "stream_options" in body:
            await _refuse(Refuse(400, STREAM_OPTIONS_REFUSAL), send)
            return
        if self._script:
            reply = self._script.popleft()
        else:
            reply = Stream() if body.get("stream") is True else Complete()
        reply.arrived.set()
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        await _answer(reply, body, receive, send)


async def _answer(reply: Reply, body: dict[str, Any], receive: Receive, send: Send) -> None:
    if isinstance(reply, Complete):
        await _send_json(send, 200, _completion(reply, body))
    elif isinstance(reply, Stream):
        await _stream(reply, body, receive, send)
    elif isinstance(reply, Fail):
        if reply.raw is not None:
            await _send(send, reply.status, [(b"content-type", b"text/plain")], reply.raw)
        else:
            await _send_json(send, reply.status, _error(reply.message, type_="server_error"))
    elif isinstance(reply, Refuse):
        await _refuse(reply, send)
    elif isinstance(reply, Garbage):
        await _send(send, 200, [(b"content-type", b"text/html")], reply.body)
    elif isinstance(reply, Hang):
        await _until_disconnect(receive)
        reply.closed.set()
    elif isinstance(reply, Choices):
        await _choices(reply, body, send)
    else:
        raise TypeError(f"unknown scripted reply {reply!r}")


def _usage(usage: Usage, body: dict[str, Any], content: str) -> dict[str, Any] | None:
    if usage != "words":
        return usage
    completion_tokens = len(content.split())
    prompt_tokens = len(last_user_text(body).split())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _completion(reply: Complete, body: dict[str, Any]) -> dict[str, Any]:
    content = default_content(body) if reply.content is None else reply.content
    completion: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or "fake-model",
        "choices": [
            {
                "index": 0,
                "message": reply.message or {"role": "assistant", "content": content},
                "finish_reason": reply.finish_reason,
            }
        ],
    }
    usage = _usage(reply.usage, body, content)
    if usage is not None:
        completion["usage"] = usage
    return completion


async def _stream(reply: Stream, body: dict[str, Any], receive: Receive, send: Send) -> None:
    pieces = list(reply.pieces) if reply.pieces is not None else split_words(default_content(body))
    base = {
        "id": "chatcmpl-fake-stream",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model") or "fake-model",
    }

    options = body.get("stream_options")
    usage = _usage(reply.usage, body, "".join(pieces))
    with_usage = isinstance(options, dict) and options.get("include_usage") is True and bool(usage)
    if with_usage:
        base["usage"] = None

    async def event(delta: dict[str, Any], finish_reason: str | None = None) -> None:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        reply.sent.append(chunk)
        await send(_body(b"data: " + orjson.dumps(chunk) + b"\n\n"))

    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
    )
    disconnect = asyncio.ensure_future(_until_disconnect(receive))
    finished = False
    try:
        if reply.comment:
            await send(_body(b": keep-alive\n\n"))
        await event({"role": "assistant", "content": ""})
        for delta in reply.deltas or ():
            await event(delta)
        for index, piece in enumerate(pieces if reply.deltas is None else ()):
            if index == reply.pause_after and not await _pause(reply, disconnect):
                return
            await event({"content": piece})
        if len(pieces) == reply.pause_after and not await _pause(reply, disconnect):
            return
        if reply.end == "hang":
            await disconnect
            return
        if reply.end == "break":
            # Returning without the final body message makes uvicorn drop the connection:
            # the client sees the stream cut off mid-way.
            return
        if reply.end == "garbage":
            await send(_body(b"data: {this is not json\n\n"))
        elif reply.end == "error":
            await send(_body(b"data: " + orjson.dumps(_error("the model is overloaded")) + b"\n\n"))
        elif reply.end != "truncated":
            await event({}, "stop")
            if with_usage:
                last = {**base, "choices": [], "usage": usage}
                reply.sent.append(last)
                await send(_body(b"data: " + orjson.dumps(last) + b"\n\n"))
        if reply.end in ("no-done", "truncated"):
            # A well-formed end of the body, but without the ``[DONE]`` line.
            await send(_body(b"", more_body=False))
        else:
            await send(_body(b"data: [DONE]\n\n", more_body=False))
        finished = True
    finally:
        # uvicorn reports a disconnect once the response is complete too; only an early one
        # means the client went away.
        if disconnect.done() and not finished:
            reply.closed.set()
        disconnect.cancel()


async def _pause(reply: Stream, disconnect: asyncio.Future[None]) -> bool:
    """Hold the stream until the test resumes it; False when the client went away meanwhile."""
    reply.paused.set()
    resume: asyncio.Future[Any] = asyncio.ensure_future(reply.resume.wait())
    try:
        await asyncio.wait({resume, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        resume.cancel()
    return not disconnect.done()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _error(
    message: str, code: str | None = None, *, type_: str = "invalid_request_error"
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def _body(data: bytes, *, more_body: bool = True) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more_body}


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], data: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send(_body(data, more_body=False))


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send(send, status, _JSON, orjson.dumps(payload))


async def _refuse(reply: Refuse, send: Send) -> None:
    headers = [(b"content-type", reply.content_type.encode())]
    headers += [(name.encode(), value.encode()) for name, value in reply.headers]
    await _send(send, reply.status, headers, reply.raw)


@dataclass
class Choices(Reply):
    """An answer with one choice per text (what ``n`` asks for): streamed, each chunk carries
    one choice's next word, the choices taking turns, as OpenAI interleaves them."""

    texts: Sequence[str] = ()


async def _choices(reply: Choices, body: dict[str, Any], send: Send) -> None:
    base = {
        "id": "chatcmpl-fake-choices",
        "created": int(time.time()),
        "model": body.get("model") or "fake-model",
    }
    if body.get("stream") is not True:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
            for i, t in enumerate(reply.texts)
        ]
        await _send_json(send, 200, {**base, "object": "chat.completion", "choices": choices})
        return
    events: list[dict[str, Any]] = []
    pieces = [split_words(text) for text in reply.texts]
    for index in range(len(reply.texts)):
        events.append({"index": index, "delta": {"role": "assistant", "content": ""}})
    for step in range(max((len(p) for p in pieces), default=0)):
        for index, words in enumerate(pieces):
            if step < len(words):
                events.append({"index": index, "delta": {"content": words[step]}})
    for index in range(len(reply.texts)):
        events.append({"index": index, "delta": {}, "finish_reason": "stop"})
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for choice in events:
        chunk = {**base, "object": "chat.completion.chunk", "choices": [choice]}
        await send(_body(b"data: " + orjson.dumps(chunk) + b"\n\n"))
    await send(_body(b"data: [DONE]\n\n", more_body=False))


@dataclass
class Cut(Reply):
    """A 200 of ``content_type`` that sends ``data`` and then drops the connection."""

    content_type: bytes = b"audio/mpeg"
    data: bytes = b""


@dataclass
class Trickle(Reply):
    """A 200 of ``content_type`` that sends ``data``, then nothing more until the client goes
    away (``closed`` is set then)."""

    content_type: bytes = b"audio/mpeg"
    data: bytes = b""
    closed: asyncio.Event = field(default_factory=asyncio.Event)


async def _trickle(reply: Trickle, receive: Receive, send: Send) -> None:
    start = {"type": "http.response.start", "status": 200}
    await send({**start, "headers": [(b"content-type", reply.content_type)]})
    await send(_body(reply.data))
    await _until_disconnect(receive)
    reply.closed.set()


async def _cut(reply: Cut, send: Send) -> None:
    start = {"type": "http.response.start", "status": 200}
    await send({**start, "headers": [(b"content-type", reply.content_type)]})
    await send(_body(reply.data))
    # Returning without the final body message makes uvicorn drop the connection.


# The OpenAI routes beside chat that the fake answers (see _route_answer).
OTHER_ROUTES = frozenset(
    f"/v1/{route}"
    for route in (
        "embeddings",
        "completions",
        "moderations",
        "audio/speech",
        "audio/transcriptions",
        "audio/translations",
        "images/generations",
    )
)
# What /v1/audio/speech answers: bytes that are not text, sent in several pieces.
SPEECH = bytes(range(256)) * 1024
SPEECH_PIECE = 16 * 1024
EMBEDDING_DIMENSIONS = 4


def embedding_of(text: str) -> list[float]:
    """The fake's embedding of ``text``: a few numbers that tell texts apart."""
    return [float(len(text)), float(sum(map(ord, text)) % 997), 0.5, -0.25][:EMBEDDING_DIMENSIONS]


async def _route_answer(request: RecordedRequest, receive: Receive, send: Send) -> None:
    """The normal answer of a route beside chat, derived from the request."""
    route = request.path.removeprefix("/v1/")
    body = request.body if isinstance(request.body, dict) else {}
    model = body.get("model")
    if route == "embeddings":
        await _send_json(send, 200, _embeddings(body))
    elif route == "completions":
        if body.get("stream") is True:
            await _completion_stream(body, send)
        else:
            text = f"completed: {body.get('prompt')}"
            await _send_json(send, 200, _text_completion(model, text, body, 0, "stop"))
    elif route == "moderations":
        result = {"flagged": False, "categories": {"violence": False}, "category_scores": {}}
        payload = {"id": "modr-fake", "model": model or "omni-moderation-latest"}
        await _send_json(send, 200, {**payload, "results": [result]})
    elif route == "audio/speech":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"audio/mpeg")],
            }
        )
        for start in range(0, len(SPEECH), SPEECH_PIECE):
            await send(_body(SPEECH[start : start + SPEECH_PIECE]))
        await send(_body(b"", more_body=False))
    elif route.startswith("audio/"):
        text = f"{route.split('/')[1]} of {len(request.raw_body)} bytes"
        await _send_json(send, 200, {"text": text})
    else:
        image = {"url": f"https://images.example/{body.get('prompt', '')}.png"}
        await _send_json(send, 200, {"created": 1700000000, "data": [image]})


def _inputs(body: dict[str, Any]) -> list[str]:
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _embeddings(body: dict[str, Any]) -> dict[str, Any]:
    inputs = _inputs(body)
    data = []
    for index, text in enumerate(inputs):
        vector = embedding_of(text)
        encoded: Any = vector
        if body.get("encoding_format") == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(len(text.split()) for text in inputs)
    return {
        "object": "list",
        "data": data,
        "model": body.get("model"),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _text_completion(
    model: Any, text: str, body: dict[str, Any], completion_tokens: int, finish: str | None
) -> dict[str, Any]:
    completion: dict[str, Any] = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if finish is not None and body.get("stream") is not True:
        prompt_tokens = len(str(body.get("prompt")).split())
        completion_tokens = len(text.split())
        completion["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return completion


async def _completion_stream(body: dict[str, Any], send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    pieces = split_words(f"completed: {body.get('prompt')}")
    model = body.get("model")
    for index, piece in enumerate(pieces):
        finish = "stop" if index == len(pieces) - 1 else None
        chunk = _text_completion(model, piece, body, 0, finish)
        await send(_body(b"data: " + orjson.dumps(chunk) + b"\n\n"))
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        prompt_tokens = len(str(body.get("prompt")).split())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(pieces),
            "total_tokens": prompt_tokens + len(pieces),
        }
        last = {"id": "cmpl-fake", "object": "text_completion", "choices": [], "usage": usage}
        await send(_body(b"data: " + orjson.dumps(last) + b"\n\n"))
    await send(_body(b"data: [DONE]\n\n", more_body=False))
