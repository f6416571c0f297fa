"""Forwarding an OpenAI route the gateway does not own (embeddings, completions, audio, images,
moderations) to the backends of its model, bytes as they come.

:func:`forward` sends the client's body to the route's targets in order (the
:class:`~gateway_http.upstream.routing.Router`'s route of the body's model: aliases rewritten,
each backend's key, proxy and timeouts, those of its
:class:`~gateway_http.upstream.client.OpenAIUpstream`), falling back to the next one after a
connection failure, a timeout, a 5xx or a 429, as chat does, and only while nothing of the
answer has reached the client: the answer it returns has its status, headers and first bytes
in, and nothing of it was sent yet. What the last target answered is the client's, its error
statuses included (the upstream's own body), except 401 and 403: those are about the gateway's
key for the backend, never the client's, and come back as an :class:`UpstreamError` naming the
backend.

Each try is an :class:`~gateway_http.upstream.routing.Attempt` in the list the caller passes,
counted in ``arona_upstream_attempts_total`` when it ends (:meth:`RawAnswer.done`), and a
client span (``embeddings <model>``, ``text_completion <model>``, ``<route> <model>``) whose
``traceparent`` the upstream request carries, ended with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import aiohttp
from opentelemetry.trace import Span

from arona_common import tracing
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.metrics import GatewayMetrics
from gateway_http.upstream.backend import BROKEN, HTTP_ERROR, UpstreamError
from gateway_http.upstream.client import OpenAIUpstream
from gateway_http.upstream.routing import (
    CANCELLED,
    MAX_TRACED_MODEL_CHARS,
    OK,
    Attempt,
    Route,
    attempt_outcome,
)

logger = logging.getLogger(__name__)
TRACER = tracing.Tracer("gateway_http")
# The GenAI semantic conventions' operation of a route, where they name one (else its path).
_OPERATIONS = {"completions": "text_completion", "embeddings": "embeddings"}

# Response headers that are not passed on: the connection's own (hop by hop, and the length and
# encoding of a body aiohttp may have decoded), those the gateway sets itself (its request id,
# its X-Arona-* headers, its server and date), and the upstream's cookies and account, which
# belong to the operator's relation with the provider, not to the gateway's client.
_NOT_PASSED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "set-cookie",
        "server",
        "date",
        "x-request-id",
        "openai-organization",
        "openai-project",
    }
)
_OURS = "x-arona-"
# Statuses that say the gateway's credentials for the backend were refused.
_CREDENTIALS = (401, 403)


@dataclass(frozen=True, slots=True)
class RawRequest:
    """One client request to pass on."""

    # Under the backend's base URL: ``embeddings``, ``audio/speech``...
    path: str
    # The body as the client sent it, and its declared type.
    payload: bytes
    content_type: str
    # The model as the client named it (routed by it), and the body with another model name
    # in its place (an alias, or a fallback's own name for it).
    model: str
    renamed: Callable[[str], bytes]
    # Whether the answer is expected to be streamed (asks the upstream not to compress it).
    stream: bool = False
    accept: str = "*/*"


class RawAnswer:
    """A backend's answer whose status and headers are in, with its first bytes."""

    def __init__(
        self,
        upstream: OpenAIUpstream,
        response: aiohttp.ClientResponse,
        first: bytes,
        attempt: Attempt,
        metrics: GatewayMetrics,
        span: Span = tracing.INVALID_SPAN,
    ) -> None:
        self._upstream = upstream
        self._span = span
        self._response = response
        self._first = first
        self.attempt = attempt
        self._metrics = metrics
        self.status = response.status
        self.content_type = response.headers.get("content-type", "")
        self.headers = [
            (name, value)
            for name, value in response.headers.items()
            if name.lower() not in _NOT_PASSED and not name.lower().startswith(_OURS)
        ]

    @property
    def backend(self) -> str:
        return self.attempt.backend

    async def body(self) -> bytes:
        """The whole body (UpstreamError if it breaks off); the answer is done then."""
        try:
            rest = await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.done(BROKEN)
            raise self._upstream.raw_failure(exc, mid_stream=True) from None
        except BaseException:
            self.done(CANCELLED)
            raise
        self.done()
        content = self._first + rest
        # An error may quote the request's credentials: the backend's key is the operator's.
        return self._upstream.raw_redacted(content) if self.status >= 400 else content

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives; UpstreamError if it breaks off. Closing the generator
        early (the client left) closes the upstream request."""
        outcome = CANCELLED
        try:
            if self._first:
                yield self._first
            async for piece in self._response.content.iter_any():
                yield piece
            outcome = OK
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = BROKEN
            raise self._upstream.raw_failure(exc, mid_stream=True) from None
        finally:
            self.done(outcome)

    def done(self, outcome: str | None = None) -> None:
        """End the attempt (counted once) and give the connection back, or close it when the
        body was not read to its end."""
        self._response.release()
        attempt = self.attempt
        if attempt.ended:
            return
        if outcome is None or outcome == OK:
            outcome = OK if self.status < 400 else HTTP_ERROR
        attempt.end(outcome)
        if outcome == HTTP_ERROR:
            attempt.status = self.status
        self._metrics.attempt(attempt.backend, attempt_outcome(attempt))
        _span_ended(self._span, attempt)


async def forward(
    route: Route, request: RawRequest, attempts: list[Attempt], metrics: GatewayMetrics
) -> RawAnswer:
    """The answer of the first target of ``route`` that gives one worth passing on (see the
    module's docstring); the last failure propagates as an :class:`UpstreamError`."""
    targets = [t for t in route if isinstance(t.backend, OpenAIUpstream)]
    if not targets:
        name = route[0].name
        raise GatewayError(
            ErrorKind.NOT_FOUND,
            f"The model '{request.model}' is served by backend '{name}', which does not "
            f"answer POST /v1/{request.path} (the echo model answers chat completions and "
            "embeddings)"
            if name == "echo"
            else f"The model '{request.model}' is served by backend '{name}', which does not "
            f"answer POST /v1/{request.path}",
            "model_not_supported",
        )
    headers = {"Content-Type": request.content_type, "Accept": request.accept}
    if request.stream:
        # Compression would make a proxy or the upstream buffer the stream.
        headers["Accept-Encoding"] = "identity"
    for index, target in enumerate(targets):
        upstream = target.backend
        assert isinstance(upstream, OpenAIUpstream)
        sent = target.model or request.model
        payload = request.payload if sent == request.model else request.renamed(sent)
        attempt = Attempt(target.name, sent, time.perf_counter())
        attempts.append(attempt)
        last = index + 1 == len(targets)
        span = _attempt_span(request.path, attempt, index)
        try:
            # Current while the request goes out, so that it carries the attempt's traceparent.
            with tracing.current(span):
                response = await upstream.open_raw("POST", request.path, payload, headers)
        except UpstreamError as exc:
            _ended(attempt, exc.reason, metrics, span=span)
            if exc.retryable and not last:
                _falling_back(attempt, exc, targets[index + 1].name)
                continue
            raise
        except BaseException:
            _ended(attempt, CANCELLED, metrics, span=span)
            raise
        status = response.status
        if status in _CREDENTIALS:
            response.release()
            _ended(attempt, HTTP_ERROR, metrics, status, span)
            logger.warning(
                "backend %s refused the gateway's credentials (HTTP %d) on /v1/%s",
                target.name,
                status,
                request.path,
            )
            raise UpstreamError(
                f"backend {target.name} refused the gateway's credentials (HTTP {status})",
                status,
                backend=target.name,
            )
        if (status >= 500 or status == 429) and not last:
            response.release()
            _ended(attempt, HTTP_ERROR, metrics, status, span)
            _falling_back(attempt, UpstreamError("", status), targets[index + 1].name)
            continue
        # The first bytes before answering: an answer that breaks off at once may still be
        # replaced by the next backend's.
        try:
            first = await response.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.release()
            error = upstream.raw_failure(exc, mid_stream=True)
            _ended(attempt, error.reason, metrics, span=span)
            if not last:
                _falling_back(attempt, error, targets[index + 1].name)
                continue
            raise error from None
        except BaseException:
            response.release()
            _ended(attempt, CANCELLED, metrics, span=span)
            raise
        attempt.first = time.perf_counter()
        if span.is_recording():
            span.add_event("first bytes")
        return RawAnswer(upstream, response, first, attempt, metrics, span)
    raise AssertionError("a route has at least one target")


def _ended(
    attempt: Attempt,
    outcome: str,
    metrics: GatewayMetrics,
    status: int | None = None,
    span: Span = tracing.INVALID_SPAN,
) -> None:
    attempt.end(outcome)
    attempt.status = status
    metrics.attempt(attempt.backend, attempt_outcome(attempt))
    _span_ended(span, attempt)


def _attempt_span(path: str, attempt: Attempt, index: int) -> Span:
    """An attempt's client span (the GenAI semantic conventions' operation and model), ended
    with the attempt."""
    if not tracing.active():
        return tracing.INVALID_SPAN
    operation = _OPERATIONS.get(path, path)
    model = attempt.model[:MAX_TRACED_MODEL_CHARS]
    return TRACER.start(
        f"{operation} {model}",
        kind=tracing.CLIENT,
        attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.system": attempt.backend,
            "gen_ai.request.model": model,
            "arona.upstream.attempt": index + 1,
        },
    )


def _span_ended(span: Span, attempt: Attempt) -> None:
    if not span.is_recording():
        return
    outcome = attempt_outcome(attempt)
    span.set_attribute("arona.upstream.outcome", outcome)
    if attempt.status is not None:
        span.set_attribute("http.response.status_code", attempt.status)
    if outcome != "answered":
        tracing.failed(span, outcome)
    span.end()


def _falling_back(attempt: Attempt, exc: UpstreamError, following: str) -> None:
    logger.warning(
        "backend %s failed for model %s (%s%s); trying backend %s",
        attempt.backend,
        attempt.model,
        exc.reason,
        f" {exc.status}" if exc.status is not None else "",
        following,
    )
