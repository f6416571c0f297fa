"""What each backend of a route is asked for a Responses turn, carried through the router.

A backend that speaks the Responses API (an upstream whose ``api`` is ``responses``, the
default) gets the request as it is, and its answer goes to the client byte for byte: the
JSON body, or each server-sent event. Any other (``api = "chat"``, the built-in ``echo``
model) gets a text turn translated to chat completions (:mod:`.translate`); a request that
cannot be is refused when such a backend is the one to answer (:func:`responses_route`).

Each backend is wrapped (:class:`Forwarded`, :class:`Translated`) so that the turn goes
through :class:`~gateway_http.upstream.routing.Router` like a chat turn: the same fallbacks
before the first byte, attempts, metrics and spans. What they answer is an envelope
(:data:`RAW`, :data:`DATA`, and the answer's ``usage`` in chat's shape, as the meter and the
attempt's span read it): the whole response, or one event of the stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson

from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.responses.translate import (
    StreamTranslation,
    chat_body,
    chat_usage,
    response_of,
    untranslatable,
)
from gateway_http.upstream.backend import INVALID, ChatBackend, UpstreamError
from gateway_http.upstream.client import RESPONSES_API, OpenAIUpstream
from gateway_http.upstream.routing import Route, Target

# The envelope's keys: the bytes the client gets, and what they say (a `response` object or
# a stream event; None when they are not JSON).
RAW = "raw"
DATA = "data"
USAGE = "usage"
COMPLETED = "response.completed"


def speaks_responses(backend: ChatBackend) -> bool:
    """Whether ``backend`` is an upstream that serves the Responses API itself."""
    return isinstance(backend, OpenAIUpstream) and backend.api == RESPONSES_API


def responses_route(route: Route, body: dict[str, Any]) -> Route:
    """``route`` with each backend wrapped for ``body``.

    A request chat completions cannot carry is a 400 when the first backend to ask serves
    them only; a fallback of that kind is left out of the route instead (the turn fails as
    the first backend did, rather than for the fallback's sake).
    """
    targets: list[Target] = []
    problem: str | None = None
    checked = False
    for target in route:
        backend = target.backend
        if speaks_responses(backend):
            assert isinstance(backend, OpenAIUpstream)
            targets.append(Target(target.name, Forwarded(backend), target.model))
            continue
        if not checked:
            problem, checked = untranslatable(body), True
        if problem is None:
            translated = Translated(backend, target.memory_role)
            targets.append(Target(target.name, translated, target.model))
        elif not targets:
            raise GatewayError(
                ErrorKind.BAD_INPUT,
                f"the model '{body['model']}' is served by backend '{target.name}', which "
                f"serves chat completions only: {problem} cannot be translated to them "
                "(only text turns can)",
                "chat_completions_only",
            )
    return tuple(targets)


def _parsed(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _event_bytes(event: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI writes it: its type, then its JSON."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def _envelope(raw: bytes, data: Any) -> dict[str, Any]:
    """An answer (or event), with the usage a completed response reports."""
    envelope = {RAW: raw, DATA: data}
    if isinstance(data, dict):
        response = data.get("response") if data.get("type") == COMPLETED else data
        if isinstance(response, dict) and isinstance(response.get("usage"), dict):
            envelope[USAGE] = chat_usage(response["usage"])
    return envelope


class _Wrapped:
    """The parts of the chat-backend protocol a wrapper passes on."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def models(self) -> dict[str, Any]:
        raise NotImplementedError("a Responses turn never lists models")

    async def aclose(self) -> None:
        # The router owns the backend.
        return None


class Forwarded(_Wrapped):
    """An upstream that serves the Responses API: asked as it is."""

    def __init__(self, upstream: OpenAIUpstream) -> None:
        super().__init__(upstream.name)
        self._upstream = upstream

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        raw, data = await self._upstream.respond(body)
        return _envelope(raw, data)

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        events = self._upstream.respond_stream(body)
        try:
            async for raw, data in events:
                yield _envelope(raw, _parsed(data))
        finally:
            await events.aclose()


class Translated(_Wrapped):
    """A backend that serves chat completions only: a text turn translated both ways."""

    def __init__(self, backend: ChatBackend, section_role: str = "system") -> None:
        super().__init__(backend.name)
        self._backend = backend
        # The role the backend takes the memory section in (its memory_role).
        self._role = section_role

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        chat = chat_body(body, stream=False, section_role=self._role)
        completion = await self._backend.complete(chat)
        response = response_of(body, completion)
        try:
            raw = orjson.dumps(response)
        except orjson.JSONEncodeError:
            raise UpstreamError("upstream returned invalid JSON", None, INVALID) from None
        envelope = _envelope(raw, response)
        # The meter reads the chat usage as the backend reported it.
        envelope[USAGE] = completion.get("usage")
        return envelope

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        translation = StreamTranslation(body)
        chunks = self._backend.stream(chat_body(body, stream=True, section_role=self._role))
        usage: Any = None
        try:
            async for chunk in chunks:
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                for event in translation.chunk(chunk):
                    yield {RAW: _event_bytes(event), DATA: event}
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        for event in translation.end():
            envelope = {RAW: _event_bytes(event), DATA: event}
            if event["type"] == COMPLETED and usage is not None:
                envelope[USAGE] = usage
            yield envelope
