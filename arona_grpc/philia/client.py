"""The Philia client (:class:`PhiliaClient`): the lazy, shared, self-healing link, each call under
its deadline and in its span, the connect and handshake, and the redaction of its token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import yarl
from opentelemetry.util.types import AttributeValue

from arona_common import tracing
from arona_common.redact import redact_text, redact_url
from arona_grpc.metrics import PhiliaMetrics
from arona_grpc.philia.connection import Connection, PhiliaSocket, trace_params
from arona_grpc.philia.wire import (
    CLOSE_TIMEOUT_S,
    DELETE_METHOD,
    HEARTBEAT_S,
    MAX_FRAME_BYTES,
    METRIC_METHODS,
    OCCURRED_AT,
    QUERY_METHOD,
    STORE_METHOD,
    TRACER,
    PhiliaError,
    PhiliaMemory,
    PhiliaRPCError,
    PhiliaTimeout,
    PhiliaUnavailable,
    T,
    build_upgrade_url,
    check_handshake,
    occurred_at_text,
    parse_deleted,
    parse_memories,
    parse_node_id,
    takes_trace_context,
)

logger = logging.getLogger(__name__)


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
        self._secrets = secret_forms(token)
        # Made on the first connect, inside the running loop.
        self._session: aiohttp.ClientSession | None = None
        self._conn: Connection | None = None
        self._ids = itertools.count(1)
        self._connecting: asyncio.Task[Connection] | None = None
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
            lambda result: parse_memories(result, limit),
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
        return await self._call(STORE_METHOD, params, parse_node_id, timeout_s)

    async def delete(self, node_id: str, *, timeout_s: float | None = None) -> bool:
        """``Sync.MemoryDeleteRequest``: whether the node existed."""
        return await self._call(DELETE_METHOD, {"node_id": node_id}, parse_deleted, timeout_s)

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
        conn: Connection | None = None
        attempt: asyncio.Task[Connection] | None = None
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
                result = await conn.request(method, params, trace_params(conn))
            parsed = parse(result)
            if self._metrics is not None:
                self._metrics.philia_call(
                    METRIC_METHODS[method], "ok", time.perf_counter() - started
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
                    METRIC_METHODS[method], "cancelled", time.perf_counter() - started
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
                METRIC_METHODS[method], outcome, time.perf_counter() - started
            )
        raise error

    def _drop(self, conn: Connection, reason: PhiliaError) -> None:
        if not conn.closed:
            logger.info("dropping the Philia connection to %s: %s", self.redacted_url, reason)
        conn.abort(reason)
        if self._conn is conn:
            self._conn = None

    def _live_connection(self) -> Connection | None:
        if self._closed:
            raise PhiliaUnavailable("the Philia client is closed")
        conn = self._conn
        if conn is not None and not conn.usable:
            # Closed by the peer while idle (Philia closes idle links), or half-closed
            # with the TCP connection left open: never send on it.
            self._drop(conn, PhiliaUnavailable("Philia closed the connection"))
            return None
        return conn

    def _connect_attempt(self) -> asyncio.Task[Connection]:
        """The connect in progress, or a new one: concurrent callers share one attempt."""
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
            self._connecting.add_done_callback(self._connect_done)
        return self._connecting

    async def _join(self, attempt: asyncio.Task[Connection]) -> Connection:
        try:
            # Shielded: one caller giving up must not cancel the others' connect.
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if attempt.cancelled() and current is not None and not current.cancelling():
                # Another waiter or aclose() ended the shared attempt, not our caller.
                raise PhiliaUnavailable("the connect attempt to Philia was abandoned") from None
            raise

    def _connect_done(self, task: asyncio.Task[Connection]) -> None:
        if self._connecting is task:
            self._connecting = None
        if task.cancelled():
            return
        if task.exception() is None:
            self._conn = task.result()

    async def _open(self) -> Connection:
        """Connect and handshake, bounded by one call's deadline; abort on any failure."""
        conn: Connection | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                ws = await self._upgrade()
                conn = Connection(ws, self.redact, self._ids, self._heartbeat_s)
                result = await conn.request(
                    "Sync.ConnectHandshake",
                    {
                        "token": self._token,
                        "client_type": "cli",
                        "capabilities": [],
                        "protocol_version": 1,
                    },
                )
                check_handshake(result, self.redact)
                conn.trace_context = takes_trace_context(result)
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

    async def _upgrade(self) -> PhiliaSocket:
        """Open the WebSocket (bounded by the caller's deadline, see :meth:`_open`)."""
        where = self.redacted_url
        if self._session is None:
            self._session = aiohttp.ClientSession(
                ws_response_class=PhiliaSocket,
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
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=CLOSE_TIMEOUT_S),
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
        assert isinstance(ws, PhiliaSocket)
        return ws


def secret_forms(token: str) -> tuple[str, ...]:
    """The token as it may appear in text: raw, URL-encoded, JSON-escaped."""
    forms = {token, quote(token, safe=""), json.dumps(token)[1:-1]}
    return tuple(sorted((f for f in forms if f), key=len, reverse=True))
