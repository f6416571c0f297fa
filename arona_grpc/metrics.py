"""Prometheus metrics of the gRPC service, and the exposition pieces both layers share.

Declared here (names, help, buckets), recorded where the event happens: Philia calls by
the Philia client (:meth:`ServiceMetrics.philia_call`), replayed episodes by the replay, calls
made again on another store by the store pool (:meth:`ServiceMetrics.store_failover`); the
breaker state, the outbox's depth, bytes, drops and dead letters, the Philia reconnects and
which stores are up are read from the running service when scraped, so they cost nothing per
turn.

Metric objects are made per instance and registered nowhere globally, so several services
(tests) can live in one process. :class:`OwnMetrics` is the collector of one layer: in one
process it reads the layer's metric objects; in ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set before the first import, in every process) it reads the
shared directory and keeps only the layer's own metric names, so the HTTP listener and the
gRPC service's listener never expose each other's series even when their processes share
the directory.

``ARONA_GRPC_METRICS_PORT`` starts :func:`start_metrics_server`: ``prometheus_client``'s
own HTTP listener, in a daemon thread, serving ``/metrics`` of the gRPC service.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from arona_common.storage import StorageFaults
from arona_grpc.breaker import BreakerState, CircuitBreaker

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

PHILIA_METHODS = ("query", "store", "delete")
# The gRPC service's files (arona_common.storage).
SERVICE_STORAGE_PARTS = ("outbox", "episode index")
PHILIA_OUTCOMES = ("ok", "error", "timeout", "cancelled")
# Seconds: from half a millisecond (a loopback call) to the longest RPC timeout one expects.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def multiprocess_dir() -> str | None:
    """The shared directory of multiprocess mode, or None in one process."""
    return os.environ.get(MULTIPROC_ENV) or None


class OwnMetrics(Collector):
    """A layer's own metrics, from its objects or from the multiprocess directory."""

    def __init__(
        self,
        metrics: Sequence[MetricWrapperBase],
        live: Callable[[], Iterable[Metric]] | None = None,
    ) -> None:
        self._metrics = tuple(metrics)
        self._names = frozenset(family.name for m in metrics for family in m.describe())
        self._live = live
        directory = multiprocess_dir()
        self._shared = (
            MultiProcessCollector(None, directory)  # type: ignore[no-untyped-call]
            if directory
            else None
        )

    def collect(self) -> Iterable[Metric]:
        if self._shared is not None:
            for family in self._shared.collect():  # type: ignore[no-untyped-call]
                if family.name in self._names:
                    yield family
        else:
            for metric in self._metrics:
                yield from metric.collect()
        if self._live is not None:
            yield from self._live()


class PhiliaMetrics(Protocol):
    """What the Philia client records."""

    def philia_call(self, method: str, outcome: str, seconds: float) -> None: ...


class OutboxCounts(Protocol):
    """What the metrics read from the writeback outbox."""

    @property
    def depth(self) -> int: ...

    @property
    def dropped(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    @property
    def dead_letters(self) -> int: ...


class PhiliaLink(Protocol):
    """What the metrics read from the Philia client."""

    @property
    def connects(self) -> int: ...


class StoreState(Protocol):
    """What the metrics read of one store when ``ARONA_MEMORY_URL`` names several."""

    @property
    def url(self) -> str: ...

    @property
    def up(self) -> bool: ...


class WatchedService(Protocol):
    """What the metrics read from the running service when scraped (``MemoryDomain``). Said
    here rather than imported, so that this module stays below the client and the service
    that record into it."""

    @property
    def breaker(self) -> CircuitBreaker: ...

    @property
    def outbox(self) -> OutboxCounts | None: ...

    @property
    def client(self) -> PhiliaLink | None: ...

    @property
    def storage(self) -> StorageFaults: ...

    def stores(self) -> Sequence[StoreState]: ...


STORAGE_FAILING = "arona_storage_write_failing"


def storage_gauge(storage: StorageFaults, parts: Sequence[str]) -> GaugeMetricFamily:
    """``arona_storage_write_failing{part}``: 1 while a part's writes fail, else 0 (read from
    ``storage`` when scraped, which first tries the failing parts' directories again)."""
    storage.recheck()
    gauge = GaugeMetricFamily(
        STORAGE_FAILING,
        "1 while writes to this part's file fail (a full disk, a read-only file system, "
        "permissions), else 0.",
        labels=("part",),
    )
    for part in parts:
        gauge.add_metric((part,), 1.0 if storage.failing(part) else 0.0)
    return gauge


class ServiceMetrics:
    """The gRPC service's metrics; :attr:`collector` exposes them."""

    def __init__(self) -> None:
        self._calls = Counter(
            "arona_philia_calls",
            "Calls to Philia by method (query, store, delete) and outcome (ok, error, timeout, "
            "cancelled: the caller stopped waiting).",
            ("method", "outcome"),
            registry=None,
        )
        self._seconds = Histogram(
            "arona_philia_call_seconds",
            "Time of one call to Philia (connect and handshake included when it needed one).",
            ("method",),
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        # Resolved once: a call then costs one dictionary look-up per metric.
        self._call_children = {
            (m, o): self._calls.labels(m, o) for m in PHILIA_METHODS for o in PHILIA_OUTCOMES
        }
        self._seconds_children = {m: self._seconds.labels(m) for m in PHILIA_METHODS}
        self._replayed = Counter(
            "arona_outbox_replayed",
            "Episodes the outbox replay stored in Philia (by this process).",
            registry=None,
        )
        self._failovers = Counter(
            "arona_memory_store_failovers",
            "Calls to a store (query, store, delete) that failed because of the store and were "
            "made again on another (ARONA_MEMORY_URL naming several).",
            ("method",),
            registry=None,
        )
        self._failover_children = {m: self._failovers.labels(m) for m in PHILIA_METHODS}
        self._domain: WatchedService | None = None
        self.collector = OwnMetrics(
            (self._calls, self._seconds, self._replayed, self._failovers), self._state
        )

    def watch(self, domain: WatchedService) -> None:
        """Report ``domain``'s breaker, outbox and Philia link when scraped."""
        self._domain = domain

    def philia_call(self, method: str, outcome: str, seconds: float) -> None:
        self._call_children[method, outcome].inc()
        self._seconds_children[method].observe(seconds)

    def outbox_replayed(self, count: int) -> None:
        self._replayed.inc(count)

    def store_failover(self, method: str) -> None:
        self._failover_children[method].inc()

    def registry(self) -> CollectorRegistry:
        """A registry holding only these metrics (the gRPC service's own listener)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        return registry

    def _state(self) -> Iterable[Metric]:
        domain = self._domain
        if domain is None:
            return
        breaker = GaugeMetricFamily(
            "arona_memory_breaker_state",
            "The memory circuit breaker: 1 for its current state, 0 for the others.",
            labels=("state",),
        )
        current = domain.breaker.state
        for state in BreakerState:
            breaker.add_metric((state.value,), 1.0 if state is current else 0.0)
        yield breaker
        outbox = domain.outbox
        yield GaugeMetricFamily(
            "arona_outbox_depth",
            "Episodes waiting in the writeback outbox for Philia.",
            value=float(outbox.depth if outbox is not None else 0),
        )
        yield CounterMetricFamily(
            "arona_outbox_dropped",
            "Episodes dropped from the full outbox (oldest first), as the outbox counts them.",
            value=float(outbox.dropped if outbox is not None else 0),
        )
        yield GaugeMetricFamily(
            "arona_outbox_bytes",
            "Bytes the episodes waiting in the outbox take (ARONA_MEMORY_OUTBOX_MAX_MB bounds it).",
            value=float(outbox.bytes if outbox is not None else 0),
        )
        yield CounterMetricFamily(
            "arona_outbox_dead_letters",
            "Episodes Philia refused for what they are (too large, invalid), moved to the "
            "dead-letter list, as the outbox counts them.",
            value=float(outbox.dead_letters if outbox is not None else 0),
        )
        yield storage_gauge(domain.storage, SERVICE_STORAGE_PARTS)
        client = domain.client
        yield CounterMetricFamily(
            "arona_philia_reconnects",
            "Connections to Philia opened after the first one (each follows a lost link).",
            value=float(max(client.connects - 1, 0) if client is not None else 0),
        )
        stores = domain.stores()
        if stores:
            up = GaugeMetricFamily(
                "arona_memory_store_up",
                "Each store ARONA_MEMORY_URL names (when it names several): 1 while it is up, "
                "0 while it is down; labelled by its place in the list (from 1) and its "
                "redacted URL.",
                labels=("store", "url"),
            )
            for number, store in enumerate(stores, 1):
                up.add_metric((str(number), store.url), 1.0 if store.up else 0.0)
            yield up


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """``prometheus_client``'s HTTP listener on ``host:port`` (0: a free port), in a thread."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
