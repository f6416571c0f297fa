"""Which backend answers a turn, and the fallback to the next one when it cannot.

A :class:`Router` turns the model a client asked for into a :data:`Route`: the backends to ask,
in order, each with the model name to send it and the role its memory section takes
(:class:`Target`; a backends file's ``memory_role``, so a fallback to a backend whose models
refuse ``system`` gets the section as ``developer`` or ``user``). With a backends file
(``ARONA_BACKENDS``) that is the model's backend then its fallbacks; without one, the one
upstream of ``ARONA_UPSTREAM_URL`` (or the ``echo`` model) answers every model, as before.

A turn's targets are tried in order while the failure is worth another backend
(:attr:`~gateway_http.upstream.backend.UpstreamError.retryable`: unreachable, timed out, 5xx,
429) **and nothing of the answer has reached the client**: a whole reply counts once it
arrived, a stream once its first chunk arrived; a stream that has started is never replayed.
Any other 4xx ends the turn on that backend (a context-length 400 would fail everywhere).

A stream asks for its usage with the gateway's own ``stream_options`` unless the backend is
known not to take them (``stream_usage = false``, or a refusal seen before): a backend that
refuses them is asked the same turn again at once without them, and remembered.

Every try is one :class:`Attempt` appended to the list the caller passes in: the backend, the
model sent, when it started, answered and ended, its outcome and HTTP status, and the upstream's
``usage`` object when it reported one. The turn pipeline keeps that list on the turn, for the
``X-Arona-Backend`` header, the log line that says who answered, and metering. The router
counts each attempt when it ends, by backend and outcome (:func:`attempt_outcome`), in
``arona_upstream_attempts_total``: fallbacks show there as failed attempts on one backend
beside answered ones on the next. Each attempt is also a client span (the GenAI semantic
conventions: model, backend, token counts, finish reasons; its outcome when it failed), whose
``traceparent`` the upstream request carries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from arona_common import tracing
from gateway_http.metrics import GatewayMetrics, NoMetrics
from gateway_http.upstream.backend import (
    BROKEN,
    HTTP_ERROR,
    TIMEOUT,
    UNREACHABLE,
    ChatBackend,
    UpstreamError,
)
from gateway_http.upstream.backends_file import BackendsFile
from gateway_http.upstream.client import OpenAIUpstream
from gateway_http.upstream.echo import EchoModel

logger = logging.getLogger(__name__)
TRACER = tracing.Tracer("gateway_http")
# Span names and attributes take a model name as the client sent it, cut to this length.
MAX_TRACED_MODEL_CHARS = 128

# An attempt's outcome besides the failure reasons of UpstreamError (backend.REASONS).
OK = "ok"
CANCELLED = "cancelled"
PENDING = "pending"
# /v1/models entries of a backends file: a fixed date keeps the listing stable.
_LISTED_CREATED = 1735689600
# Models matched by a glob are remembered (their route is built once); past this many
# different names, new ones are routed afresh each time rather than remembered.
_MAX_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class Target:
    """One backend to ask, and the model name to send it (None: the name the client asked)."""

    name: str
    backend: ChatBackend
    model: str | None = None
    # The role the turn's memory section is sent in (the backends file's memory_role).
    memory_role: str = "system"

    def body(self, body: dict[str, Any], section_at: int | None = None) -> dict[str, Any]:
        """``body`` as this backend gets it: a shallow copy with its model name, if it differs,
        and the memory section at ``messages[section_at]`` (None: none injected) in its role."""
        if section_at is not None and self.memory_role != "system":
            messages = list(body["messages"])
            messages[section_at] = {**messages[section_at], "role": self.memory_role}
            body = {**body, "messages": messages}
        if self.model is None:
            return body
        return {**body, "model": self.model}


Route = tuple[Target, ...]


@dataclass(slots=True)
class Attempt:
    """One try of one backend for one turn."""

    backend: str
    # The model name sent upstream.
    model: str
    # time.perf_counter() when the request went out, when the answer began (the whole reply,
    # or the first chunk of a stream: from then on it is never replaced), and when it ended.
    started: float
    first: float = 0.0
    ended: float = 0.0
    # OK, CANCELLED, PENDING (still under way), or why it failed (backend.REASONS).
    outcome: str = PENDING
    # The upstream's HTTP status when it answered with an error.
    status: int | None = None
    # The upstream's ``usage`` object, as it reported it (None when it did not).
    usage: dict[str, Any] | None = None

    @property
    def answered(self) -> bool:
        """Whether its answer began: a whole reply arrived, or a stream's first chunk."""
        return self.first > 0.0

    @property
    def latency_s(self) -> float:
        """From the request going out to its end (or to now, while under way)."""
        return (self.ended or time.perf_counter()) - self.started

    def end(self, outcome: str, error: UpstreamError | None = None) -> None:
        self.ended = time.perf_counter()
        self.outcome = outcome
        if error is not None:
            self.status = error.status


class Router:
    """The backends of this gateway and the route of each model to them.

    ``routes`` maps a model name to its route; ``table`` (a backends file) routes the names not
    in it (globs), and ``single`` answers every model (no backends file). ``listing`` is what
    ``GET /v1/models`` shows; without it the single backend's own listing is passed through.
    """

    def __init__(
        self,
        backends: Sequence[ChatBackend],
        *,
        routes: Mapping[str, Route] | None = None,
        table: BackendsFile | None = None,
        single: Route | None = None,
        listing: list[dict[str, Any]] | None = None,
        owns_backends: bool = True,
        metrics: GatewayMetrics | None = None,
        no_stream_usage: Iterable[str] = (),
    ) -> None:
        self._backends = tuple(backends)
        # The backends not to ask for a stream's usage (stream_usage = false in the backends
        # file, or learned from a refusal): the gateway's own stream_options is left out.
        self._no_stream_usage = set(no_stream_usage)
        self._by_name = {backend.name: backend for backend in self._backends}
        self._routes: dict[str, Route] = dict(routes or {})
        self._table = table
        self._single = single
        self._listing = listing
        self._owns_backends = owns_backends
        self._metrics = metrics or NoMetrics()

    @classmethod
    def single(
        cls,
        backend: ChatBackend,
        *,
        owns_backend: bool = True,
        metrics: GatewayMetrics | None = None,
    ) -> Router:
        """Every model to ``backend``, with no fallback (``ARONA_BACKENDS`` unset)."""
        return cls(
            [backend],
            single=(Target(backend.name, backend),),
            owns_backends=owns_backend,
            metrics=metrics,
        )

    @classmethod
    def from_file(cls, backends: BackendsFile, metrics: GatewayMetrics | None = None) -> Router:
        """A router over the backends of a checked backends file: one client each."""
        clients: dict[str, ChatBackend] = {
            spec.name: OpenAIUpstream(
                spec.base_url,
                spec.api_key,
                timeout_s=spec.timeout_s,
                connect_timeout_s=spec.connect_timeout_s,
                name=spec.name,
                api=spec.api,
            )
            for spec in backends.backends
        }
        router = cls(
            list(clients.values()),
            table=backends,
            metrics=metrics,
            no_stream_usage=[spec.name for spec in backends.backends if not spec.stream_usage],
        )
        listed = backends.listed()
        for model, _ in listed:
            router._routes[model] = router._route_of(model)
        router._listing = [
            {"id": model, "object": "model", "created": _LISTED_CREATED, "owned_by": spec.name}
            for model, spec in listed
        ]
        return router

    @property
    def routed(self) -> bool:
        """Whether a backends file routes the models (False: one upstream answers them all)."""
        return self._table is not None

    @property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def route(self, model: str) -> Route | None:
        """The backends to ask for ``model``, in order; None when none serves it."""
        if self._single is not None:
            return self._single
        route = self._routes.get(model)
        if route is not None:
            return route
        route = self._route_of(model)
        if not route:
            return None
        if len(self._routes) < _MAX_REMEMBERED:
            self._routes[model] = route
        return route

    def _route_of(self, model: str) -> Route:
        assert self._table is not None
        return tuple(
            Target(spec.name, self._by_name[spec.name], sent, spec.memory_role)
            for spec, sent in self._table.chain(model)
        )

    async def complete(
        self,
        route: Route,
        body: dict[str, Any],
        attempts: list[Attempt],
        section_at: int | None = None,
    ) -> dict[str, Any]:
        """The whole reply of the first target that gives one, trying the next on a failure
        worth it; the last failure propagates. ``section_at``: where the turn's memory section
        is in ``body["messages"]``, sent to each target in its own role."""
        for index, target in enumerate(route):
            attempt = _attempt(target, body)
            attempts.append(attempt)
            # Current while the request goes out, so that it carries the attempt's traceparent.
            with _attempt_span(attempt, body, index) as span:
                try:
                    completion = await target.backend.complete(target.body(body, section_at))
                except UpstreamError as exc:
                    self._end(attempt, exc.reason, exc)
                    _traced(span, attempt)
                    if self._fall_back(attempt, exc, route, index):
                        continue
                    raise
                except BaseException:
                    # Cancelled (the client left), or a failure that is not the upstream's.
                    self._end(attempt, CANCELLED)
                    _traced(span, attempt)
                    raise
                attempt.first = time.perf_counter()
                _note_usage(attempt, completion)
                self._end(attempt, OK)
                _traced(span, attempt, _finish_reasons(completion) if span.is_recording() else ())
                return completion
        raise AssertionError("a route has at least one target")

    async def stream(
        self,
        route: Route,
        body: dict[str, Any],
        attempts: list[Attempt],
        section_at: int | None = None,
        *,
        usage_optional: bool = False,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The chunks of the first target whose stream starts, trying the next while no chunk
        has arrived; once one has, the stream is that backend's to its end (a failure then
        propagates, never a replay). Close it to stop early: the upstream request ends too.

        ``section_at`` as for :meth:`complete`. ``usage_optional``: the ``stream_options`` of
        ``body`` is the gateway's own (asking for the usage), not the client's. A backend known
        not to take it gets the turn without it; one that refuses it
        (:func:`refuses_stream_options`) is asked the same turn again at once without it, and
        remembered as such.
        """
        index = 0
        while index < len(route):
            target = route[index]
            sent = body
            if usage_optional and target.name in self._no_stream_usage:
                sent = {key: value for key, value in body.items() if key != "stream_options"}
            attempt = _attempt(target, sent)
            attempts.append(attempt)
            chunks = target.backend.stream(target.body(sent, section_at))
            # Lasts as long as the stream; current only while the request goes out (the first
            # chunk), since a generator's caller runs between its chunks.
            span = _started_attempt(attempt, body, index)
            reasons: list[str] = []
            try:
                try:
                    with tracing.current(span):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    self._end(attempt, OK)
                    return
                except UpstreamError as exc:
                    self._end(attempt, exc.reason, exc)
                    if usage_optional and "stream_options" in sent and refuses_stream_options(exc):
                        # Once per backend: from now on it is sent none, so this is not again.
                        self._stream_usage_refused(target.name)
                        continue
                    if self._fall_back(attempt, exc, route, index):
                        index += 1
                        continue
                    raise
                attempt.first = time.perf_counter()
                traced = span.is_recording()
                if traced:
                    span.add_event("first chunk")
                    reasons.extend(_finish_reasons(chunk))
                _note_usage(attempt, chunk)
                yield chunk
                async for chunk in chunks:
                    _note_usage(attempt, chunk)
                    if traced:
                        reasons.extend(_finish_reasons(chunk))
                    yield chunk
                self._end(attempt, OK)
                return
            except UpstreamError as exc:
                if attempt.outcome == PENDING:
                    self._end(attempt, exc.reason, exc)
                raise
            finally:
                if attempt.outcome == PENDING:
                    # The consumer stopped early (closed, cancelled) or something else failed.
                    self._end(attempt, CANCELLED)
                _traced(span, attempt, reasons)
                span.end()
                await chunks.aclose()  # type: ignore[attr-defined]

    def _stream_usage_refused(self, backend: str) -> None:
        logger.warning(
            "backend %s refused stream_options; its streams are sent without it from now on "
            "(their usage is estimated; set stream_usage = false for it in the backends file)",
            backend,
        )
        self._no_stream_usage.add(backend)

    def _end(self, attempt: Attempt, outcome: str, error: UpstreamError | None = None) -> None:
        attempt.end(outcome, error)
        self._metrics.attempt(attempt.backend, attempt_outcome(attempt))

    def _fall_back(self, attempt: Attempt, exc: UpstreamError, route: Route, index: int) -> bool:
        """Whether the target after ``route[index]`` is to be asked, after ``exc`` (said so in
        the log when it is)."""
        if not exc.retryable or index + 1 >= len(route):
            return False
        logger.warning(
            "backend %s failed for model %s (%s%s); trying backend %s",
            attempt.backend,
            attempt.model,
            exc.reason,
            f" {exc.status}" if exc.status is not None else "",
            route[index + 1].name,
        )
        return True

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the names a backends file routes by name (globs cannot be
        listed), or the single backend's own listing."""
        if self._listing is not None:
            return {"object": "list", "data": self._listing}
        return await self._backends[0].models()

    async def aclose(self) -> None:
        if self._owns_backends:
            for backend in self._backends:
                await backend.aclose()


def refuses_stream_options(exc: UpstreamError) -> bool:
    """Whether ``exc`` is a backend refusing ``stream_options`` (older Azure OpenAI
    deployments: 400 "Unrecognized request argument supplied: stream_options"; servers that
    check their schema strictly: 400 or 422 naming it)."""
    if exc.reason != HTTP_ERROR or exc.status not in (400, 422):
        return False
    error = exc.error_object
    named = (error.get("param"), error.get("message"))
    if any(isinstance(text, str) and "stream_options" in text for text in named):
        return True
    # A body of another shape (FastAPI's "detail", a plain text): its words.
    return b"stream_options" in exc.body


def attempt_outcome(attempt: Attempt) -> str:
    """The ``outcome`` label of an attempt that ended (:data:`~gateway_http.metrics.
    ATTEMPT_OUTCOMES`)."""
    outcome = attempt.outcome
    if outcome == OK:
        return "answered"
    if outcome == CANCELLED:
        return "cancelled"
    if outcome == UNREACHABLE:
        return "connect_error"
    if outcome == TIMEOUT:
        return "timeout"
    if outcome == BROKEN:
        return "broken"
    if outcome == HTTP_ERROR and attempt.status is not None:
        if attempt.status == 429:
            return "status_429"
        if attempt.status >= 500:
            return "status_5xx"
        if attempt.status >= 400:
            return "status_4xx"
    return "other"


def _attempt_span(
    attempt: Attempt, body: dict[str, Any], index: int
) -> AbstractContextManager[Span]:
    """An attempt's span, current for a block (the whole reply's wait)."""
    if not tracing.active():
        return tracing.NO_SPAN
    return TRACER.span(
        _span_name(attempt), kind=tracing.CLIENT, attributes=_asked(attempt, body, index)
    )


def _started_attempt(attempt: Attempt, body: dict[str, Any], index: int) -> Span:
    """An attempt's span that the caller ends (a stream's, which outlives any block)."""
    if not tracing.active():
        return tracing.INVALID_SPAN
    return TRACER.start(
        _span_name(attempt), kind=tracing.CLIENT, attributes=_asked(attempt, body, index)
    )


def _span_name(attempt: Attempt) -> str:
    """The GenAI semantic conventions' name of an attempt's span: ``chat <model>``."""
    return f"chat {attempt.model[:MAX_TRACED_MODEL_CHARS]}"


def _asked(attempt: Attempt, body: dict[str, Any], index: int) -> dict[str, AttributeValue]:
    """An attempt's span attributes as it starts: what was asked of which backend (never the
    messages)."""
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "chat",
        # The backend asked: its name in the backends file, `upstream` or `echo`.
        "gen_ai.system": attempt.backend,
        "gen_ai.request.model": attempt.model[:MAX_TRACED_MODEL_CHARS],
        "arona.upstream.attempt": index + 1,
    }
    for key, name in (("temperature", "temperature"), ("max_tokens", "max_tokens")):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[f"gen_ai.request.{name}"] = value
    return attributes


def _traced(span: Span, attempt: Attempt, finish_reasons: Sequence[str] = ()) -> None:
    """An ended attempt on its span: its outcome, the answer's model, tokens and finish
    reasons (the GenAI semantic conventions), or why it failed."""
    if not span.is_recording():
        return
    outcome = attempt_outcome(attempt)
    span.set_attribute("arona.upstream.outcome", outcome)
    if attempt.status is not None:
        span.set_attribute("http.response.status_code", attempt.status)
    usage = attempt.usage
    if usage is not None:
        for key, name in (
            ("prompt_tokens", "input_tokens"),
            ("completion_tokens", "output_tokens"),
        ):
            count = usage.get(key)
            if isinstance(count, int) and not isinstance(count, bool):
                span.set_attribute(f"gen_ai.usage.{name}", count)
    if finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))
    if outcome != "answered":
        tracing.failed(span, outcome)


def _finish_reasons(answer: dict[str, Any]) -> list[str]:
    """The finish reasons of a reply's or a chunk's choices."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return []
    return [
        reason
        for choice in choices
        if isinstance(choice, dict) and isinstance(reason := choice.get("finish_reason"), str)
    ]


def _note_usage(attempt: Attempt, answer: dict[str, Any]) -> None:
    """Keep the ``usage`` object of a reply or chunk (a stream's comes in its last chunk)."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        attempt.usage = usage


def _attempt(target: Target, body: dict[str, Any]) -> Attempt:
    model = target.model if target.model is not None else body.get("model")
    return Attempt(target.name, model if isinstance(model, str) else "", time.perf_counter())


def build_backend(upstream_url: str | None, api_key: str | None) -> ChatBackend:
    """The upstream when ``upstream_url`` is set, otherwise the ``echo`` model."""
    if upstream_url:
        return OpenAIUpstream(upstream_url, api_key)
    return EchoModel()


def build_router(
    upstream_url: str | None,
    api_key: str | None,
    backends: BackendsFile | None,
    metrics: GatewayMetrics | None = None,
) -> Router:
    """The router of a backends file, or of the one upstream (or ``echo``) without one."""
    if backends is not None:
        return Router.from_file(backends, metrics)
    return Router.single(build_backend(upstream_url, api_key), metrics=metrics)
