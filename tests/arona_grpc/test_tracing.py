"""What the standard ``OTEL_*`` variables turn on, and what they do not."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from arona_common import tracing
from arona_common.tracing import TracingSettings, build_provider
from arona_grpc.philia import PhiliaClient
from tests.support.fake_philia import HANDSHAKE, QUERY, STORE, FakePhilia, Step
from tests.support.otlp_receiver import spans_in_memory

ENDPOINT = "http://127.0.0.1:4318"


def test_without_an_endpoint_nothing_is_installed_and_spans_cost_nothing() -> None:
    assert TracingSettings.from_env({}).endpoint is None
    with tracing.started({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, "x"):
        assert_tracing_off()


def assert_tracing_off() -> None:
    """Nothing installed; a span is the API's invalid one: nothing recorded, nothing carried."""
    assert not tracing.active()
    with tracing.Tracer("t").span("turn") as span:
        assert not span.is_recording()
        carrier: dict[str, str] = {}
        tracing.inject(carrier)
        assert carrier == {}


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_SDK_DISABLED": "true"},
        {"OTEL_SDK_DISABLED": "TRUE"},
        {"OTEL_TRACES_EXPORTER": "none"},
    ],
)
def test_an_endpoint_is_ignored_when_the_sdk_is_disabled(env: dict[str, str]) -> None:
    settings = TracingSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, **env})
    assert settings.endpoint is None
    assert settings.refused is None


def test_the_base_endpoint_gets_the_traces_path_and_the_traces_endpoint_is_taken_as_it_is() -> None:
    base = TracingSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT + "/"})
    assert base.endpoint == ENDPOINT + "/v1/traces"
    assert base.sampler == "parentbased_always_on"
    own = TracingSettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector.example/otlp/traces",
        }
    )
    assert own.endpoint == "https://collector.example/otlp/traces"


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc is not supported: traces are exported over "
            "OTLP/HTTP (http/protobuf, a collector's port 4318): no traces are exported",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json is not supported",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "zipkin"},
            "OTEL_TRACES_EXPORTER=zipkin is not supported (only otlp, or none)",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "sometimes"},
            "OTEL_TRACES_SAMPLER=sometimes is not one of always_on, always_off, traceidratio, "
            "parentbased_always_on, parentbased_always_off, parentbased_traceidratio",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG=2 must be a ratio from 0 to 1",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"},
            "OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// or https:// URL",
        ),
    ],
)
def test_a_setting_that_cannot_be_honoured_turns_tracing_off_with_one_warning(
    env: dict[str, str], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="arona_common.tracing"),
        tracing.started({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, **env}, "svc"),
    ):
        assert not tracing.active()
    [record] = caplog.records
    assert said in record.getMessage()


def test_the_sampler_and_its_ratio() -> None:
    settings = TracingSettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        }
    )
    assert (settings.sampler, settings.sampler_arg) == ("parentbased_traceidratio", 0.25)
    provider = build_provider(settings, "svc")
    try:
        assert "TraceIdRatioBased{0.25}" in provider.sampler.get_description()
    finally:
        provider.shutdown()


def test_the_service_is_named_by_the_command_unless_the_variables_name_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = TracingSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT})
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    provider = build_provider(settings, tracing.STORE_SERVICE)
    assert provider.resource.attributes["service.name"] == "arona-memory-store"
    provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "memory-eu-1")
    provider = build_provider(settings, tracing.STORE_SERVICE)
    assert provider.resource.attributes["service.name"] == "memory-eu-1"
    provider.shutdown()


def test_the_endpoint_is_logged_without_its_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint = "http://user:pa55word@127.0.0.1:9/v1/traces?token=t0ken"
    with (
        caplog.at_level(logging.INFO, logger="arona_common.tracing"),
        tracing.started({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}, "svc"),
    ):
        assert tracing.active()
    assert not tracing.active()
    [line] = [r.getMessage() for r in caplog.records if "exporting traces" in r.getMessage()]
    assert line == (
        "exporting traces to http://***@127.0.0.1:9/v1/traces?token=*** "
        "(OTLP/HTTP, sampler parentbased_always_on)"
    )


def test_a_collector_that_never_answers_does_not_hold_up_the_stop(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each export request gives up after 1 s: the stop below, cut at 0.5 s, leaves it behind,
    # and the test waits for it before the port goes (no export may reach another test).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    # Listening, never accepting: the export's request waits for an answer that never comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        settings = TracingSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": url})
        provider = build_provider(settings, "x")
        tracing.install(provider)
        try:
            with tracing.Tracer("t").span("turn") as span:
                assert span.is_recording()
        finally:
            tracing.install(None)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="arona_common.tracing"):
            tracing.shutdown(provider, timeout_s=0.5)
        assert time.monotonic() - started < 2.0
        for left in [t for t in threading.enumerate() if t.name == "trace-shutdown"]:
            left.join(10)
            assert not left.is_alive()
    said = [r.getMessage() for r in caplog.records if r.name == "arona_common.tracing"]
    assert said == [
        "the last spans were not all exported within 0.5 s (the collector did not take them); "
        "the rest are dropped"
    ]


@pytest.fixture
def recorded() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, its spans kept in memory."""
    with spans_in_memory() as exporter:
        yield exporter


@pytest.mark.asyncio
async def test_philia_is_sent_only_the_params_of_the_wire_protocol(
    recorded: InMemorySpanExporter,
) -> None:
    async with FakePhilia(token="t0k3n") as fake:
        client = PhiliaClient(fake.url, "t0k3n", timeout_s=5.0)
        try:
            with tracing.Tracer("t").span("turn"):
                await client.query("tea", 5)
                await client.store("I prefer oolong tea")
        finally:
            await client.aclose()
        [query] = fake.frames_of(QUERY)
        [store] = fake.frames_of(STORE)
    # Its handshake lists no trace_context capability: nothing it might refuse.
    assert query["params"] == {"query": "tea", "limit": 5}
    assert store["params"] == {"text": "I prefer oolong tea", "node_type": "episode"}
    # The calls are spans all the same, named by method and by where the store listens.
    calls = [s for s in recorded.get_finished_spans() if s.name.startswith("Sync.")]
    assert [(s.name, s.kind.name) for s in calls] == [(QUERY, "CLIENT"), (STORE, "CLIENT")]
    assert calls[0].attributes == {
        "rpc.system": "jsonrpc",
        "rpc.method": QUERY,
        "server.address": "127.0.0.1",
        "server.port": fake.port,
    }


@pytest.mark.asyncio
async def test_a_store_that_takes_trace_context_gets_the_calls_traceparent(
    recorded: InMemorySpanExporter,
) -> None:
    says_so = {"ok": True, "error": None, "session_id": "s-1", "reconnect": False}
    async with FakePhilia(token="t0k3n") as fake:
        fake.script(HANDSHAKE, Step(result={**says_so, "capabilities": ["trace_context"]}))
        client = PhiliaClient(fake.url, "t0k3n", timeout_s=5.0)
        try:
            with tracing.Tracer("t").span("turn"):
                await client.query("tea", 5)
        finally:
            await client.aclose()
        [query] = fake.frames_of(QUERY)
    [call] = [s for s in recorded.get_finished_spans() if s.name == QUERY]
    context = call.get_span_context()
    ids = f"{context.trace_id:032x}-{context.span_id:016x}"
    assert query["params"] == {
        "query": "tea",
        "limit": 5,
        "traceparent": f"00-{ids}-{context.trace_flags:02x}",
    }


@pytest.mark.parametrize(
    "sampler",
    [
        {"OTEL_TRACES_SAMPLER": "always_off"},
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
    ],
)
def test_a_sampler_that_never_samples_is_tracing_off(
    sampler: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    name = sampler["OTEL_TRACES_SAMPLER"]
    with (
        caplog.at_level(logging.INFO, logger="arona_common.tracing"),
        tracing.started({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, **sampler}, "svc"),
    ):
        assert_tracing_off()
    said = [r.getMessage() for r in caplog.records if r.name == "arona_common.tracing"]
    assert said == [
        f"OTEL_TRACES_SAMPLER={name} samples nothing: no spans are made and no trace context "
        "is passed on"
    ]


def test_parentbased_always_off_traces_only_what_a_remote_parent_sampled() -> None:
    sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    scope = tracing.Tracer("t")
    with spans_in_memory("parentbased_always_off") as exporter:
        # A turn nobody sent a trace for: no span, no child, nothing passed on.
        with scope.span("turn", kind=tracing.SERVER) as span:
            assert not span.get_span_context().is_valid
            with scope.span("recall", kind=tracing.CLIENT) as child:
                assert not child.get_span_context().is_valid
                carrier: dict[str, str] = {}
                tracing.inject(carrier)
                assert carrier == {}
        # A caller's unsampled trace is carried on, unsampled, with its trace id.
        parent = tracing.extract({"traceparent": unsampled})
        with scope.span("turn", kind=tracing.SERVER, parent=parent) as span:
            assert not span.is_recording()
            carrier = {}
            tracing.inject(carrier)
            assert carrier["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
            assert carrier["traceparent"].endswith("-00")
        # A caller's sampled trace is recorded, children too.
        parent = tracing.extract({"traceparent": sampled})
        with scope.span("turn", kind=tracing.SERVER, parent=parent) as span:
            with scope.span("recall", kind=tracing.CLIENT):
                pass
        names = sorted(s.name for s in exporter.get_finished_spans())
        assert names == ["recall", "turn"]
        trace_ids = {s.context.trace_id for s in exporter.get_finished_spans()}
        assert trace_ids == {0x0AF7651916CD43DD8448EB211C80319C}
