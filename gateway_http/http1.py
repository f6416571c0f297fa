"""A lean HTTP/1.1 client for the upstream's whole (non-streamed) requests.

Profiling the gateway under load showed httpx (with httpcore and anyio under it) as the
largest single cost of a turn: about 40% of the gateway's CPU for a request to a zero-latency
upstream, much of it two socket writes per request (headers, then body) and the per-request
layers of pool bookkeeping, cancel scopes and events. This client is one asyncio protocol per
connection with the C ``httptools`` parser (already installed with ``uvicorn[standard]``): one
write per request, a LIFO pool of keep-alive connections, a connect timeout and a read
timeout that, as in httpx, bounds the silence between two received bytes. A response is read
whole (:meth:`Http1Pool.request`) or as its body arrives (:meth:`Http1Pool.open`, for the
event stream of a streamed answer).

It only speaks plain ``http://`` without a proxy; :mod:`gateway_http.upstream` keeps httpx for
everything else (TLS, proxies, credentials in the URL).
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from dataclasses import dataclass
from typing import cast

import httptools


class Http1Error(Exception):
    """The request failed before a whole response arrived."""


class Http1ConnectError(Http1Error):
    """The upstream could not be reached."""


class Http1Timeout(Http1Error):
    """Connecting, or waiting for the next byte of the response, took too long."""


class Http1ProtocolError(Http1Error):
    """The connection broke or the response was not valid HTTP/1.1."""


@dataclass(frozen=True)
class Http1Response:
    status: int
    content: bytes


# A streamed body is buffered up to this size before the socket stops being read.
_STREAM_HIGH_WATER = 256 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Http1Response] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._read_timeout_s = 0.0
        self._last_read = 0.0
        self._body: list[bytes] = []
        self._status = 0
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: the body's end is known
        self._encoding = b""
        self.received = False
        self.reusable = False
        self.idle_since = 0.0
        # Streaming mode: the waiter resolves at the headers; the body is read chunk by chunk.
        self._streaming = False
        self._buffered = 0
        self._paused = False
        self._finished = False
        self._error: Http1Error | None = None
        self._wake: asyncio.Future[None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Http1ProtocolError("unexpected protocol upgrade"))
        except httptools.HttpParserError:
            self._fail(Http1ProtocolError("malformed HTTP response"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.reusable = False
        if self._streaming and not self._finished:
            if self._headers_done and not self._framed:
                self._finished = True
            elif self._error is None:
                self._error = Http1ProtocolError("connection closed")
            self._wake_reader()
        if self._waiter is not None and not self._waiter.done():
            if self._headers_done and not self._framed:
                # A body without Content-Length or chunking ends when the connection does.
                self._complete()
            else:
                self._waiter.set_exception(Http1ProtocolError("connection closed"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length":
            self._framed = True
        elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
            self._framed = True
        elif lowered == b"content-encoding":
            self._encoding = value.strip().lower()

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._status = self._parser.get_status_code()
        if self._streaming and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(Http1Response(self._status, b""))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        if self._streaming:
            self._buffered += len(body)
            if self._buffered > _STREAM_HIGH_WATER and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
            self._wake_reader()

    def on_message_complete(self) -> None:
        self.reusable = self._parser.should_keep_alive()
        if self._streaming:
            self._finished = True
            self._wake_reader()
        else:
            self._complete()

    # the request

    async def exchange(
        self, payload: bytes, read_timeout_s: float, *, stream: bool = False
    ) -> Http1Response:
        """Send ``payload``; the whole response, or (``stream``) its status once headers came."""
        transport = self.transport
        if transport is None:
            raise Http1ProtocolError("connection closed")
        self._streaming = stream
        self._buffered = 0
        self._paused = self._finished = False
        self._error = None
        self._body = []
        self._status = 0
        self._headers_done = self._framed = self.received = self.reusable = False
        self._encoding = b""
        self._waiter = self._loop.create_future()
        self._read_timeout_s = read_timeout_s
        self._last_read = self._loop.time()
        self._timer = self._loop.call_later(read_timeout_s, self._check_silence)
        transport.write(payload)
        try:
            return await self._waiter
        finally:
            self._waiter = None
            if not stream:
                self.stop_timer()

    async def read(self) -> bytes | None:
        """The next piece of a streamed body; None at its end."""
        while True:
            if self._body:
                data = b"".join(self._body)
                self._body = []
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._finished:
                self.stop_timer()
                return None
            self._wake = self._loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    @property
    def finished(self) -> bool:
        return self._finished and not self._body

    def _wake_reader(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.reusable = False
        self.stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def _check_silence(self) -> None:
        if self._finished:
            # The whole body is in: any wait from here on is the reader's, not the upstream's.
            self._timer = None
            return
        if self._paused:
            # Not reading on purpose (the reader is behind): the upstream is not silent.
            self._last_read = self._loop.time()
        silent_for = self._loop.time() - self._last_read
        if silent_for >= self._read_timeout_s:
            self._timer = None
            self._fail(Http1Timeout("no response data within the read timeout"))
        else:
            # Re-armed only when it fires, not on every read: cheaper per chunk.
            self._timer = self._loop.call_later(
                self._read_timeout_s - silent_for, self._check_silence
            )

    def _complete(self) -> None:
        if self._waiter is None or self._waiter.done():
            return
        content = b"".join(self._body)
        if self._encoding in (b"gzip", b"deflate", b"x-gzip"):
            try:
                # wbits 47: zlib or gzip header, detected automatically.
                content = zlib.decompress(content, 47)
            except zlib.error:
                self._fail(Http1ProtocolError("undecodable response body"))
                return
        self._waiter.set_result(Http1Response(self._status, content))

    def _fail(self, error: Http1Error) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        if self._streaming and self._error is None:
            self._error = error
            self._wake_reader()
        self.close()


class Http1Pool:
    """Keep-alive connections to one ``host:port``; requests run one per connection."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_idle: int = 256,
        idle_expiry_s: float = 30.0,
    ) -> None:
        self._host = host
        self._port = port
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle_expiry_s = idle_expiry_s
        # Most recently used last: reusing the warmest connection first lets the others expire.
        self._idle: deque[_Connection] = deque()
        self._closed = False

    async def request(self, payload: bytes) -> Http1Response:
        """Send one whole request (head and body already encoded) and read the response."""
        if self._closed:
            raise Http1ConnectError("the client is closed")
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, payload)
            except Http1ProtocolError:
                # The server may close an idle keep-alive connection just as we reuse it;
                # when nothing at all came back, the request is sent once more on a new one.
                if conn.received:
                    raise
        return await self._exchange(await self._connect(), payload)

    async def open(self, payload: bytes) -> Http1Stream:
        """Send one request and return once the response headers are in; read the body from
        the returned stream and close it when done (a connection whose body was read to its
        end goes back to the pool, any other is closed)."""
        if self._closed:
            raise Http1ConnectError("the client is closed")
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._open_on(conn, payload)
            except Http1ProtocolError:
                if conn.received:
                    raise
        return await self._open_on(await self._connect(), payload)

    async def _open_on(self, conn: _Connection, payload: bytes) -> Http1Stream:
        try:
            head = await conn.exchange(payload, self._read_timeout_s, stream=True)
        except BaseException:
            conn.close()
            raise
        return Http1Stream(self, conn, head.status)

    def _release(self, conn: _Connection) -> None:
        if conn.reusable and not self._closed and len(self._idle) < self._max_idle:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    async def _exchange(self, conn: _Connection, payload: bytes) -> Http1Response:
        try:
            response = await conn.exchange(payload, self._read_timeout_s)
        except BaseException:
            # Failed, timed out or cancelled mid-request: the connection cannot be reused,
            # and closing it tells the upstream the request went away.
            conn.close()
            raise
        self._release(conn)
        return response

    def _take_idle(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and now - conn.idle_since < self._idle_expiry_s:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, self._host, self._port)
        except TimeoutError:
            raise Http1Timeout("connect timed out") from None
        except OSError as exc:
            raise Http1ConnectError(type(exc).__name__) from None
        return conn


class Http1Stream:
    """A response whose body is read as it arrives; always :meth:`close` it."""

    def __init__(self, pool: Http1Pool, conn: _Connection, status: int) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = status

    async def read(self) -> bytes | None:
        """The next piece of the body (raises :class:`Http1Error`); None at its end."""
        if self._conn is None:
            return None
        return await self._conn.read()

    async def read_capped(self, limit: int) -> bytes:
        """The body, or its first ``limit`` bytes and a bit."""
        body = bytearray()
        while len(body) <= limit and (part := await self.read()) is not None:
            body += part
        return bytes(body)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.finished:
            conn.stop_timer()
            self._pool._release(conn)
        else:
            # Stopped early: closing tells the upstream that nobody reads the answer.
            conn.close()
