"""The OpenAI routes beside chat, passed through to the backend of their model: embeddings,
completions (whole and streamed), moderations, audio speech, transcriptions and translations,
image generation; and ``GET /v1/models/{id}``.

Each request is routed like a chat turn, by the model its body names (a form field for the
audio uploads), through the same :class:`~gateway_http.upstream.routing.Router`: aliases, each
backend's key and timeouts, fallbacks. The caller is the REST caller (API keys as on chat), its
monthly budget is checked before anything is sent, and an answer that reports its ``usage``
(embeddings, completions) is metered like a turn. Memory has no part in them: nothing is
recalled or written back (``X-Arona-Memory: disabled``, added by the app to every ``/v1``
answer that is not a turn's).

The answer is the backend's, as it came (:mod:`gateway_http.upstream.raw`): its status, its
content type, its body byte for byte, a stream as it arrives (the first bytes are awaited
before answering, so a backend that fails at once can still be replaced). A stream that
breaks off is ended with an ``error`` event then ``[DONE]`` when it is server-sent events, as
chat does; any other body (audio) is cut off, so the client sees an incomplete answer rather
than a short file. The ``echo`` development model answers embeddings itself
(:meth:`~gateway_http.upstream.echo.EchoModel.embeddings`) and no other of these routes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Send

from gateway_http.auth import ANONYMOUS
from gateway_http.errors import ErrorKind, GatewayError, bad_input
from gateway_http.metrics import GatewayMetrics
from gateway_http.multipart import boundary_of, find_field, replaced
from gateway_http.routes.rest import (
    BACKEND_HEADER,
    _unless_disconnected,
    read_body,
    read_json_body,
    require_json,
    rest_caller,
    rest_owner,
    upstream_failure,
)
from gateway_http.state import Gateway, gateway_of
from gateway_http.upstream.backend import UpstreamError
from gateway_http.upstream.echo import EchoModel
from gateway_http.upstream.raw import RawAnswer, RawRequest, forward
from gateway_http.upstream.routing import Route
from gateway_http.usage.meter import EndedTurn

logger = logging.getLogger(__name__)

router = APIRouter()

# A model name is routed and logged: a longer one is refused.
MAX_MODEL_CHARS = 256
# What a streamed completion's usage is looked for in: a longer event is passed on unread.
_MAX_EVENT_BYTES = 1 << 20
_JSON = "application/json"
# The longest path an unknown route's error repeats.
_MAX_SHOWN_PATH = 200
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class PassRoute:
    """One route passed through."""

    # Under /v1, here and upstream: ``embeddings``.
    path: str
    # The body is a multipart form (an upload) rather than JSON.
    form: bool = False
    # Routed as this model when the body names none (OpenAI's default for the route).
    default_model: str | None = None
    # The answer reports usage worth metering: ``embeddings`` or ``completions``.
    metered: str | None = None


ROUTES = (
    PassRoute("embeddings", metered="embeddings"),
    PassRoute("completions", metered="completions"),
    PassRoute("moderations", default_model="omni-moderation-latest"),
    PassRoute("audio/speech"),
    PassRoute("audio/transcriptions", form=True),
    PassRoute("audio/translations", form=True),
    PassRoute("images/generations", default_model="dall-e-2"),
)


@dataclass
class Asked:
    """A request read and routed, as it goes upstream."""

    request: RawRequest
    owner: str
    # The parsed JSON body (None for a form).
    body: dict[str, Any] | None
    started: float


async def _fetched(
    routed: Route, asked: Asked, metrics: GatewayMetrics
) -> tuple[RawAnswer, bytes | None]:
    """The answer, and its whole body when it is JSON or an error (None: streamed as it
    comes)."""
    answer = await forward(routed, asked.request, [], metrics)
    if answer.status >= 400 or answer.content_type.startswith(_JSON):
        return answer, await answer.body()
    return answer, None


def _echo_embeddings(gw: Gateway, asked: Asked, echo: EchoModel) -> Response:
    """The ``echo`` model's embeddings, metered like an upstream's."""
    try:
        answer = echo.embeddings(asked.body or {})
    except ValueError as exc:
        raise bad_input(str(exc)) from None
    usage = gw.usage
    if usage is not None:
        reported = {"completion_tokens": 0, **answer["usage"]}
        usage.record(_ended(asked, echo.name, asked.request.model, "embeddings", reported))
    return Response(orjson.dumps(answer), media_type=_JSON, headers={BACKEND_HEADER: echo.name})


def _model_error(message: str) -> GatewayError:
    return GatewayError(ErrorKind.BAD_INPUT, message, "invalid_request")


async def _read_json(request: Request, route: PassRoute) -> tuple[bytes, dict[str, Any], str]:
    """The raw body, its object and the model it names."""
    require_json(request)
    raw, body = await read_json_body(request)
    if not isinstance(body, dict):
        raise bad_input("the request body must be a JSON object")
    model = body.get("model")
    if model is None and route.default_model is not None:
        return raw, body, route.default_model
    if not isinstance(model, str) or not model:
        raise _model_error("'model' is required: a non-empty string")
    return raw, body, model


async def _read_form(request: Request) -> tuple[bytes, str, Callable[[str], bytes]]:
    """The raw multipart body, the model its ``model`` field names, and the body with
    another model name in that field."""
    content_type = request.headers.get("content-type", "")
    boundary = boundary_of(content_type)
    if boundary is None:
        raise GatewayError(
            ErrorKind.UNSUPPORTED_MEDIA,
            "the request body must be a form, sent with Content-Type: multipart/form-data",
            "unsupported_media_type",
        )
    raw = await read_body(request)
    field = find_field(raw, boundary, "model")
    if field is None:
        raise _model_error("the form field 'model' is required")
    try:
        model = raw[field.start : field.end].decode()
    except UnicodeDecodeError:
        raise _model_error("the form field 'model' is not UTF-8 text") from None
    if not model:
        raise _model_error("the form field 'model' is required")
    return raw, model, lambda name: replaced(raw, field, name)


async def _asked(gw: Gateway, request: Request, route: PassRoute) -> tuple[Asked, Route]:
    """The caller's request read, checked and routed, its budget checked: what goes upstream,
    and to which backends."""
    started = time.perf_counter()
    principal = rest_caller(gw, request)
    owner = principal.id if principal is not None else ANONYMOUS
    body: dict[str, Any] | None = None
    if route.form:
        raw, model, renamed = await _read_form(request)
        stream = False
    else:
        raw, body, model = await _read_json(request, route)
        named = body

        def renamed(name: str) -> bytes:
            return orjson.dumps({**named, "model": name})

        stream = body.get("stream") is True or route.path == "audio/speech"
    if len(model) > MAX_MODEL_CHARS:
        raise _model_error(f"'model' is longer than {MAX_MODEL_CHARS} characters")
    routed = gw.router.route(model)
    if routed is None:
        raise GatewayError(
            ErrorKind.NOT_FOUND,
            f"The model '{model}' does not exist or no backend serves it",
            "model_not_found",
        )
    usage = gw.usage
    if usage is not None and usage.budgets.active:
        # Before anything is sent: a refused request costs nothing.
        await usage.check(owner)
    raw_request = RawRequest(
        route.path,
        raw,
        request.headers.get("content-type", _JSON),
        model,
        renamed,
        stream=stream,
        accept=request.headers.get("accept", "*/*"),
    )
    return Asked(raw_request, owner, body, started), routed


def _handler(route: PassRoute) -> Callable[[Request], Awaitable[Response]]:
    async def passed(request: Request) -> Response:
        gw = gateway_of(request)
        asked, routed = await _asked(gw, request, route)
        echo = routed[0].backend
        if route.path == "embeddings" and isinstance(echo, EchoModel):
            return _echo_embeddings(gw, asked, echo)
        try:
            answer, content = await _unless_disconnected(
                request, _fetched(routed, asked, gw.pipeline.metrics)
            )
        except UpstreamError as exc:
            raise upstream_failure(exc) from None
        answer.headers.append((BACKEND_HEADER, answer.backend))
        if content is None:
            return _Passed(gw, route, asked, answer)
        if route.metered is not None and answer.status < 300:
            _meter(gw, route, asked, answer, _parsed(content), "")
        return _raw_response(answer.status, answer.headers, content)

    passed.__name__ = "passthrough_" + route.path.replace("/", "_")
    return passed


# Each route's handler by path: dispatched directly by gateway_http.app.GatewayApp (as chat is),
# and registered on the router too, for the app's routing table.
HANDLERS = {f"/v1/{route.path}": _handler(route) for route in ROUTES}
for _path, _passed in HANDLERS.items():
    router.add_api_route(_path, _passed, methods=["POST"])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> Response:
    """One model of the ``GET /v1/models`` listing (OpenAI's 404 for a name not in it)."""
    gw = gateway_of(request)
    rest_owner(gw, request)
    try:
        listing = await gw.router.models()
    except UpstreamError as exc:
        raise upstream_failure(exc) from None
    data = listing.get("data")
    for entry in data if isinstance(data, list) else ():
        if isinstance(entry, dict) and entry.get("id") == model_id:
            return Response(orjson.dumps(entry), media_type=_JSON)
    raise GatewayError(
        ErrorKind.NOT_FOUND,
        f"The model '{model_id[:MAX_MODEL_CHARS]}' does not exist",
        "model_not_found",
    )


def invalid_url(request: Request) -> Response:
    """OpenAI's 404 for a route under ``/v1`` that is not served (or not with that method)."""
    path = request.url.path
    if len(path) > _MAX_SHOWN_PATH:
        path = path[: _MAX_SHOWN_PATH - 1] + "…"
    error = {
        "message": f"Invalid URL ({request.method} {path})",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    return Response(orjson.dumps({"error": error}), status_code=404, media_type=_JSON)


def _raw_response(status: int, headers: list[tuple[str, str]], content: bytes) -> Response:
    response = Response(content, status_code=status)
    # As they came, the content type included (Response would add its own otherwise).
    response.raw_headers = [
        *_raw_headers(headers),
        (b"content-length", str(len(content)).encode()),
    ]
    return response


def _raw_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    # aiohttp decodes header values as UTF-8, keeping undecodable bytes as surrogates.
    return [(k.lower().encode("latin-1"), v.encode("utf-8", "surrogateescape")) for k, v in headers]


def _parsed(content: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


class _Passed(StreamingResponse):
    """A backend's answer streamed as it arrives.

    A metered route's event stream has its usage (or its text, to count) noted on the way. An
    upstream that breaks off ends an event stream with an ``error`` event and ``[DONE]``, as
    chat does; any other body is left unended, so the client sees the answer fail instead of
    taking a shortened one (a cut audio file) for whole.
    """

    def __init__(self, gw: Gateway, route: PassRoute, asked: Asked, answer: RawAnswer) -> None:
        self._gw = gw
        self._route = route
        self._asked = asked
        self._answer = answer
        self._events = answer.content_type.startswith("text/event-stream")
        super().__init__(answer.chunks(), status_code=answer.status)
        # As they came, the content type included (no charset added to it).
        self.raw_headers = _raw_headers(answer.headers)

    async def stream_response(self, send: Send) -> None:
        chunks = self.body_iterator
        assert isinstance(chunks, AsyncGenerator)
        seen = _SeenEvents() if self._events and self._route.metered is not None else None
        ended = True
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in chunks:
                if seen is not None:
                    seen.add(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            logger.warning("upstream stream on /v1/%s failed: %s", self._route.path, exc)
            seen = None
            if self._events:
                error = orjson.dumps(upstream_failure(exc).openai_body())
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + error + b"\n\n" + _DONE,
                        "more_body": True,
                    }
                )
            else:
                ended = False
        finally:
            # Closed at once when the client left: the upstream request ends too.
            await chunks.aclose()
        if ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if seen is not None:
            _meter(
                self._gw, self._route, self._asked, self._answer, {"usage": seen.usage}, seen.text
            )


class _SeenEvents:
    """What a streamed completion said, read from its events as they pass: the last
    ``usage`` object, and the text of its choices (counted when no usage comes)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._parts: list[str] = []
        self.usage: Any = None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, chunk: bytes) -> None:
        buffer = self._buffer + chunk
        *lines, rest = buffer.split(b"\n")
        # An event too long to be worth reading is passed on unread.
        self._buffer = rest if len(rest) <= _MAX_EVENT_BYTES else b""
        for line in lines:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = event.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and isinstance(choice.get("text"), str):
                    self._parts.append(choice["text"])


def _meter(
    gw: Gateway,
    route: PassRoute,
    asked: Asked,
    answer: RawAnswer,
    reply: dict[str, Any],
    streamed_text: str,
) -> None:
    """Record an answered metered request like a turn: the tokens its answer reports, or
    counted by the meter from the request's text and the reply's (marked estimated)."""
    usage = gw.usage
    if usage is None:
        return
    body = asked.body or {}
    reported = reply.get("usage")
    prompt_text = ""
    reply_text = streamed_text
    if route.metered == "embeddings":
        if isinstance(reported, dict) and "prompt_tokens" in reported:
            # An embedding has no completion: its tokens are all the input's.
            reported = {"completion_tokens": 0, **reported}
        else:
            prompt_text = _texts(body.get("input"))
    elif not _has_both(reported):
        prompt_text = _texts(body.get("prompt"))
        if not reply_text:
            reply_text = "".join(
                c["text"]
                for c in reply.get("choices") or ()
                if isinstance(c, dict) and isinstance(c.get("text"), str)
            )
    if not _has_both(reported):
        reported = None
    streamed = route.metered == "completions" and body.get("stream") is True
    surface = f"{route.metered}_stream" if streamed else str(route.metered)
    attempt = answer.attempt
    attempt.usage = reported
    prompt = [{"role": "user", "content": prompt_text}] if prompt_text else []
    usage.record(
        _ended(asked, attempt.backend, attempt.model, surface, reported, prompt, reply_text)
    )


def _ended(
    asked: Asked,
    backend: str,
    model: str,
    surface: str,
    reported: Any,
    prompt: list[Any] | None = None,
    reply: str = "",
) -> EndedTurn:
    """What the meter takes of an answered request (its prompt and reply are counted only
    when ``reported`` says nothing)."""
    user = (asked.body or {}).get("user")
    return EndedTurn(
        turn_id=os.urandom(16).hex(),
        principal=asked.owner,
        user=user if isinstance(user, str) else "",
        model=model,
        backend=backend,
        surface=surface,
        outcome="ok",
        latency_ms=(time.perf_counter() - asked.started) * 1000,
        usage=reported,
        prompt=prompt or [],
        reply=reply,
        reply_message=None,
        section="",
    )


def _has_both(usage: Any) -> bool:
    return isinstance(usage, dict) and all(
        isinstance(usage.get(key), int) for key in ("prompt_tokens", "completion_tokens")
    )


def _texts(value: Any) -> str:
    """The text of an ``input`` or ``prompt``: a string or a list of strings (token arrays are
    not text, and not counted)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(v for v in value if isinstance(v, str))
    return ""
