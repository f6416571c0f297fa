"""The Philia WebSocket JSON-RPC client: connection, handshake, id -> future, timeouts.

One :class:`PhiliaClient` owns at most one WebSocket to Philia. It connects lazily
(the first call opens the link and sends ``Sync.ConnectHandshake``), shares the link
between concurrent calls (one reader task matches replies to callers by id), and
treats any fault (refused, rejected handshake, JSON-RPC error, timeout, malformed
frame, close) as the end of that link: every pending caller fails, the transport is
aborted and the next call connects afresh. The exception is a call refused for what it
is (:attr:`PhiliaError.permanent`: a request over :data:`MAX_REQUEST_BYTES`, which is never
sent, or a ``-32600``/``-32602`` error reply): the link stays for the other callers. Should
Philia close the link with 1009 (message too big) all the same, the largest pending request
is the one refused, and the others' failure does not count against Philia
(:attr:`PhiliaError.philia_fault`). Every await on the socket runs under the
per-call deadline (``timeout_s``, or a shorter one the caller passes, e.g. the recall
budget), connect and handshake included.

A link left idle is kept open with ``Base.Heartbeat`` notifications (see :data:`HEARTBEAT_S`):
Philia closes links idle for about 45 s, and a chat whose turns come a minute apart would
otherwise pay a new connect and handshake on every turn.

A call that runs out of time drops the link only when the link looks dead (nothing
received since the call was sent): on a live link shared by concurrent calls, one slow
answer must not fail the others, and its late reply is simply skipped because no
waiter is left for its id. A link the peer has started to close (a close frame, even
with the TCP connection left open) is never reused.

The WebSocket is aiohttp's (one ``ClientSession`` per client, frames parsed in C): on the
benchmark's memory turn it cost the gateway's event loop about 0.05 ms less than the
``websockets`` client (bench/README.md). Frames are encoded and decoded with ``orjson``
(the standard ``json`` module is the fallback only for what orjson refuses but JSON
allows, such as an escaped lone surrogate), text frames are read as bytes, and request
ids come from a counter: all of that is paid on every call.

Each call is a client span (arona_grpc.tracing). A peer whose handshake result lists
:data:`TRACE_CONTEXT` among its ``capabilities`` (the embedded store) also gets the caller's
``traceparent`` in each request's params and continues the trace; the wire protocol does not
say that a Philia takes params it does not know, so any other gets exactly the params above.

The token travels on the upgrade URL and in the handshake, so nothing here ever
prints it: URLs go through :func:`~arona_grpc.redact.redact_url` and free text through
:func:`~arona_grpc.redact.redact_text`; aiohttp logs neither request lines nor frames.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import aiohttp
import orjson
import yarl
from opentelemetry.util.types import AttributeValue

from arona_grpc import tracing
from arona_grpc.metrics import PhiliaMetrics
from arona_grpc.redact import redact_text, redact_url

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Philia's frame budget is about 1 MiB; the margin keeps a reply that is just at
# the budget (plus JSON-RPC envelope) from being refused on our side.
MAX_FRAME_BYTES = 2**20 + 2**16
# The largest request frame sent: Philia's budget (the embedded store closes the link with
# 1009 on anything larger). A bigger one is refused here, before it is sent
# (arona_grpc.sizes keeps every request the service makes below it).
MAX_REQUEST_BYTES = 2**20
# WebSocket close code "message too big": the peer refused a frame of ours for its size.
CLOSE_MESSAGE_TOO_BIG = 1009
# JSON-RPC errors that refuse the call for what it is (invalid request, invalid params):
# sending it again gets the same answer, and Philia itself is well.
PERMANENT_RPC_CODES = frozenset({-32600, -32602})
QUERY_METHOD = "Sync.MemoryQueryRequest"
STORE_METHOD = "Sync.MemoryStoreRequest"
DELETE_METHOD = "Sync.MemoryDeleteRequest"
# The longest request id: ids count up from 1 and never reach 20 digits.
_LONGEST_ID = "9" * 20
# Server-supplied text quoted in our errors is cut to this length.
_MAX_QUOTED = 200
# A link on which nothing was sent for this long gets a heartbeat; Philia closes links idle
# for about 45 s (protocol/philia-wire.md).
HEARTBEAT_S = 20.0
_HEARTBEAT = b'{"jsonrpc":"2.0","method":"Base.Heartbeat"}'
# How long a closing handshake aiohttp starts itself (after a protocol error from the
# peer) waits for the peer's answer; our own faults abort instead.
_CLOSE_TIMEOUT_S = 1.0
# The ``method`` label of each call in the metrics.
_METRIC_METHODS = {
    QUERY_METHOD: "query",
    STORE_METHOD: "store",
    DELETE_METHOD: "delete",
}


# The store property carrying when an episode happened; absent means now.
OCCURRED_AT = "occurred_at"
TRACE_CONTEXT = tracing.TRACE_CONTEXT
TRACER = tracing.Tracer("arona_grpc")


def occurred_at_text(seconds: float) -> str:
    """POSIX ``seconds`` as Philia's ``occurred_at`` property: RFC 3339 UTC, whole seconds
    (the fraction is dropped), ``Z``: ``"2023-05-08T13:56:00Z"``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.floor(seconds)))


@dataclass(frozen=True)
class PhiliaMemory:
    """One recalled node, as Philia ranks it (best first)."""

    text: str
    score: float
    node_type: str
    # The node's id when the query result names it (the embedded store's do; the wire
    # protocol does not promise one): "" otherwise.
    node_id: str = ""


class PhiliaError(Exception):
    """A Philia call failed. The message never contains the token.

    ``permanent``: Philia refused the call for what it is (too large, invalid); the same
    call would be refused again, and Philia itself is well. ``philia_fault``: the failure
    says Philia is unreachable, slow or broken (what a circuit breaker counts); a call that
    failed only because another call's frame was refused is neither.
    """

    permanent = False
    philia_fault = True


class PhiliaUnavailable(PhiliaError):
    """Philia could not be reached or broke the protocol (refused, rejected, closed, garbage)."""

    def __init__(self, message: str, *, philia_fault: bool = True) -> None:
        super().__init__(message)
        self.philia_fault = philia_fault


class PhiliaTimeout(PhiliaError):
    """Philia did not answer within the per-call deadline."""


class PhiliaRPCError(PhiliaUnavailable):
    """Philia answered with a JSON-RPC error object (permanent for -32600 and -32602)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"Philia error {code}: {message}")
        self.code = code
        self.message = message
        self.permanent = code in PERMANENT_RPC_CODES
        self.philia_fault = not self.permanent


class PhiliaTooLarge(PhiliaError):
    """A request frame over Philia's budget: not sent, or refused by Philia (close 1009)."""

    permanent = True
    philia_fault = False


def build_upgrade_url(url: str, token: str) -> str:
    """The configured URL with ``token=<token>`` appended (``?`` or ``&``), URL-encoded."""
    parts = urlsplit(url)
    token_query = urlencode({"token": token}, quote_via=quote)
    query = f"{parts.query}&{token_query}" if parts.query else token_query
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


class _PhiliaSocket(aiohttp.ClientWebSocketResponse):
    """aiohttp's client WebSocket with an abort: aiohttp only closes with a handshake."""

    def abort(self) -> None:
        """Drop the TCP connection now; a closing handshake with a silent peer would wait."""
        connection = self._response.connection
        if connection is not None and connection.transport is not None:
            connection.transport.abort()
        self._response.close()


class _Connection:
    """One open WebSocket: the reader task and the callers waiting for replies."""

    def __init__(
        self,
        ws: _PhiliaSocket,
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
            data = _encode({**frame, "params": {**params, **trace}})
        if not data or len(data) > MAX_REQUEST_BYTES:
            data = _encode(frame)
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
            raise PhiliaRPCError(code, self._redact(text)[:_MAX_QUOTED])
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
                    _not_text(message)
                    continue
                self.last_frame_at = clock()
                frame = _decode(message.data)
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
                await self.ws.send_frame(_HEARTBEAT, aiohttp.WSMsgType.TEXT)
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


def request_bytes(method: str, params: Mapping[str, Any]) -> int:
    """The size of the frame a request of ``method`` with ``params`` takes at most."""
    frame = {"jsonrpc": "2.0", "id": _LONGEST_ID, "method": method, "params": params}
    return len(_encode(frame))


def _encode(frame: dict[str, Any]) -> bytes:
    """One request as UTF-8 JSON."""
    try:
        return orjson.dumps(frame)
    except TypeError:
        # orjson refuses lone surrogates in a str; json escapes them, as before.
        return json.dumps(frame).encode()


def _not_text(message: aiohttp.WSMessage) -> None:
    """A frame other than text ends the link (binary, or aiohttp's report of a broken one)."""
    if message.type is aiohttp.WSMsgType.BINARY:
        raise PhiliaUnavailable("malformed frame from Philia (binary)")
    if message.type is aiohttp.WSMsgType.ERROR:
        # aiohttp's errors may quote the peer's bytes: name the type only.
        raise PhiliaUnavailable(f"malformed frame from Philia ({type(message.data).__name__})")


def _decode(raw: bytes) -> dict[str, Any]:
    """Parse one text frame (its UTF-8 bytes); anything but a JSON object is malformed."""
    try:
        frame = orjson.loads(raw)
    except ValueError:
        # orjson refuses a few things JSON allows (an escaped lone surrogate, a number
        # too large for a double): the standard parser decides those rare frames.
        try:
            frame = json.loads(raw, parse_constant=_reject_constant)
        except ValueError:
            raise PhiliaUnavailable("malformed frame from Philia (not JSON)") from None
    if not isinstance(frame, dict):
        raise PhiliaUnavailable("malformed frame from Philia (not an object)")
    return frame


def _reject_constant(name: str) -> Any:
    # NaN / Infinity are not JSON; json.loads would otherwise accept them.
    raise ValueError(name)


class PhiliaClient:
    """Lazy, shared, self-healing JSON-RPC link to Philia."""

    def __init__(
        self,
        url: str,
        token: str,
        timeout_s: float,
        *,
        heartbeat_s: float | None = HEARTBEAT_S,
        metrics: PhiliaMetrics | None = None,
    ) -> None:
        """``heartbeat_s``: how long a link may stay quiet before a heartbeat (None: never);
        ``metrics``: where each call's method, outcome and time are recorded."""
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ValueError("heartbeat_s must be positive (or None for no heartbeats)")
        self._url = url
        self._token = token
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._secrets = _secret_forms(token)
        # Made on the first connect, inside the running loop.
        self._session: aiohttp.ClientSession | None = None
        self._conn: _Connection | None = None
        self._ids = itertools.count(1)
        self._connecting: asyncio.Task[_Connection] | None = None
        self._closed = False
        self._metrics = metrics
        self.connects = 0
        """Connections opened (handshake done) since the client was made."""
        try:
            parts = urlsplit(url)
            self._host, self._port = parts.hostname or "", parts.port
        except ValueError:
            self._host, self._port = "", None

    @property
    def redacted_url(self) -> str:
        """The configured URL, safe to print."""
        return redact_url(self._url)

    def redact(self, text: str) -> str:
        """Mask the token (raw, URL-encoded or JSON-escaped) in free text."""
        return redact_text(text, self._secrets)

    @property
    def timeout_s(self) -> float:
        """The default per-call deadline."""
        return self._timeout_s

    @property
    def pending_calls(self) -> int:
        """Callers waiting for a reply on the current link (0 when there is none)."""
        conn = self._conn
        return len(conn.pending) if conn is not None else 0

    async def query(
        self,
        query: str,
        limit: int,
        *,
        timeout_s: float | None = None,
        node_type: str | None = None,
    ) -> list[PhiliaMemory]:
        """``Sync.MemoryQueryRequest``: up to ``limit`` memories, best first.

        ``node_type`` is sent as ``node_type_filter``; without it the params are exactly
        ``query`` and ``limit``.
        """
        params: dict[str, Any] = {"query": query, "limit": limit}
        if node_type is not None:
            params["node_type_filter"] = node_type
        return await self._call(
            QUERY_METHOD,
            params,
            lambda result: _parse_memories(result, limit),
            timeout_s,
        )

    async def store(
        self,
        text: str,
        node_type: str = "episode",
        *,
        occurred_at: float | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """``Sync.MemoryStoreRequest``: store one node and return its id.

        ``occurred_at`` (POSIX seconds) goes as the ``occurred_at`` property (see
        :func:`occurred_at_text`); None sends no properties (Philia takes now).
        """
        params: dict[str, Any] = {"text": text, "node_type": node_type}
        if occurred_at is not None:
            params["properties"] = {OCCURRED_AT: occurred_at_text(occurred_at)}
        return await self._call(STORE_METHOD, params, _parse_node_id, timeout_s)

    async def delete(self, node_id: str, *, timeout_s: float | None = None) -> bool:
        """``Sync.MemoryDeleteRequest``: whether the node existed."""
        return await self._call(DELETE_METHOD, {"node_id": node_id}, _parse_deleted, timeout_s)

    async def connect(self) -> None:
        """Open the link now (connect and handshake, within the per-call timeout) unless one
        is open: how a store found down is checked without making a call."""
        if self._live_connection() is None:
            await self._join(self._connect_attempt())

    async def disconnect(self) -> None:
        """Drop the current link now (abort); the next call connects afresh."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort(PhiliaUnavailable("disconnected on request"))
            await conn.wait_stopped()

    async def aclose(self) -> None:
        """Drop the link and refuse further calls."""
        self._closed = True
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
            # A cancelled connect aborts its half-open socket before it ends.
            await asyncio.wait([connecting])
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort(PhiliaUnavailable("the Philia client is closed"))
            await conn.wait_stopped()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _call(
        self,
        method: str,
        params: Mapping[str, Any],
        parse: Callable[[Any], T],
        timeout_s: float | None,
    ) -> T:
        if not tracing.active():
            return await self._call_once(method, params, parse, timeout_s)
        with TRACER.span(method, kind=tracing.CLIENT, attributes=self._traced(method)):
            return await self._call_once(method, params, parse, timeout_s)

    def _traced(self, method: str) -> dict[str, AttributeValue]:
        """A call's span attributes: the method and where the store listens (never its URL,
        which carries the token)."""
        attributes: dict[str, AttributeValue] = {"rpc.system": "jsonrpc", "rpc.method": method}
        if self._host:
            attributes["server.address"] = self._host
        if self._port is not None:
            attributes["server.port"] = self._port
        return attributes

    async def _call_once(
        self,
        method: str,
        params: Mapping[str, Any],
        parse: Callable[[Any], T],
        timeout_s: float | None,
    ) -> T:
        deadline_s = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        conn: _Connection | None = None
        attempt: asyncio.Task[_Connection] | None = None
        loop = asyncio.get_running_loop()
        sent_at = math.inf
        # For the metrics: the loop's clock may count whole milliseconds (uvloop).
        started = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                conn = self._live_connection()
                if conn is None:
                    attempt = self._connect_attempt()
                    conn = await self._join(attempt)
                sent_at = loop.time()
                result = await conn.request(method, params, _trace_params(conn))
            parsed = parse(result)
            if self._metrics is not None:
                self._metrics.philia_call(
                    _METRIC_METHODS[method], "ok", time.perf_counter() - started
                )
            return parsed
        except TimeoutError:
            error: PhiliaError = PhiliaTimeout(
                f"{method}: no answer from Philia within {deadline_s:.3g} s"
            )
            if conn is not None and conn.usable and conn.last_frame_at > sent_at:
                # The link is alive (frames keep coming), only this answer is slow:
                # keep the link for the other callers; the late reply finds no waiter.
                conn = None
        except asyncio.CancelledError:
            # The caller stopped waiting (its own deadline, a client gone): still a call.
            if self._metrics is not None:
                self._metrics.philia_call(
                    _METRIC_METHODS[method], "cancelled", time.perf_counter() - started
                )
            raise
        except PhiliaError as exc:
            error = exc
            if exc.permanent:
                # Refused for what it is, on a link that works (or that the peer closed
                # itself, which the next call sees): nothing to drop for the other callers.
                conn = None
        if attempt is not None and not attempt.done():
            # Out of time while connecting. The attempt has run at least as long as
            # this call, so it is out of time too: end it now rather than let the next
            # call join an attempt that is about to fail.
            attempt.cancel()
            if self._connecting is attempt:
                self._connecting = None
        if conn is not None:
            self._drop(conn, error)
        if self._metrics is not None:
            outcome = "timeout" if isinstance(error, PhiliaTimeout) else "error"
            self._metrics.philia_call(
                _METRIC_METHODS[method], outcome, time.perf_counter() - started
            )
        raise error

    def _drop(self, conn: _Connection, reason: PhiliaError) -> None:
        if not conn.closed:
            logger.info("dropping the Philia connection to %s: %s", self.redacted_url, reason)
        conn.abort(reason)
        if self._conn is conn:
            self._conn = None

    def _live_connection(self) -> _Connection | None:
        if self._closed:
            raise PhiliaUnavailable("the Philia client is closed")
        conn = self._conn
        if conn is not None and not conn.usable:
            # Closed by the peer while idle (Philia closes idle links), or half-closed
            # with the TCP connection left open: never send on it.
            self._drop(conn, PhiliaUnavailable("Philia closed the connection"))
            return None
        return conn

    def _connect_attempt(self) -> asyncio.Task[_Connection]:
        """The connect in progress, or a new one: concurrent callers share one attempt."""
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
            self._connecting.add_done_callback(self._connect_done)
        return self._connecting

    async def _join(self, attempt: asyncio.Task[_Connection]) -> _Connection:
        try:
            # Shielded: one caller giving up must not cancel the others' connect.
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if attempt.cancelled() and current is not None and not current.cancelling():
                # Another waiter or aclose() ended the shared attempt, not our caller.
                raise PhiliaUnavailable("the connect attempt to Philia was abandoned") from None
            raise

    def _connect_done(self, task: asyncio.Task[_Connection]) -> None:
        if self._connecting is task:
            self._connecting = None
        if task.cancelled():
            return
        if task.exception() is None:
            self._conn = task.result()

    async def _open(self) -> _Connection:
        """Connect and handshake, bounded by one call's deadline; abort on any failure."""
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                ws = await self._upgrade()
                conn = _Connection(ws, self.redact, self._ids, self._heartbeat_s)
                result = await conn.request(
                    "Sync.ConnectHandshake",
                    {
                        "token": self._token,
                        "client_type": "cli",
                        "capabilities": [],
                        "protocol_version": 1,
                    },
                )
                _check_handshake(result, self.redact)
                conn.trace_context = _takes_trace_context(result)
        except BaseException as exc:
            if conn is not None:
                conn.abort(PhiliaUnavailable("connect failed"))
            if isinstance(exc, TimeoutError):
                raise PhiliaTimeout(
                    f"no connection to Philia at {self.redacted_url} within {self._timeout_s:g} s"
                ) from None
            if isinstance(exc, PhiliaRPCError):
                raise PhiliaUnavailable(f"Philia refused the handshake: {exc}") from None
            raise
        self.connects += 1
        logger.info("connected to Philia at %s", self.redacted_url)
        return conn

    async def _upgrade(self) -> _PhiliaSocket:
        """Open the WebSocket (bounded by the caller's deadline, see :meth:`_open`)."""
        where = self.redacted_url
        if self._session is None:
            self._session = aiohttp.ClientSession(
                ws_response_class=_PhiliaSocket,
                # No environment proxies, no cookies kept between links.
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        try:
            ws = await self._session.ws_connect(
                # Sent as built: yarl would otherwise unescape the token's "/" and "?".
                yarl.URL(build_upgrade_url(self._url, self._token), encoded=True),
                compress=0,
                max_msg_size=MAX_FRAME_BYTES,
                decode_text=False,
                autoping=True,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=_CLOSE_TIMEOUT_S),
            )
        except aiohttp.WSServerHandshakeError as exc:
            raise PhiliaUnavailable(
                f"Philia at {where} rejected the connection (HTTP {exc.status})"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            reason = self.redact(exc.strerror or type(exc).__name__)
            raise PhiliaUnavailable(f"cannot connect to Philia at {where}: {reason}") from None
        except (aiohttp.ClientError, ValueError) as exc:
            # Messages of these may quote the URL, token included: name the type only.
            raise PhiliaUnavailable(
                f"cannot connect to Philia at {where} ({type(exc).__name__})"
            ) from None
        assert isinstance(ws, _PhiliaSocket)
        return ws


def _secret_forms(token: str) -> tuple[str, ...]:
    """The token as it may appear in text: raw, URL-encoded, JSON-escaped."""
    forms = {token, quote(token, safe=""), json.dumps(token)[1:-1]}
    return tuple(sorted((f for f in forms if f), key=len, reverse=True))


def _check_handshake(result: Any, redact: Callable[[str], str]) -> None:
    if not isinstance(result, dict) or not isinstance(result.get("ok"), bool):
        raise PhiliaUnavailable("malformed handshake reply from Philia")
    if not result["ok"]:
        error = result.get("error")
        detail = redact(error)[:_MAX_QUOTED] if isinstance(error, str) and error else "no reason"
        raise PhiliaUnavailable(f"Philia refused the handshake: {detail}")


def _takes_trace_context(result: dict[str, Any]) -> bool:
    """Whether a handshake's result lists :data:`TRACE_CONTEXT` among its capabilities (the
    embedded store does; the wire protocol does not say a Philia takes params it does not
    know, so none is sent one unless it says so)."""
    capabilities = result.get("capabilities")
    return isinstance(capabilities, list) and TRACE_CONTEXT in capabilities


def _trace_params(conn: _Connection) -> dict[str, str] | None:
    """The current span's ``traceparent`` (and ``tracestate``) as params, for a peer that
    takes them; None otherwise (and whenever tracing is off)."""
    if not conn.trace_context or not tracing.active():
        return None
    carrier: dict[str, str] = {}
    tracing.inject(carrier)
    return carrier


def _parse_memories(result: Any, limit: int) -> list[PhiliaMemory]:
    results = result.get("results") if isinstance(result, dict) else None
    if not isinstance(results, list):
        raise PhiliaUnavailable("malformed query result from Philia: no results list")
    memories: list[PhiliaMemory] = []
    for item in results[:limit]:
        if not isinstance(item, dict):
            raise PhiliaUnavailable("malformed query result from Philia: a result is not an object")
        text, score, node_type = item.get("text"), item.get("score"), item.get("node_type", "")
        if (
            not isinstance(text, str)
            or not isinstance(score, int | float)
            or isinstance(score, bool)
            or not math.isfinite(score)
            or not isinstance(node_type, str)
        ):
            raise PhiliaUnavailable("malformed query result from Philia: bad text, score or type")
        node_id = item.get("node_id")
        memories.append(
            PhiliaMemory(
                text=text,
                score=float(score),
                node_type=node_type,
                # Optional, and only ever a label: anything but a string is ignored.
                node_id=node_id if isinstance(node_id, str) else "",
            )
        )
    return memories


def _parse_node_id(result: Any) -> str:
    node_id = result.get("node_id") if isinstance(result, dict) else None
    if not isinstance(node_id, str) or not node_id:
        raise PhiliaUnavailable("malformed store result from Philia: no node_id")
    return node_id


def _parse_deleted(result: Any) -> bool:
    deleted = result.get("deleted") if isinstance(result, dict) else None
    if not isinstance(deleted, bool):
        raise PhiliaUnavailable("malformed delete result from Philia: no deleted flag")
    return deleted
