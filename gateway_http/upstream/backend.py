"""What answers a chat turn, as the turn pipeline sees it: :class:`ChatBackend`, and the one
failure every backend reports, :class:`UpstreamError`, which says why (its ``reason``) so that
routing can tell a backend worth falling back from (:attr:`UpstreamError.retryable`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

# Why an upstream call failed (UpstreamError.reason, and a failed attempt's outcome).
UNREACHABLE = "unreachable"  # no answer began: refused, reset, unknown host, client closed
TIMEOUT = "timeout"  # nothing arrived within the backend's timeout
HTTP_ERROR = "http_error"  # an HTTP error status (``status`` says which)
BROKEN = "broken"  # the answer began, then the connection broke or the stream ended early
INVALID = "invalid"  # an answer that is not a valid reply (not JSON, an error event, ...)
REASONS = (UNREACHABLE, TIMEOUT, HTTP_ERROR, BROKEN, INVALID)


class UpstreamError(Exception):
    """The upstream could not answer.

    ``status`` is the upstream's HTTP status, or ``None`` when it was unreachable, timed out or
    sent something that is not a valid reply; ``reason`` is one of :data:`REASONS`.
    ``message`` is safe to show to the client.
    """

    def __init__(self, message: str, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason or (HTTP_ERROR if status is not None else INVALID)

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
