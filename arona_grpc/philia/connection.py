"""One open WebSocket to Philia (:class:`Connection`): the reader task that matches replies to
callers by id, the heartbeat of an idle link, and the abort that fails every pending caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import aiohttp

from arona_common import tracing
from arona_grpc.philia.wire import (
    CLOSE_MESSAGE_TOO_BIG,
    HEARTBEAT,
    MAX_QUOTED,
    MAX_REQUEST_BYTES,
    PhiliaError,
    PhiliaRPCError,
    PhiliaTooLarge,
    PhiliaUnavailable,
    decode,
    encode,
    not_text,
)

logger = logging.getLogger(__name__)


class PhiliaSocket(aiohttp.ClientWebSocketResponse):
    """aiohttp's client WebSocket with an abort: aiohttp only closes with a handshake."""

    def abort(self) -> None:
        """Drop the TCP connection now; a closing handshake with a silent peer would wait."""
        connection = self._response.connection
        if connection is not None and connection.transport is not None:
            connection.transport.abort()
        self._response.close()


class Connection:
    """One open WebSocket: the reader task and the callers waiting for replies."""

    def __init__(
        self,
        ws: PhiliaSocket,
        redact: Callable[[str], str],
        ids: Iterator[int],
        heartbeat_s: float | None = None,
    ) -> None:
        self.ws = ws
        self._redact = redact
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        # The size of each pending request's frame: a link the peer closes with 1009 was
        # closed over the largest.
        self._sizes: dict[str, int] = {}
        self.closed = False
        # Loop time of the last frame received: tells a dead link from a slow answer.
        self.last_frame_at = 0.0
        # The client's id counter: an id is never reused, not even on a later link, so
        # a late reply can only find its own (gone) caller. Far cheaper than a UUID.
        self._ids = ids
        self._loop = asyncio.get_running_loop()
        # Loop time of the last frame sent: the heartbeat goes out after a quiet spell.
        self.last_sent_at = self._loop.time()
        # The peer said in its handshake that a request's params may carry the caller's
        # traceparent (TRACE_CONTEXT among its capabilities).
        self.trace_context = False
        self.reader = self._loop.create_task(self._read())
        self.beater: asyncio.Task[None] | None = None
        if heartbeat_s is not None:
            self.beater = self._loop.create_task(self._beat(heartbeat_s))

    @property
    def usable(self) -> bool:
        """Open on both sides: not aborted, and the peer has not begun a close."""
        return not self.closed and not self.ws.closed

    async def request(
        self, method: str, params: Mapping[str, Any], trace: Mapping[str, str] | None = None
    ) -> Any:
        """Send one request and return its ``result``; raise on an error reply.

        ``trace`` (the caller's ``traceparent``, for a peer that said it takes one) joins the
        params unless the frame would then be over the budget.
        """
        if self.closed:
            raise PhiliaUnavailable("the Philia connection is closed")
        request_id = str(next(self._ids))
        frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        data = b""
        if trace:
            data = encode({**frame, "params": {**params, **trace}})
        if not data or len(data) > MAX_REQUEST_BYTES:
            data = encode(frame)
        if len(data) > MAX_REQUEST_BYTES:
            raise PhiliaTooLarge(
                f"{method}: a request of {len(data):,} bytes is over Philia's frame budget "
                f"({MAX_REQUEST_BYTES:,} bytes); not sent"
            )
        reply: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self.pending[request_id] = reply
        self._sizes[request_id] = len(data)
        try:
            try:
                # UTF-8 bytes sent as a text frame: no str round trip.
                await self.ws.send_frame(data, aiohttp.WSMsgType.TEXT)
            except ConnectionError:
                raise PhiliaUnavailable("Philia closed the connection") from None
            self.last_sent_at = self._loop.time()
            answer = await reply
        finally:
            # A caller that gave up (timeout, cancellation) leaves no entry behind,
            # so its late reply is skipped and can never answer another call.
            self.pending.pop(request_id, None)
            self._sizes.pop(request_id, None)
        return self._result_of(method, answer)

    def _result_of(self, method: str, answer: dict[str, Any]) -> Any:
        if "error" in answer and answer["error"] is not None:
            error = answer["error"]
            if not isinstance(error, dict):
                raise PhiliaUnavailable(f"malformed error reply to {method}")
            code = error.get("code")
            message = error.get("message")
            if isinstance(code, bool) or not isinstance(code, int):
                code = 0
            text = message if isinstance(message, str) else ""
            raise PhiliaRPCError(code, self._redact(text)[:MAX_QUOTED])
        if "result" not in answer:
            raise PhiliaUnavailable(f"malformed reply to {method}: neither result nor error")
        return answer["result"]

    async def _read(self) -> None:
        """Route replies to waiting callers until the link ends; never raises."""
        reason: PhiliaError
        try:
            clock = self._loop.time
            pending = self.pending
            text = aiohttp.WSMsgType.TEXT
            # Ends on a close frame or a closed socket (aiohttp answers pings itself).
            async for message in self.ws:
                if message.type is not text:
                    not_text(message)
                    continue
                self.last_frame_at = clock()
                frame = decode(message.data)
                request_id = frame.get("id")
                if not isinstance(request_id, str):
                    continue  # notification, greeting, heartbeat ack, broadcast
                waiter = pending.get(request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(frame)
            if self.ws.close_code == CLOSE_MESSAGE_TOO_BIG:
                self._refused_as_too_large()
                reason = PhiliaUnavailable(
                    "Philia refused another call's frame as too large (close code 1009)",
                    philia_fault=False,
                )
            else:
                reason = PhiliaUnavailable("Philia closed the connection")
        except PhiliaError as exc:
            reason = exc
        except Exception as exc:  # the link is unusable whatever went wrong
            logger.debug("Philia reader failed: %s", type(exc).__name__)
            reason = PhiliaUnavailable(f"Philia connection failed ({type(exc).__name__})")
        self.abort(reason)

    def _refused_as_too_large(self) -> None:
        """The peer closed the link with 1009 over a frame of ours: the largest pending one
        fails as too large (permanent); the others, failed by :meth:`abort`, say nothing
        about Philia's health."""
        if not self._sizes:
            return
        culprit = max(self._sizes, key=self._sizes.__getitem__)
        waiter = self.pending.pop(culprit, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(
                PhiliaTooLarge(
                    f"Philia refused a request of {self._sizes[culprit]:,} bytes as too large "
                    "(close code 1009)"
                )
            )

    async def _beat(self, every_s: float) -> None:
        """Send ``Base.Heartbeat`` whenever nothing was sent for ``every_s``, until the link
        ends (the reader notices that and aborts, which cancels this task)."""
        loop = self._loop
        while True:
            quiet_s = loop.time() - self.last_sent_at
            if quiet_s < every_s:
                await asyncio.sleep(every_s - quiet_s)
                continue
            try:
                await self.ws.send_frame(HEARTBEAT, aiohttp.WSMsgType.TEXT)
            except ConnectionError:
                return  # the link is going: the reader sees its end
            self.last_sent_at = loop.time()

    def abort(self, reason: PhiliaError) -> None:
        """Fail every pending caller and drop the transport without a closing handshake."""
        if self.closed:
            return
        self.closed = True
        waiters = list(self.pending.values())
        self.pending.clear()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(
                    PhiliaUnavailable(
                        f"connection dropped: {reason}", philia_fault=reason.philia_fault
                    )
                )
        current = asyncio.current_task()
        for task in (self.reader, self.beater):
            if task is not None and task is not current:
                task.cancel()
        # A graceful close against a silent peer would wait the whole close timeout.
        self.ws.abort()

    async def wait_stopped(self) -> None:
        """Wait for the reader (and heartbeat) task to finish after :meth:`abort`."""
        await asyncio.wait([t for t in (self.reader, self.beater) if t is not None])


def trace_params(conn: Connection) -> dict[str, str] | None:
    """The current span's ``traceparent`` (and ``tracestate``) as params, for a peer that
    takes them; None otherwise (and whenever tracing is off)."""
    if not conn.trace_context or not tracing.active():
        return None
    carrier: dict[str, str] = {}
    tracing.inject(carrier)
    return carrier
