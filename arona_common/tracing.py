"""Traces of chat turns over OTLP/HTTP, configured from the standard ``OTEL_*`` variables.

What it owns: reading those variables (:class:`TracingSettings`), this process's tracer
provider (:func:`started`, which flushes it on the way out), the tracer each layer makes its
spans with (:class:`Tracer`), and the W3C trace context (``traceparent``, ``tracestate``)
carried across each hop: HTTP headers, gRPC metadata, the calls of an ``Exchange`` stream and
the memory store's JSON-RPC params.

Off (no ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SDK_DISABLED=true``,
``OTEL_TRACES_EXPORTER=none``, a sampler that never samples, or a setting this gateway cannot
honour) the SDK is never imported and no provider is installed: :meth:`Tracer.span` hands back
one shared no-op, so a span costs a function call and an attribute look-up, and nothing is
extracted or injected. Under a sampler that samples only what a remote parent sampled
(``parentbased_always_off``), a trace this process would start is not made at all either.

The provider is kept here rather than as the API's global one, which can be set only once per
process: the entry point installs one per process (``up``, ``serve``, ``store``, each worker
of ``serve --workers``), and a test installs its own and removes it.

The spans are made by hand, not by OpenTelemetry's instrumentations: chat turns do not pass
through FastAPI's middleware (gateway_http.app), the HTTP layer's recalls and writebacks ride
long-lived ``Exchange`` streams (one gRPC span per stream would last for hours), and an
aiohttp instrumentation would export the memory store's upgrade URL, token included. No span
carries user text, memory text or a secret: names and attributes hold methods, models,
backends, counts, states and status codes only, and an exception is recorded by its type,
never its message (an upstream's error may quote the prompt).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from arona_common.redact import redact_url

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler

logger = logging.getLogger(__name__)

# The default service.name of each command (OTEL_SERVICE_NAME, or service.name in
# OTEL_RESOURCE_ATTRIBUTES, wins).
GATEWAY_SERVICE = "arona-gateway"
MEMORY_SERVICE = "arona-memory-service"
STORE_SERVICE = "arona-memory-store"

# The one protocol spoken: OTLP over HTTP with protobuf bodies (the collector's port 4318).
HTTP_PROTOBUF = "http/protobuf"
TRACES_PATH = "v1/traces"
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
DEFAULT_SAMPLER = "parentbased_always_on"
# How long the last spans may take to leave when the process stops (the exporter's own
# timeout, OTEL_EXPORTER_OTLP_TIMEOUT, 10 s by default, bounds each request within it).
SHUTDOWN_TIMEOUT_S = 10.0

SERVER = SpanKind.SERVER
CLIENT = SpanKind.CLIENT
INTERNAL = SpanKind.INTERNAL

Attributes = Mapping[str, AttributeValue]

# The handshake capability of a memory store whose requests' params may carry the caller's
# ``traceparent`` and ``tracestate`` (the embedded store, which continues the trace).
TRACE_CONTEXT = "trace_context"

# W3C Trace Context only: what every hop carries, whatever OTEL_PROPAGATORS names.
_PROPAGATOR = TraceContextTextMapPropagator()
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


class TracingError(ValueError):
    """A tracing setting that cannot be honoured (the message names the variable)."""


@dataclass(frozen=True)
class TracingSettings:
    """What the ``OTEL_*`` variables ask for; ``endpoint`` None means tracing is off."""

    # The full OTLP/HTTP traces URL (…/v1/traces), or None.
    endpoint: str | None
    sampler: str = DEFAULT_SAMPLER
    sampler_arg: float | None = None
    # Why tracing is off although an endpoint is set (logged once at start), or None.
    refused: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TracingSettings:
        """Read the variables; a setting that cannot be honoured turns tracing off and says
        why in ``refused`` (a service is not stopped by its telemetry, as OpenTelemetry's
        own SDKs behave)."""

        def get(name: str) -> str:
            return env.get(name, "").strip()

        endpoint = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint:
            return cls(None)
        if get("OTEL_SDK_DISABLED").lower() == "true":
            return cls(None)
        exporter = get("OTEL_TRACES_EXPORTER").lower() or "otlp"
        try:
            if exporter == "none":
                return cls(None)
            if exporter != "otlp":
                raise TracingError(
                    f"OTEL_TRACES_EXPORTER={exporter} is not supported (only otlp, or none)"
                )
            _check_protocol(env)
            url = _traces_url(env)
            sampler, arg = _sampler(env)
        except TracingError as exc:
            return cls(None, refused=f"{exc}: no traces are exported")
        return cls(url, sampler, arg)

    @property
    def samples_nothing(self) -> bool:
        """Whether the sampler never samples a span, whatever its parent (``always_off``, or
        ``traceidratio`` at 0): tracing is then off in this process."""
        return self.sampler == "always_off" or (
            self.sampler == "traceidratio" and self.sampler_arg == 0.0
        )

    @property
    def samples_roots(self) -> bool:
        """Whether the sampler may sample a trace this process starts (one with no remote
        parent): not ``parentbased_always_off``, nor ``parentbased_traceidratio`` at 0."""
        return not self.samples_nothing and not (
            self.sampler == "parentbased_always_off"
            or (self.sampler == "parentbased_traceidratio" and self.sampler_arg == 0.0)
        )


def _check_protocol(env: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip()
        if value:
            if value != HTTP_PROTOBUF:
                raise TracingError(
                    f"{name}={value} is not supported: traces are exported over OTLP/HTTP "
                    f"({HTTP_PROTOBUF}, a collector's port 4318)"
                )
            return


def _traces_url(env: Mapping[str, str]) -> str:
    """The traces URL: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, or
    OTEL_EXPORTER_OTLP_ENDPOINT with ``v1/traces`` appended (as the specification says)."""
    name = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    url = env.get(name, "").strip()
    if not url:
        name = "OTEL_EXPORTER_OTLP_ENDPOINT"
        base = env.get(name, "").strip()
        url = f"{base.rstrip('/')}/{TRACES_PATH}"
    try:
        parts = urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise TracingError(f"{name} must be an http:// or https:// URL ({redact_url(url)})")
    return url


def _sampler(env: Mapping[str, str]) -> tuple[str, float | None]:
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or DEFAULT_SAMPLER
    if name not in SAMPLERS:
        raise TracingError(f"OTEL_TRACES_SAMPLER={name} is not one of {', '.join(SAMPLERS)}")
    if not name.endswith("traceidratio"):
        return name, None
    text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not text:
        return name, 1.0
    try:
        ratio = float(text)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise TracingError(f"OTEL_TRACES_SAMPLER_ARG={text} must be a ratio from 0 to 1")
    return name, ratio


class _State:
    """The provider installed in this process (None: tracing is off) and its tracers."""

    def __init__(self) -> None:
        self.provider: TracerProvider | None = None
        self.tracers: dict[str, trace.Tracer] = {}
        # False when the sampler never samples a trace started here: a span with no parent
        # (remote or current) is then not made at all, nor are its children, and no context
        # is passed on (the SDK would make non-recording spans, ids and all, to no end).
        self.roots = True


_STATE = _State()


def active() -> bool:
    """Whether this process exports spans."""
    return _STATE.provider is not None


def install(provider: TracerProvider | None, *, roots: bool = True) -> None:
    """Make ``provider`` this process's (None: tracing off); ``roots`` false when its sampler
    never samples a trace started here (see :attr:`TracingSettings.samples_roots`)."""
    _STATE.provider = provider
    _STATE.tracers = {}
    _STATE.roots = roots


def build_provider(settings: TracingSettings, service_name: str) -> TracerProvider:
    """A provider exporting to ``settings.endpoint`` in batches (SDK imported only now).

    The exporter reads its other variables itself (OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT,
    _COMPRESSION, _CERTIFICATE…), the batch processor its OTEL_BSP_* ones, and the resource
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; ``service_name`` names the service when
    neither does.
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    assert settings.endpoint is not None
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    resource = resource.merge(Resource({SERVICE_VERSION: _version()}))
    # Stopped by started() (or whoever installed it), not at the interpreter's exit.
    provider = TracerProvider(
        sampler=build_sampler(settings), resource=resource, shutdown_on_exit=False
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
    return provider


def build_sampler(settings: TracingSettings) -> Sampler:
    """The SDK's sampler that ``OTEL_TRACES_SAMPLER`` and its argument name."""
    from opentelemetry.sdk.trace import sampling as samplers

    ratio = settings.sampler_arg if settings.sampler_arg is not None else 1.0
    sampler: samplers.Sampler
    if settings.sampler == "always_on":
        sampler = samplers.ALWAYS_ON
    elif settings.sampler == "always_off":
        sampler = samplers.ALWAYS_OFF
    elif settings.sampler == "traceidratio":
        sampler = samplers.TraceIdRatioBased(ratio)
    elif settings.sampler == "parentbased_always_off":
        sampler = samplers.ParentBased(samplers.ALWAYS_OFF)
    elif settings.sampler == "parentbased_traceidratio":
        sampler = samplers.ParentBasedTraceIdRatio(ratio)
    else:
        sampler = samplers.ParentBased(samplers.ALWAYS_ON)
    return sampler


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("arona-memory-gateway")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "0"


@contextlib.contextmanager
def started(env: Mapping[str, str], service_name: str) -> Iterator[None]:
    """Trace this process while the block runs, when the variables ask for it; the spans
    still queued are sent when it ends (within :data:`SHUTDOWN_TIMEOUT_S`)."""
    settings = TracingSettings.from_env(env)
    if settings.refused is not None:
        logger.warning("%s", settings.refused)
    if settings.endpoint is None:
        yield
        return
    if settings.samples_nothing:
        # No span would ever be recorded: the process runs as with tracing off (no SDK, no
        # spans, no trace context passed on), rather than make spans that nobody sees.
        logger.info(
            "OTEL_TRACES_SAMPLER=%s samples nothing: no spans are made and no trace context "
            "is passed on",
            settings.sampler,
        )
        yield
        return
    provider = build_provider(settings, service_name)
    install(provider, roots=settings.samples_roots)
    ratio = f" {settings.sampler_arg:g}" if settings.sampler_arg is not None else ""
    logger.info(
        "exporting traces to %s (OTLP/HTTP, sampler %s%s)",
        redact_url(settings.endpoint),
        settings.sampler,
        ratio,
    )
    try:
        yield
    finally:
        install(None)
        shutdown(provider)


def shutdown(provider: TracerProvider, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Send what is queued and stop exporting; a collector that does not take it within
    ``timeout_s`` does not hold up the stop (the rest is dropped, said in one line)."""
    # The SDK's own stop waits up to 30 s for its worker, and each batch up to the exporter's
    # timeout: bounded here, on a thread that the interpreter does not wait for.
    stopping = threading.Thread(target=provider.shutdown, name="trace-shutdown", daemon=True)
    stopping.start()
    stopping.join(timeout_s)
    if stopping.is_alive():
        logger.warning(
            "the last spans were not all exported within %g s (the collector did not take "
            "them); the rest are dropped",
            timeout_s,
        )


def flush() -> bool:
    """Export every span ended so far (blocks; never from an event loop that serves the
    collector); whether it all went."""
    provider = _STATE.provider
    return provider.force_flush() if provider is not None else True


class _NoSpan:
    """The span scope of tracing off: enters as the API's invalid span, does nothing."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return trace.INVALID_SPAN

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_NO_SPAN = _NoSpan()
# For a caller that traces some of its calls and not others: no span for a block, and the
# span that records nothing.
NO_SPAN: contextlib.AbstractContextManager[Span] = _NO_SPAN
INVALID_SPAN: Span = trace.INVALID_SPAN


class _Current:
    """A span made current for a block, ended after it (unless ``end`` is false: then its
    owner ends it, and judges how it went).

    An exception marks it ERROR with ``error.type`` (its class name) and no message: a message
    may quote what the user said.
    """

    __slots__ = ("_span", "_end", "_token")

    def __init__(self, span: Span, end: bool = True) -> None:
        self._span = span
        self._end = end
        self._token: object = None

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]
        if self._end:
            if exc is not None:
                failed(self._span, type(exc).__name__)
            self._span.end()


def failed(span: Span, error_type: str) -> None:
    """Mark ``span`` as failed with ``error_type`` (a fixed word, never free text); the first
    cause said stays."""
    if span.is_recording():
        span.set_status(StatusCode.ERROR)
        attributes = getattr(span, "attributes", None)
        if not attributes or "error.type" not in attributes:
            span.set_attribute("error.type", error_type)


def current(span: Span) -> contextlib.AbstractContextManager[Span]:
    """Make a span started with :meth:`Tracer.start` current for a block (it is neither ended
    nor marked by an exception: its owner does both)."""
    if not span.is_recording() and not span.get_span_context().is_valid:
        return _NO_SPAN
    return _Current(span, end=False)


class Tracer:
    """The spans of one layer (its name is the instrumentation scope the backend shows)."""

    __slots__ = ("scope",)

    def __init__(self, scope: str) -> None:
        self.scope = scope

    def _tracer(self, parent: otel_context.Context | None = None) -> trace.Tracer | None:
        """This layer's tracer, or None when no span is to be made (tracing off, or a span
        that would start a trace the sampler never samples)."""
        state = _STATE
        if state.provider is None:
            return None
        if (
            not state.roots
            and parent is None
            and not trace.get_current_span().get_span_context().is_valid
        ):
            return None
        tracer = state.tracers.get(self.scope)
        if tracer is None:
            tracer = state.tracers[self.scope] = state.provider.get_tracer(self.scope, _version())
        return tracer

    def span(
        self,
        name: str,
        *,
        kind: SpanKind = INTERNAL,
        parent: otel_context.Context | None = None,
        attributes: Attributes | None = None,
        links: Sequence[Link] = (),
    ) -> contextlib.AbstractContextManager[Span]:
        """A span current for a ``with`` block and ended after it; the child of ``parent``
        (an extracted remote context) or else of the current span."""
        tracer = self._tracer(parent)
        if tracer is None:
            return _NO_SPAN
        span = tracer.start_span(
            name,
            context=parent,
            kind=kind,
            attributes=attributes,
            links=links,
            record_exception=False,
            set_status_on_exception=False,
        )
        return _Current(span)

    def start(
        self,
        name: str,
        *,
        kind: SpanKind = INTERNAL,
        attributes: Attributes | None = None,
    ) -> Span:
        """A span the caller ends itself (one that outlives a block: a stream's); not made
        current (see :func:`current`)."""
        tracer = self._tracer()
        if tracer is None:
            return trace.INVALID_SPAN
        return tracer.start_span(
            name,
            kind=kind,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )


def inject(carrier: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``carrier``."""
    if _STATE.provider is not None:
        _PROPAGATOR.inject(carrier)


def extract(carrier: Mapping[str, Any]) -> otel_context.Context | None:
    """The remote parent in ``carrier`` (lower-case keys; values that are not strings are
    ignored), or None (tracing off, or no valid ``traceparent``: then a span starts a trace
    of its own)."""
    if _STATE.provider is None:
        return None
    traceparent = carrier.get(TRACEPARENT)
    if not isinstance(traceparent, str):
        return None
    headers = {TRACEPARENT: traceparent}
    tracestate = carrier.get(TRACESTATE)
    if isinstance(tracestate, str):
        headers[TRACESTATE] = tracestate
    parent = _PROPAGATOR.extract(headers)
    if not trace.get_current_span(parent).get_span_context().is_valid:
        return None
    return parent


def context_of(carrier: Mapping[str, Any]) -> otel_context.Context | None:
    """:func:`extract` when tracing is on; the caller need not build ``carrier`` otherwise."""
    return extract(carrier) if _STATE.provider is not None else None


def current_span() -> Span:
    """The span current here (the API's invalid span when none is, or tracing is off)."""
    if _STATE.provider is None:
        return trace.INVALID_SPAN
    return trace.get_current_span()


@contextlib.contextmanager
def within(parent: otel_context.Context | None) -> Iterator[None]:
    """``parent`` (an extracted remote context) current in the block; nothing when None."""
    if parent is None:
        yield
        return
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


_R = TypeVar("_R")


def carried(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn`` to run on another thread with this context (and so this span) current there;
    ``fn`` itself when tracing is off."""
    if _STATE.provider is None:
        return fn
    return functools.partial(contextvars.copy_context().run, fn)


def untraced_context() -> contextvars.Context:
    """A copy of the current context with no span current: for a background task started
    from a request (a replay), whose spans start traces of their own instead of joining it."""
    context = contextvars.copy_context()
    if _STATE.provider is not None:
        context.run(otel_context.attach, otel_context.Context())
    return context


def link_to_current() -> Sequence[Link]:
    """A link to the current span (none when tracing is off or nothing is current)."""
    if _STATE.provider is None:
        return ()
    context = trace.get_current_span().get_span_context()
    return (Link(context),) if context.is_valid else ()


def headers_carrier(headers: Iterable[tuple[Any, Any]]) -> dict[str, str]:
    """The trace context headers of an ASGI header list or of gRPC metadata."""
    carrier: dict[str, str] = {}
    for key, value in headers:
        name = key.decode("latin-1") if isinstance(key, bytes) else str(key)
        if name in (TRACEPARENT, TRACESTATE):
            carrier[name] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return carrier
