"""The HTTP edge: what a connection may send before the app sees a request, and how slowly.

uvicorn's httptools protocol buffers a request head of any size (an 8 MB header was
answered 200), waits for ever for a head or a body that stalls, keeps a connection that
never sends a request open for ever, and takes WebSocket messages of up to 16 MiB before
the app can look at them. :class:`EdgeProtocol` is that protocol with limits, each
enforced before the data is buffered:

- **the header block** (request line and headers) is counted as it arrives; past
  ``ARONA_HTTP_MAX_HEADER_BYTES`` the request is answered 431 and nothing more is parsed;
- **the head** must arrive whole within ``ARONA_HTTP_HEADER_TIMEOUT_S`` of its first byte,
  **the body** within ``ARONA_HTTP_BODY_TIMEOUT_S`` of the head (a total, so a client
  trickling a byte a second gains nothing); otherwise 408;
- **an idle connection**, one that has never sent a request included, is closed after
  ``ARONA_HTTP_KEEPALIVE_S``.

The body's size (``ARONA_HTTP_MAX_BODY_BYTES``, ``ARONA_RPC_MAX_BODY_BYTES`` for JSON-RPC) is
enforced by the routes while they read it (:mod:`gateway_http.bodies`); uvicorn stops reading
the socket while a body waits unread, so nothing piles up. A WebSocket message (JSON-RPC's) is
held to ``ARONA_RPC_MAX_BODY_BYTES``, given to uvicorn's WebSocket protocol (``ws_max_size``),
which refuses a larger frame from its header, before its payload is read and before the app
(and so authentication) runs: close code 1009.
:class:`EdgeWebSocketProtocol` lets go of what the refusal kept: the parser's exception held
the last piece of the frame read (about 1 MiB) in a reference cycle until the cycle
collector came by, so ten refused sockets grew the process by 11 MiB.

A refusal is an OpenAI-shaped error from the one error table, sent with ``Connection:
close`` (and, to a request under ``/v1`` as far as its target arrived, ``X-Arona-Memory:
disabled``, as every REST answer has); the connection then reads and discards for a moment
before closing, so a client still sending its request reads the answer instead of a reset.
"""

from __future__ import annotations

import asyncio
import http
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from arona_grpc.config import Settings
from gateway_http.errors import MEMORY_HEADER, NO_RECALL, ErrorKind, GatewayError, is_rest

# How long a refused connection keeps reading (and discarding) before it closes.
LINGER_S = 2.0


@dataclass(frozen=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_s: float

    @classmethod
    def of(cls, settings: Settings) -> EdgeLimits:
        return cls(
            max_header_bytes=settings.http_max_header_bytes,
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            keepalive_s=settings.http_keepalive_s,
        )


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The ``uvicorn.Config`` options that put the gateway's limits on its HTTP listener."""
    limits = EdgeLimits.of(settings)
    protocol = type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})
    return {
        "http": protocol,
        "ws": EdgeWebSocketProtocol,
        "ws_max_size": settings.rpc_max_body_bytes,
        # EdgeProtocol keeps its own (fractional) idle timeout; this is uvicorn's copy.
        "timeout_keep_alive": max(1, math.ceil(settings.http_keepalive_s)),
    }


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (set by :func:`uvicorn_options`)."""

    limits: ClassVar[EdgeLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive: float = self.limits.keepalive_s  # type: ignore[assignment]
        # Bytes of the current request head received so far; None once the head is complete.
        self._head_bytes: int | None = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        # Refused: what still arrives is read and dropped until the connection closes.
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its idle timer only once a response is complete; a connection that
        # never sends a request is idle too.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._head_bytes is not None:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room:
                # Parse what fits: the head may end within it (and a body follow).
                part, data = data[:room], data[room:]
                self._head_bytes += len(part)
                if part:
                    super().data_received(part)
                if self.transport.is_closing() or self.transport.get_protocol() is not self:
                    return  # a parse error answered, or upgraded to a WebSocket
                if self._head_bytes is not None:
                    self._refuse(
                        ErrorKind.HEADERS_TOO_LARGE,
                        "the request's header block is larger than "
                        f"{self.limits.max_header_bytes} bytes",
                        "request_header_too_large",
                    )
                    return
            else:
                self._head_bytes += len(data)
        super().data_received(data)

    # Parser callbacks (httptools calls them from data_received).

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        if not (self.parser.should_upgrade() and self._should_upgrade()):
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._head_bytes = 0

    # Refusals.

    def _head_late(self) -> None:
        self._head_timer = None
        self._refuse(
            ErrorKind.REQUEST_TIMEOUT,
            f"the request's head did not arrive within {self.limits.header_timeout_s:g} s",
            "request_timeout",
        )

    def _body_late(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            # Answered already (without reading the whole body): stop once the answer is out.
            if cycle.response_complete:
                self.transport.close()
            else:
                cycle.keep_alive = False
            return
        self._refuse(
            ErrorKind.REQUEST_TIMEOUT,
            f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
            "request_timeout",
        )

    def _refuse(self, kind: ErrorKind, message: str, code: str) -> None:
        """Answer ``kind`` and close, or, while an earlier response is still being sent,
        close once it is out; what arrives meanwhile is dropped."""
        self._refused = True
        self._cancel_timers()
        self.flow.resume_reading()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or cycle.scope is not self.scope:
                # An earlier request's answer is on its way: let it finish, then close.
                cycle.keep_alive = False
                return
            # This request's app is still reading its body: it hears the client left, and
            # whatever it would send is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        error = GatewayError(kind, message, code)
        status = error.mapping.http_status
        body = orjson.dumps(error.openai_body())
        # The request target as far as it arrived (gathered by on_url, set from the first
        # request on).
        url: bytes = getattr(self, "url", b"")
        target = url.partition(b"?")[0].decode("latin-1")
        memory = f"{MEMORY_HEADER.lower()}: {NO_RECALL}\r\n" if is_rest(target) else ""
        head = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            f"{memory}connection: close\r\n\r\n"
        ).encode("latin-1")
        self.transport.write(head + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None


class EdgeWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, letting go of a refused frame at once."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        failure = self.conn.parser_exc
        if failure is not None:
            # Its traceback's frames hold the data being parsed, and the protocol (which
            # holds the exception): a cycle only the cycle collector would free.
            failure.__traceback__ = None
