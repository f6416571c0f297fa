"""The OpenAI-compatible upstream client.

:class:`OpenAIUpstream` talks to any OpenAI-compatible API over one shared
``aiohttp.ClientSession`` (one keep-alive connection pool for the life of the process, plain
http or TLS, proxies from the environment). It speaks plain ``dict`` request and response bodies
in OpenAI's shape; every failure surfaces as :class:`~gateway_http.upstream.backend.UpstreamError`
whose message is safe to show a client: it never carries the API key or credentials from the
upstream URL.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from arona_common import tracing
from arona_common.redact import REDACTED, redact_text, redact_url
from arona_grpc.config import ConfigError
from gateway_http.upstream.backend import (
    BROKEN,
    INVALID,
    TIMEOUT,
    UNREACHABLE,
    UpstreamError,
)

logger = logging.getLogger(__name__)

# Upstream error texts are shown to clients; keep them short and on one line.
_MAX_DETAIL_CHARS = 300
# An error body larger than this is not worth reading just to find a message in it.
_MAX_ERROR_BODY_BYTES = 64 * 1024
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# What a backend serves of the Responses API (the backends file's `api`).
RESPONSES_API = "responses"
CHAT_API = "chat"
# Sized for a gateway fanning many concurrent turns out to one or two upstream hosts: enough
# connections that a burst does not queue, kept alive so it does not pay a TCP/TLS handshake
# per request.
_MAX_CONNECTIONS = 1000
# An idle connection is given up before the upstream would close it: uvicorn (vLLM, LiteLLM,
# FastAPI apps), Node.js and llama.cpp's server all close idle connections after 5 s, and a
# request sent on one just as the server closes it fails with nothing received.
_KEEPALIVE_S = 4.0
_USER_AGENT = "arona-gateway"
# What an error's answer keeps of the upstream's headers (see _kept_headers); its request id
# is not one of them: the client's answer carries the gateway's own.
_KEPT_HEADERS = frozenset({"content-type", "retry-after", "retry-after-ms"})
_RATE_LIMIT_PREFIX = "x-ratelimit-"
_WHITESPACE = re.compile(r"\s+")
# What a host may be made of once yarl has IDNA-encoded it (IPv6 literals and zone ids included).
_HOST = re.compile(r"[A-Za-z0-9._~%:-]+")


class OpenAIUpstream:
    """An OpenAI-compatible ``/v1`` API reached over one shared ``aiohttp.ClientSession``.

    A ``base_url`` that is not an http(s) URL with a host raises ``ConfigError`` at once.
    Credentials in the URL are sent as basic auth (and then take the place of the bearer key,
    as there is one ``Authorization`` header). The session is made on first use, inside the
    running loop, and closed by :meth:`aclose`; a ``session`` passed in is used as it is
    (its timeouts, pool and proxy settings) and left open for its owner to close.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        name: str = "upstream",
        session: aiohttp.ClientSession | None = None,
        api: str = RESPONSES_API,
    ) -> None:
        # A named backend of the backends file, or the one ARONA_UPSTREAM_URL.
        self.name = name
        # What it serves of /v1/responses (gateway_http.responses): the Responses API itself
        # (RESPONSES_API: forwarded as is), or chat completions only (CHAT_API: translated).
        self.api = api
        base = base_url.rstrip("/")
        url = _parse_base_url(base)
        basic = aiohttp.BasicAuth.from_url(url, encoding="utf-8")
        # Built once: aiohttp takes a URL object as it is, without parsing a string per request.
        plain = str(url.with_user(None)).rstrip("/")
        self._chat_url = URL(f"{plain}/chat/completions", encoded=True)
        self._models_url = URL(f"{plain}/models", encoded=True)
        self._responses_url = URL(f"{plain}/responses", encoded=True)
        # The base of the other routes' URLs (gateway_http.upstream.raw).
        self._plain = plain
        # What log lines call it: its (redacted) URL, after its name for a named backend.
        safe_url = redact_url(base)
        self._safe_url = safe_url if name == "upstream" else f"{name} ({safe_url})"
        self._api_key = api_key or None
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._session = session
        self._owns_session = session is None
        self._closed = False
        # The proxy is looked up once, from the same variables and in the same way as aiohttp's
        # trust_env does; trust_env itself looks it up (and reads ~/.netrc) in a worker thread
        # on every request, which costs several times the request itself.
        self._proxy: URL | None = None
        self._proxy_headers: dict[str, str] | None = None
        auth: dict[str, str] = {}
        if session is None:
            self._proxy, proxy_auth = _env_proxy(url)
            if proxy_auth is not None and url.scheme == "https":
                # Tunnelled: the credentials go on the CONNECT request only.
                self._proxy_headers = {"Proxy-Authorization": proxy_auth}
            elif proxy_auth is not None:
                # Forwarded: the proxy reads them off the request itself.
                auth["Proxy-Authorization"] = proxy_auth
        if basic is not None:
            auth["Authorization"] = basic.encode()
        elif self._api_key:
            auth["Authorization"] = f"Bearer {self._api_key}"
        self._auth = auth
        self._models_headers = {**auth, "Accept": "application/json", "User-Agent": _USER_AGENT}
        self._json_headers = {**self._models_headers, "Content-Type": "application/json"}
        # Compression would make a proxy or the upstream buffer the event stream.
        self._stream_headers = {
            **auth,
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
            "User-Agent": _USER_AGENT,
        }

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        payload = self._encode(body, stream=False)
        return await self._fetch_object("POST", self._chat_url, self._json_headers, payload)

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        payload = self._encode(body, stream=True)
        try:
            response = await self._send("POST", self._chat_url, self._stream_headers, payload)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from None
        # Whatever ends the iteration (the last event, an error, the consumer closing the
        # generator or being cancelled) closes the response here. A body read to its end gives
        # the connection back to the pool; any other is closed, so the upstream sees the
        # request go away at once.
        try:
            if response.status >= 400:
                raise self._http_error(response, await _read_capped(response))
            async with contextlib.aclosing(self._chunks(response.content.iter_any())) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc, mid_stream=True) from None
        finally:
            response.release()

    async def _chunks(self, pieces: AsyncIterator[bytes]) -> AsyncGenerator[dict[str, Any], None]:
        """The ``chat.completion.chunk`` objects of an event stream, up to ``[DONE]``."""
        finished = False
        async with contextlib.aclosing(_sse_data(pieces)) as events:
            async for data in events:
                if data == b"[DONE]":
                    return
                chunk = self._decode_chunk(data)
                if _has_finish_reason(chunk):
                    finished = True
                yield chunk
        # Some servers end the body without ``[DONE]``; a finished choice means the answer
        # is whole, anything else means it was cut off.
        if not finished:
            logger.warning("upstream %s: stream ended before the answer", self._safe_url)
            raise UpstreamError("upstream stream ended early", None, BROKEN)

    async def models(self) -> dict[str, Any]:
        return await self._fetch_object("GET", self._models_url, self._models_headers)

    async def _fetch_object(
        self, method: str, url: URL, headers: dict[str, str], payload: bytes | None = None
    ) -> dict[str, Any]:
        """One whole request whose answer is a JSON object (a completion, the model list)."""
        try:
            async with await self._send(method, url, headers, payload) as response:
                if response.status >= 400:
                    raise self._http_error(response, await _read_capped(response))
                content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from None
        return self._decode_object(content)

    async def _send(
        self, method: str, url: URL, headers: dict[str, str], payload: bytes | None
    ) -> aiohttp.ClientResponse:
        """Send one request and return its response once the status and headers are in.

        A keep-alive connection may be closed by the upstream just as a request goes out on
        it; the request then fails before any byte of an answer arrives. aiohttp sends a GET
        once more itself; a POST it does not, so that failure is retried here, once, on
        another connection. Failing to connect, a timeout, or anything that happens once the
        answer has begun is never retried.
        """
        session = self._current_session()
        retried = method != "POST"
        if tracing.active():
            # The attempt's span is current: the upstream may continue the trace.
            headers = dict(headers)
            tracing.inject(headers)
        while True:
            try:
                return await session.request(
                    method,
                    url,
                    data=payload,
                    headers=headers,
                    proxy=self._proxy,
                    proxy_headers=self._proxy_headers,
                    allow_redirects=False,
                )
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if retried:
                    raise
                retried = True
                logger.info(
                    "upstream %s closed the connection before answering (%s); sending again",
                    self._safe_url,
                    type(exc).__name__,
                )

    async def respond(self, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """``POST /responses`` whole: the upstream's body as it sent it, and that body parsed
        (a ``response`` object). Failures are :class:`UpstreamError` as for a chat turn."""
        # As the client sent it: no `stream` is added where it has none.
        payload = _encoded(body)
        try:
            async with await self._send(
                "POST", self._responses_url, self._json_headers, payload
            ) as response:
                if response.status >= 400:
                    raise self._http_error(response, await _read_capped(response))
                content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from None
        return content, self._decode_object(content)

    async def respond_stream(
        self, body: dict[str, Any]
    ) -> AsyncGenerator[tuple[bytes, bytes | None], None]:
        """``POST /responses`` streamed: each server-sent event as the upstream sent it (its
        raw bytes, blank line included) and its ``data`` payload (None for an event without
        one: a comment, a keep-alive). The stream is passed on as it is, so it is not checked
        here; closing the generator closes the request, as for a chat stream. ``body`` asks
        for the stream itself (its ``stream`` is true)."""
        payload = _encoded(body)
        try:
            response = await self._send("POST", self._responses_url, self._stream_headers, payload)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from None
        try:
            if response.status >= 400:
                raise self._http_error(response, await _read_capped(response))
            async with contextlib.aclosing(_sse_events(response.content.iter_any())) as events:
                async for event in events:
                    yield event
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc, mid_stream=True) from None
        finally:
            response.release()

    # The other OpenAI routes, passed through as they come (gateway_http.upstream.raw).

    async def open_raw(
        self, method: str, path: str, payload: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """Send ``payload`` to ``path`` under the base URL with this backend's credentials,
        proxy and timeouts; the response once its status and headers are in (the caller reads
        and releases it). A transport failure is an :class:`UpstreamError`."""
        url = URL(f"{self._plain}/{path}", encoded=True)
        try:
            return await self._send(
                method, url, {**headers, **self._auth, "User-Agent": _USER_AGENT}, payload
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._transport_error(exc) from None

    def raw_failure(
        self, exc: aiohttp.ClientError | TimeoutError, *, mid_stream: bool = False
    ) -> UpstreamError:
        """The :class:`UpstreamError` of a failure while a raw answer's body is read."""
        return self._transport_error(exc, mid_stream=mid_stream)

    def raw_redacted(self, content: bytes) -> bytes:
        """An error body as the upstream sent it, but for this backend's key, masked."""
        key = self._api_key
        if key and key.encode() in content:
            return content.replace(key.encode(), REDACTED.encode())
        return content

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None and self._owns_session:
            await session.close()

    def _current_session(self) -> aiohttp.ClientSession:
        """The shared session, made on first use: aiohttp binds it to the running loop."""
        if self._session is not None:
            return self._session
        if self._closed:
            logger.warning("upstream %s: request after the client was closed", self._safe_url)
            raise UpstreamError("upstream unreachable", None, UNREACHABLE)
        connect_s = min(self._timeout_s, self._connect_timeout_s)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=_MAX_CONNECTIONS, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
            ),
            # sock_read bounds the silence between two received bytes, so a long streamed
            # answer is fine as long as tokens keep coming; connect bounds the wait for a
            # pooled connection, sock_connect the TCP (and TLS) handshake of a new one.
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=self._timeout_s,
                sock_connect=connect_s,
                sock_read=self._timeout_s,
            ),
            # The proxy from the environment is passed with each request (see __init__).
            trust_env=False,
            # Cookies from one upstream reply must not ride along on another user's turn.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        return self._session

    def _encode(self, body: dict[str, Any], *, stream: bool) -> bytes:
        # A shallow copy only when needed: the caller's body stays untouched and the messages
        # themselves are never copied.
        if body.get("stream") is not stream:
            body = {**body, "stream": stream}
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise UpstreamError(
                "the request could not be encoded for the upstream", None, INVALID
            ) from None

    def _decode_object(self, content: bytes) -> dict[str, Any]:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            logger.warning("upstream %s: reply is not a JSON object", self._safe_url)
            raise UpstreamError("upstream returned invalid JSON", None, INVALID)
        return data

    def _decode_chunk(self, data: bytes) -> dict[str, Any]:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            logger.warning("upstream %s: malformed stream event", self._safe_url)
            raise UpstreamError("upstream sent a malformed stream event", None, INVALID)
        if "error" in chunk and "choices" not in chunk:
            # OpenAI-compatible servers report a failure after the headers as an error event.
            detail = self._detail(chunk)
            logger.warning("upstream %s: error event in stream", self._safe_url)
            message = f"upstream error: {detail}" if detail else "upstream error"
            raise UpstreamError(message, None, INVALID)
        return chunk

    def _http_error(self, response: aiohttp.ClientResponse, content: bytes) -> UpstreamError:
        status = response.status
        logger.warning("upstream %s answered HTTP %d", self._safe_url, status)
        detail = None
        try:
            detail = self._detail(orjson.loads(content))
        except orjson.JSONDecodeError:
            pass
        message = f"upstream returned HTTP {status}"
        key = self._api_key
        if key and key.encode() in content:
            # The body may be shown to the client: never with the backend's key in it.
            content = redact_text(content.decode("utf-8", "replace"), (key,)).encode()
        return UpstreamError(
            f"{message}: {detail}" if detail else message,
            status,
            body=content,
            headers=_kept_headers(response.headers),
            backend=self.name,
        )

    def _detail(self, data: Any) -> str | None:
        """The upstream's own error message from an OpenAI-shaped error body, made safe."""
        if not isinstance(data, dict):
            return None
        error = data.get("error")
        text: Any = error.get("message") if isinstance(error, dict) else error
        if not isinstance(text, str):
            text = data.get("message")
        if not isinstance(text, str):
            return None
        text = _WHITESPACE.sub(" ", redact_text(text, (self._api_key,))).strip()
        if len(text) > _MAX_DETAIL_CHARS:
            text = text[: _MAX_DETAIL_CHARS - 1] + "…"
        return text or None

    def _transport_error(
        self, exc: aiohttp.ClientError | TimeoutError, *, mid_stream: bool = False
    ) -> UpstreamError:
        # The exception text can contain the URL, so only its type is logged.
        logger.warning("upstream %s failed: %s", self._safe_url, type(exc).__name__)
        if isinstance(exc, TimeoutError):
            return UpstreamError("upstream timed out", None, TIMEOUT)
        if mid_stream:
            return UpstreamError("upstream stream broke off", None, BROKEN)
        return UpstreamError("upstream unreachable", None, UNREACHABLE)


def valid_base_url(base: str) -> bool:
    """Whether ``base`` is an http(s) URL with a host, one requests can be sent to."""
    try:
        _parse_base_url(base.rstrip("/"))
    except ConfigError:
        return False
    return True


def _parse_base_url(base: str) -> URL:
    """The base URL, or ``ConfigError`` at start-up for one no request could ever be sent to."""
    try:
        url = URL(base)
        host = url.raw_host or ""
        port = url.explicit_port
        valid = (
            url.scheme in ("http", "https")
            and _HOST.fullmatch(host) is not None
            and (port is None or 0 < port < 65536)
        )
    except (ValueError, TypeError):
        valid = False
    if not valid:
        raise ConfigError(
            f"ARONA_UPSTREAM_URL must be an http:// or https:// URL, got {redact_url(base)!r}"
        )
    return url


def _env_proxy(url: URL) -> tuple[URL | None, str | None]:
    """The proxy ``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``NO_PROXY`` name for ``url`` (None for
    none), and the ``Proxy-Authorization`` value for its credentials (from its URL or
    ``~/.netrc``), if any."""
    try:
        proxy, proxy_auth = get_env_proxy_for_url(url)
    except LookupError:
        return None, None
    except ValueError:
        # The variable's value is not shown: a proxy URL can carry credentials.
        raise ConfigError(
            f"the proxy set in the environment for {url.scheme}:// is not a valid URL"
        ) from None
    return proxy, (proxy_auth.encode() if proxy_auth is not None else None)


def _kept_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The headers of an upstream's error a client may act on: its content type, when to try
    again, and its rate limits (names in lower case)."""
    kept = []
    for name, value in headers.items():
        lower = name.lower()
        if lower in _KEPT_HEADERS or lower.startswith(_RATE_LIMIT_PREFIX):
            kept.append((lower, value))
    return tuple(kept)


async def _read_capped(response: aiohttp.ClientResponse) -> bytes:
    """An error body, or its first ``_MAX_ERROR_BODY_BYTES`` and a bit."""
    body = bytearray()
    while len(body) <= _MAX_ERROR_BODY_BYTES and (part := await response.content.readany()):
        body += part
    return bytes(body)


async def _sse_data(pieces: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The ``data`` payload of each server-sent event, as raw bytes.

    Bytes are split here rather than read line by line from aiohttp, so each payload goes to
    ``orjson`` without a decode/encode round trip and no line length limit applies. Comments,
    ``event:``/``id:``/``retry:`` fields and blank keep-alives are skipped; several ``data:``
    lines of one event are joined by ``\\n``.
    """
    buffer = b""
    pending: list[bytes] = []
    async for part in pieces:
        buffer += part
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if pending:
                    yield b"\n".join(pending)
                    pending = []
            elif line.startswith(b"data:"):
                data = line[5:]
                pending.append(data[1:] if data.startswith(b" ") else data)
    if buffer.startswith(b"data:"):
        data = buffer.rstrip(b"\r")[5:]
        pending.append(data[1:] if data.startswith(b" ") else data)
    if pending:
        yield b"\n".join(pending)


def _has_finish_reason(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _encoded(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise UpstreamError(
            "the request could not be encoded for the upstream", None, INVALID
        ) from None


async def _sse_events(
    pieces: AsyncIterator[bytes],
) -> AsyncGenerator[tuple[bytes, bytes | None], None]:
    """Each server-sent event of a stream whole: its bytes exactly as they came (up to and
    including the blank line that ends it), and its ``data`` lines joined by ``\\n`` (None
    when it has none). Bytes after the last blank line are one last event."""
    buffer = b""
    start = 0
    pending: list[bytes] = []
    async for part in pieces:
        buffer += part
        lines_end = buffer.rfind(b"\n") + 1
        position = start
        while position < lines_end:
            eol = buffer.index(b"\n", position)
            line = buffer[position:eol]
            position = eol + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                yield buffer[:position], (b"\n".join(pending) if pending else None)
                buffer, position, lines_end, pending = (
                    buffer[position:],
                    0,
                    lines_end - position,
                    [],
                )
            elif line.startswith(b"data:"):
                data = line[5:]
                pending.append(data[1:] if data.startswith(b" ") else data)
        start = position
    if buffer:
        tail = buffer[start:].rstrip(b"\r")
        if tail.startswith(b"data:"):
            data = tail[5:]
            pending.append(data[1:] if data.startswith(b" ") else data)
        yield buffer, (b"\n".join(pending) if pending else None)
