"""What answers a chat turn, as the turn pipeline sees it: :class:`ChatBackend`, and the one
failure every backend reports, :class:`UpstreamError`, which says why (its ``reason``) so that
routing can tell a backend worth falling back from (:attr:`UpstreamError.retryable`), and keeps
what an upstream's HTTP error said (its status, body and the headers worth passing on) so that
one about the request can reach the client as the upstream said it
(:attr:`UpstreamError.passed_through`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson

# Why an upstream call failed (UpstreamError.reason, and a failed attempt's outcome).
UNREACHABLE = "unreachable"  # no answer began: refused, reset, unknown host, client closed
TIMEOUT = "timeout"  # nothing arrived within the backend's timeout
HTTP_ERROR = "http_error"  # an HTTP error status (``status`` says which)
BROKEN = "broken"  # the answer began, then the connection broke or the stream ended early
INVALID = "invalid"  # an answer that is not a valid reply (not JSON, an error event, ...)
REASONS = (UNREACHABLE, TIMEOUT, HTTP_ERROR, BROKEN, INVALID)

# An upstream's 4xx about the request itself (malformed, too long for the model, unknown model,
# rate-limited): the client can act on it, so it gets it as the upstream said it. Any other 4xx
# (401, 403: the operator's key; 402, 407, 405, 408...: the gateway's account with, or its way
# to, the upstream) is none of the client's doing and stays the gateway's own 502.
PASSED_THROUGH = frozenset({400, 404, 409, 413, 422, 429})
# Statuses that say the gateway's own credentials were refused.
CREDENTIALS_REFUSED = frozenset({401, 403, 407})


class UpstreamError(Exception):
    """The upstream could not answer.

    ``status`` is the upstream's HTTP status, or ``None`` when it was unreachable, timed out or
    sent something that is not a valid reply; ``reason`` is one of :data:`REASONS`.
    ``message`` is safe to show to the client. For an HTTP error, ``body`` is what the
    upstream answered (its first 64 KiB; the backend's key masked should it be in it),
    ``headers`` the few of its headers a client may use (content type, ``retry-after``,
    ``x-ratelimit-*``), and ``backend`` the name of the backend that answered.
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        reason: str | None = None,
        *,
        body: bytes = b"",
        headers: tuple[tuple[str, str], ...] = (),
        backend: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason or (HTTP_ERROR if status is not None else INVALID)
        self.body = body
        self.headers = headers
        self.backend = backend

    @property
    def passed_through(self) -> bool:
        """Whether the client gets the upstream's own answer (:data:`PASSED_THROUGH`)."""
        return self.reason == HTTP_ERROR and self.status in PASSED_THROUGH

    @property
    def credentials_refused(self) -> bool:
        """Whether the upstream refused the gateway's own key (never the client's)."""
        return self.reason == HTTP_ERROR and self.status in CREDENTIALS_REFUSED

    @functools.cached_property
    def answer(self) -> dict[str, Any] | None:
        """The upstream's error body when it is a JSON object, else None."""
        if not self.body:
            return None
        try:
            data = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None

    @property
    def error_object(self) -> dict[str, Any]:
        """The ``error`` object of an OpenAI-shaped body (``message``, ``type``, ``code``,
        ``param``); empty when there is none."""
        answer = self.answer
        error = answer.get("error") if answer is not None else None
        return error if isinstance(error, dict) else {}

    def header(self, name: str) -> str | None:
        """One of the kept headers (``name`` in lower case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def retryable(self) -> bool:
        """Whether another backend may be asked instead, provided nothing of this answer has
        reached the client: the backend could not be reached, said nothing in time, broke off
        before its first chunk, or answered 5xx or 429. Any other answer (a 4xx, an invalid
        reply, an error event) would very likely be the same elsewhere."""
        if self.reason == HTTP_ERROR:
            return self.status is not None and (self.status >= 500 or self.status == 429)
        return self.reason in (UNREACHABLE, TIMEOUT, BROKEN)


class ChatBackend(Protocol):
    """What the turn pipeline needs from whatever answers a chat turn."""

    name: str

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer ``body`` (an OpenAI chat request) with a ``chat.completion`` dict."""
        ...

    def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Yield the ``chat.completion.chunk`` dicts of a streamed answer, in order.

        The returned iterator is an async generator: close it (``contextlib.aclosing`` or
        ``aclose()``) when stopping early so the upstream request is cancelled at once.
        """
        ...

    async def models(self) -> dict[str, Any]:
        """The ``{"object": "list", "data": [...]}`` model listing."""
        ...

    async def aclose(self) -> None:
        """Release connections; the backend is unusable afterwards."""
        ...
