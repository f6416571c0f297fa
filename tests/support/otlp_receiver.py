"""An OTLP/HTTP trace receiver for tests: real HTTP on ``127.0.0.1`` port 0.

It answers ``POST /v1/traces`` as a collector does, decodes each body with the official
``opentelemetry-proto`` messages (``ExportTraceServiceRequest``) and keeps every span, with the
service and instrumentation scope it came from, and every raw body (so a test can search the
whole export for text that must never be in it). Point a gateway at it with
``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.url>``.

Tests never sleep: :meth:`OtlpReceiver.wait_for` returns once a condition on the spans holds
(each export wakes it). :meth:`OtlpReceiver.tree` draws one trace as indented span names, so
a test states the shape of a turn in one assertion::

    async with OtlpReceiver() as receiver:
        ...
        [root] = await receiver.wait_for(lambda spans: roots(spans, "POST /v1/chat/completions"))
        assert receiver.tree(root.trace_id) == "POST /v1/chat/completions\\n  ..."
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import types
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from arona_common import tracing
from arona_common.tracing import GATEWAY_SERVICE, TracingSettings, build_provider

T = TypeVar("T")

KINDS = {
    Span.SPAN_KIND_UNSPECIFIED: "unspecified",
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if which is None:
        return None
    return getattr(value, which)


def _attributes(pairs: Sequence[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: str
    trace_id: str
    span_id: str
    # "" for a root span.
    parent_id: str
    service: str
    scope: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    # (trace id, span id) of each link.
    links: tuple[tuple[str, str], ...]
    events: tuple[str, ...]
    # "unset", "ok" or "error".
    status: str

    @property
    def failed(self) -> bool:
        return self.status == "error"


_STATUS = {
    Status.STATUS_CODE_UNSET: "unset",
    Status.STATUS_CODE_OK: "ok",
    Status.STATUS_CODE_ERROR: "error",
}


def decode(body: bytes) -> list[ReceivedSpan]:
    """Every span of one ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        kind=KINDS[span.kind],
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        service=str(resource.get("service.name", "")),
                        scope=scope_spans.scope.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        links=tuple(
                            (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                        ),
                        events=tuple(event.name for event in span.events),
                        status=_STATUS[span.status.code],
                    )
                )
    return spans


def named(spans: Sequence[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    """The spans called ``name``, in the order they started."""
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


@dataclass
class OtlpReceiver:
    """Keeps every span exported to it; ``url`` is the base an exporter is given."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    # Every export's body as it came (decompressed).
    bodies: list[bytes] = field(default_factory=list)
    url: str = ""
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _runner: web.AppRunner | None = None

    async def __aenter__(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="OTLP/HTTP bodies are protobuf here\n")
        spans = decode(body)
        async with self._changed:
            self.bodies.append(body)
            self.spans.extend(spans)
            self._changed.notify_all()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def wait_for(
        self, found: Callable[[list[ReceivedSpan]], T | None], timeout_s: float = 10.0
    ) -> T:
        """The first truthy ``found(spans)``, waiting for exports until there is one."""
        async with asyncio.timeout(timeout_s), self._changed:
            while True:
                result = found(self.spans)
                if result:
                    return result
                await self._changed.wait()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def tree(self, trace_id: str, *, show: Callable[[ReceivedSpan], str] | None = None) -> str:
        """The trace as indented lines, children in the order they started: each line
        ``show(span)``, by default the span's name."""
        spans = self.trace(trace_id)
        ids = {s.span_id for s in spans}
        children: dict[str, list[ReceivedSpan]] = {}
        for span in spans:
            parent = span.parent_id if span.parent_id in ids else ""
            children.setdefault(parent, []).append(span)
        shown = show or (lambda s: s.name)
        lines: list[str] = []

        def walk(parent: str, depth: int) -> None:
            for span in sorted(children.get(parent, ()), key=lambda s: s.start_ns):
                lines.append("  " * depth + shown(span))
                walk(span.span_id, depth + 1)

        walk("", 0)
        return "\n".join(lines)


@contextlib.asynccontextmanager
async def traced_here(
    receiver: OtlpReceiver, service: str = GATEWAY_SERVICE
) -> AsyncIterator[None]:
    """Trace this (test) process into ``receiver`` for a block, every trace sampled, as
    ``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.url> OTEL_TRACES_SAMPLER=always_on`` would."""
    settings = TracingSettings.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_TRACES_SAMPLER": "always_on"}
    )
    provider = build_provider(settings, service)
    tracing.install(provider)
    try:
        yield
    finally:
        tracing.install(None)
        # Off the loop: the export it waits for is served by this loop.
        await asyncio.to_thread(tracing.shutdown, provider)


async def exported() -> None:
    """Export every span this process has ended so far (the receiver's loop keeps serving)."""
    assert await asyncio.to_thread(tracing.flush)


@contextlib.contextmanager
def spans_in_memory(sampler: str | None = None) -> Iterator[Any]:
    """Tracing on in this process (:func:`arona_common.tracing.install`), its spans kept by an
    ``InMemorySpanExporter`` (yielded); off again after. ``sampler`` names the
    ``OTEL_TRACES_SAMPLER`` to sample with (the SDK's default when None)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    if sampler is None:
        provider = TracerProvider()
        roots = True
    else:
        settings = TracingSettings(None, sampler)
        provider = TracerProvider(sampler=tracing.build_sampler(settings))
        roots = settings.samples_roots
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, roots=roots)
    try:
        yield exporter
    finally:
        tracing.install(None)
        provider.shutdown()
