"""Chat backends: the OpenAI-compatible upstream client and the built-in ``echo`` model.

This module owns everything the gateway sends to, and reads back from, the LLM that answers a
turn. :class:`OpenAIUpstream` talks to any OpenAI-compatible API over one shared
``httpx.AsyncClient`` (one connection pool for the life of the process); :class:`EchoModel` is
the deterministic development default used when no upstream is configured: it repeats the last
user message and shows the memory section it received, so recall is visible without an LLM.

Both speak plain ``dict`` request and response bodies in OpenAI's shape. Every failure surfaces
as :class:`UpstreamError` whose message is safe to show a client: it never carries the API key or
credentials from the upstream URL.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import urllib.request
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import httpx
import orjson

from arona_grpc.config import ConfigError
from arona_grpc.redact import redact_text, redact_url
from gateway_http.http1 import Http1Error, Http1Pool, Http1Stream, Http1Timeout

logger = logging.getLogger(__name__)

MEMORY_SECTION_HEADER = "## Relevant Long-Term Memories"

# Upstream error texts are shown to clients; keep them short and on one line.
_MAX_DETAIL_CHARS = 300
# An error body larger than this is not worth reading just to find a message in it.
_MAX_ERROR_BODY_BYTES = 64 * 1024
_CONNECT_TIMEOUT_S = 10.0
# Sized for a gateway fanning many concurrent turns out to one or two upstream hosts: enough
# keep-alive connections that a burst does not pay a TCP/TLS handshake per request.
_POOL_LIMITS = httpx.Limits(
    max_connections=1000, max_keepalive_connections=256, keepalive_expiry=30.0
)
_ECHO_CREATED = 1735689600  # 2025-01-01T00:00:00Z: a fixed date keeps /v1/models stable
_WORDS = re.compile(r"\s*\S+\s*")
_WHITESPACE = re.compile(r"\s+")


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


def message_text(message: Any) -> str:
    """The text of one chat message: string content, or the ``text`` parts of a content list
    joined by ``\\n``; anything else is ``""``."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


class OpenAIUpstream:
    """An OpenAI-compatible ``/v1`` API reached over one shared ``httpx.AsyncClient``.

    A ``base_url`` that is not an http(s) URL with a host raises ``ConfigError`` at once.
    """

    name = "upstream"

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        _check_base_url(base)
        self._chat_url = f"{base}/chat/completions"
        self._models_url = f"{base}/models"
        self._safe_url = redact_url(base)
        self._api_key = api_key or None
        self._owns_client = client is None
        # Whole requests over plain http go through the lean client (see gateway_http.http1);
        # httpx serves streaming, TLS, proxies and a client passed in.
        self._fast: Http1Pool | None = None
        if client is None:
            self._fast = _fast_pool(base, timeout_s)
        self._client = client or httpx.AsyncClient(
            # The read timeout bounds the silence between two received bytes, so a long
            # streamed answer is fine as long as tokens keep coming.
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, _CONNECT_TIMEOUT_S)),
            limits=_POOL_LIMITS,
        )
        auth = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        if self._fast is not None:
            url = httpx.URL(base)
            head = f"Host: {url.netloc.decode('ascii')}\r\nAccept: application/json\r\n"
            head += "User-Agent: arona-gateway\r\n"
            if self._api_key:
                head += f"Authorization: Bearer {self._api_key}\r\n"
            path = url.raw_path.decode("ascii").rstrip("/")
            self._fast_chat = (
                f"POST {path}/chat/completions HTTP/1.1\r\n{head}"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode("latin-1")
            self._fast_stream = (
                f"POST {path}/chat/completions HTTP/1.1\r\n"
                + head.replace("Accept: application/json", "Accept: text/event-stream")
                + "Content-Type: application/json\r\nContent-Length: "
            ).encode("latin-1")
            self._fast_models = f"GET {path}/models HTTP/1.1\r\n{head}\r\n".encode("latin-1")
        self._json_headers = {
            **auth,
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        # Compression would make a proxy or the upstream buffer the event stream.
        self._stream_headers = {
            **auth,
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
        }

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        payload = self._encode(body, stream=False)
        if self._fast is not None:
            request = b"%s%d\r\n\r\n%s" % (self._fast_chat, len(payload), payload)
            return await self._fast_call(self._fast, request)
        try:
            response = await self._client.post(
                self._chat_url, content=payload, headers=self._json_headers
            )
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._transport_error(exc) from None
        if response.status_code >= 400:
            raise self._http_error(response.status_code, response.content)
        return self._decode_object(response.content)

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        payload = self._encode(body, stream=True)
        if self._fast is not None:
            head = b"%s%d\r\n\r\n" % (self._fast_stream, len(payload))
            try:
                stream = await self._fast.open(head + payload)
            except Http1Error as exc:
                raise self._fast_error(exc) from None
            # As below: whatever ends the iteration closes the response; an unfinished one
            # closes its connection, so the upstream sees the request go away.
            try:
                if stream.status >= 400:
                    error_body = await stream.read_capped(_MAX_ERROR_BODY_BYTES)
                    raise self._http_error(stream.status, error_body)
                async with contextlib.aclosing(self._chunks(_pieces(stream))) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except Http1Error as exc:
                raise self._fast_error(exc, mid_stream=True) from None
            finally:
                stream.close()
            return
        try:
            request = self._client.build_request(
                "POST", self._chat_url, content=payload, headers=self._stream_headers
            )
            response = await self._client.send(request, stream=True)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._transport_error(exc) from None
        # Whatever ends the iteration (the last event, an error, the consumer closing the
        # generator or being cancelled) closes the response here; an unfinished HTTP/1.1
        # response is not returned to the pool, so the upstream sees the request go away.
        try:
            if response.status_code >= 400:
                raise self._http_error(response.status_code, await _read_capped(response))
            async with contextlib.aclosing(self._chunks(response.aiter_bytes())) as chunks:
                async for chunk in chunks:
                    yield chunk
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, mid_stream=True) from None
        finally:
            await response.aclose()

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
            raise UpstreamError("upstream stream ended early", None)

    async def models(self) -> dict[str, Any]:
        if self._fast is not None:
            return await self._fast_call(self._fast, self._fast_models)
        try:
            response = await self._client.get(self._models_url, headers=self._json_headers)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise self._transport_error(exc) from None
        if response.status_code >= 400:
            raise self._http_error(response.status_code, response.content)
        return self._decode_object(response.content)

    async def aclose(self) -> None:
        if self._fast is not None:
            await self._fast.aclose()
        if self._owns_client:
            await self._client.aclose()

    async def _fast_call(self, pool: Http1Pool, request: bytes) -> dict[str, Any]:
        try:
            response = await pool.request(request)
        except Http1Error as exc:
            raise self._fast_error(exc) from None
        if response.status >= 400:
            raise self._http_error(response.status, response.content[:_MAX_ERROR_BODY_BYTES])
        return self._decode_object(response.content)

    def _encode(self, body: dict[str, Any], *, stream: bool) -> bytes:
        # A shallow copy only when needed: the caller's body stays untouched and the messages
        # themselves are never copied.
        if body.get("stream") is not stream:
            body = {**body, "stream": stream}
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise UpstreamError("the request could not be encoded for the upstream", None) from None

    def _fast_error(self, exc: Http1Error, *, mid_stream: bool = False) -> UpstreamError:
        # Only the type is logged: the same rule as for httpx errors below.
        logger.warning("upstream %s failed: %s", self._safe_url, type(exc).__name__)
        if isinstance(exc, Http1Timeout):
            return UpstreamError("upstream timed out", None)
        if mid_stream:
            return UpstreamError("upstream stream broke off", None)
        return UpstreamError("upstream unreachable", None)

    def _decode_object(self, content: bytes) -> dict[str, Any]:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            logger.warning("upstream %s: reply is not a JSON object", self._safe_url)
            raise UpstreamError("upstream returned invalid JSON", None)
        return data

    def _decode_chunk(self, data: bytes) -> dict[str, Any]:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            logger.warning("upstream %s: malformed stream event", self._safe_url)
            raise UpstreamError("upstream sent a malformed stream event", None)
        if "error" in chunk and "choices" not in chunk:
            # OpenAI-compatible servers report a failure after the headers as an error event.
            detail = self._detail(chunk)
            logger.warning("upstream %s: error event in stream", self._safe_url)
            raise UpstreamError(f"upstream error: {detail}" if detail else "upstream error", None)
        return chunk

    def _http_error(self, status: int, content: bytes) -> UpstreamError:
        logger.warning("upstream %s answered HTTP %d", self._safe_url, status)
        detail = None
        try:
            detail = self._detail(orjson.loads(content))
        except orjson.JSONDecodeError:
            pass
        message = f"upstream returned HTTP {status}"
        return UpstreamError(f"{message}: {detail}" if detail else message, status)

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
        self, exc: httpx.HTTPError | httpx.InvalidURL, *, mid_stream: bool = False
    ) -> UpstreamError:
        # The exception text can contain the URL, so only its type is logged.
        logger.warning("upstream %s failed: %s", self._safe_url, type(exc).__name__)
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamError("upstream timed out", None)
        if mid_stream:
            return UpstreamError("upstream stream broke off", None)
        return UpstreamError("upstream unreachable", None)


def _check_base_url(base: str) -> None:
    """Refuse, at start-up, a base URL no request could ever be sent to."""
    try:
        url = httpx.URL(base)
        valid = url.scheme in ("http", "https") and bool(url.host) and url.port in (None, *_PORTS)
    except (httpx.InvalidURL, ValueError):
        valid = False
    if not valid:
        raise ConfigError(
            f"ARONA_UPSTREAM_URL must be an http:// or https:// URL, got {redact_url(base)!r}"
        )


_PORTS = range(1, 65536)


def _fast_pool(base: str, timeout_s: float) -> Http1Pool | None:
    """The lean client for ``base``, or None where httpx must serve it.

    That is https (TLS), credentials in the URL (httpx sends them as basic auth) and an
    upstream reached through a proxy from the environment (httpx honours those variables).
    """
    url = httpx.URL(base)
    if url.scheme != "http" or url.userinfo:
        return None
    proxies = urllib.request.getproxies_environment()
    if (proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(url.host):
        return None
    return Http1Pool(
        url.host,
        url.port or 80,
        connect_timeout_s=min(timeout_s, _CONNECT_TIMEOUT_S),
        read_timeout_s=timeout_s,
        max_idle=_POOL_LIMITS.max_keepalive_connections or 256,
        idle_expiry_s=_POOL_LIMITS.keepalive_expiry or 30.0,
    )


async def _read_capped(response: httpx.Response) -> bytes:
    body = bytearray()
    async for part in response.aiter_bytes():
        body += part
        if len(body) > _MAX_ERROR_BODY_BYTES:
            break
    return bytes(body)


async def _pieces(stream: Http1Stream) -> AsyncGenerator[bytes, None]:
    while (part := await stream.read()) is not None:
        yield part


async def _sse_data(pieces: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The ``data`` payload of each server-sent event, as raw bytes.

    Bytes are split by hand instead of ``aiter_lines`` so each payload goes to ``orjson``
    without a decode/encode round trip. Comments, ``event:``/``id:``/``retry:`` fields and
    blank keep-alives are skipped; several ``data:`` lines of one event are joined by ``\\n``.
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


def memory_section(text: str) -> str | None:
    """The ``## Relevant Long-Term Memories`` section inside ``text``, verbatim, or ``None``.

    The section runs from its header to the next heading of the same or a higher level (memory
    lines can never start one: their continuation lines are indented) or the end of the text.
    """
    lines = text.split("\n")
    for start, line in enumerate(lines):
        if line.rstrip() == MEMORY_SECTION_HEADER:
            end = start + 1
            while end < len(lines) and not lines[end].startswith(("# ", "## ")):
                end += 1
            return "\n".join(lines[start:end]).rstrip()
    return None


class EchoModel:
    """The built-in development model: deterministic, no dependencies, model id ``echo``.

    Its reply is ``Echo: <last user text>``, followed by a blank line and the memory section
    when a system message carries one.
    """

    name = "echo"

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = _messages(body)
        content = _echo_content(messages)
        prompt_tokens = _prompt_tokens(messages)
        completion_tokens = len(content.split())
        return {
            "id": _completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": _model(body),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        messages = _messages(body)
        content = _echo_content(messages)
        base = {
            "id": _completion_id(),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": _model(body),
        }

        def chunk(delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        yield chunk({"role": "assistant", "content": ""})
        # Word-sized pieces so a client can see the answer arrive token by token.
        for piece in _WORDS.findall(content) or ([content] if content else []):
            yield chunk({"content": piece})
        yield chunk({}, "stop")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            prompt_tokens = _prompt_tokens(messages)
            completion_tokens = len(content.split())
            yield {
                **base,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": "echo", "object": "model", "created": _ECHO_CREATED, "owned_by": "arona"}
            ],
        }

    async def aclose(self) -> None:
        return None


def _messages(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else "echo"


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _prompt_tokens(messages: list[Any]) -> int:
    return sum(len(message_text(m).split()) for m in messages)


def _echo_content(messages: list[Any]) -> str:
    user_text = ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            user_text = message_text(message)
            break
    content = f"Echo: {user_text}"
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "system":
            section = memory_section(message_text(message))
            if section:
                # The header and the first line of each memory. A memory's
                # continuation lines are left out: they may hold an earlier
                # echoed section, and since the reply is written back as an
                # episode, echoing them would nest sections without end.
                shown = [ln for ln in section.split("\n") if not ln.startswith("  ")]
                return f"{content}\n\n" + "\n".join(shown)
    return content


def build_backend(upstream_url: str | None, api_key: str | None) -> ChatBackend:
    """The upstream when ``upstream_url`` is set, otherwise the ``echo`` model."""
    if upstream_url:
        return OpenAIUpstream(upstream_url, api_key)
    return EchoModel()
