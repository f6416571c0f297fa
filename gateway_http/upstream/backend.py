"""What answers a chat turn, as the turn pipeline sees it: :class:`ChatBackend`, and the one
failure every backend reports, :class:`UpstreamError`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol


class UpstreamError(Exception):
    """The upstream could not answer.

    ``status`` is the upstream's HTTP status, or ``None`` when it was unreachable, timed out or
    sent something that is not a valid reply. ``message`` is safe to show to the client.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


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
