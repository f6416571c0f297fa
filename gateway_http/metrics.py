"""Prometheus metrics of the HTTP layer: declared here, recorded where the event happens.

- turns, by surface, memory state and outcome (recorded by each surface when its turn ends);
- the gateway's own time per completed turn (total minus the upstream call), recall time
  and upstream time to first byte (recorded by the turn pipeline);
- writebacks by outcome (recorded by the memory client);
- every attempt the router makes on a backend, by backend and outcome (recorded by the router,
  :mod:`gateway_http.upstream.routing`, when the attempt ends);
- tokens of metered turns by kind and backend, turns refused over budget and usage records
  given up (recorded by the usage meter and the budgets, :mod:`gateway_http.usage`);
- MCP tool calls by tool and outcome (recorded by :mod:`gateway_http.mcp.server` when each
  call ends).

Every label value is one of a few fixed words (no user text, ids or scopes) or a backend's
name from the configuration, never a principal (one series per caller would grow without
bound), and every label combination is resolved once, so recording costs a dictionary look-up
and an addition. ``ARONA_METRICS=false`` gives :class:`NoMetrics`, whose methods do nothing.
Exposition (``GET /metrics``) goes through :class:`~arona_grpc.metrics.OwnMetrics`, which
also covers ``prometheus_client``'s multiprocess mode (several HTTP worker processes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from arona_common.storage import StorageFaults
from arona_grpc.metrics import LATENCY_BUCKETS, OwnMetrics, storage_gauge

logger = logging.getLogger(__name__)

# This process's files (arona_common.storage).
HTTP_STORAGE_PARTS = ("journal",)
SURFACES = ("rest", "rest_stream", "rpc", "rpc_ws", "responses", "responses_stream")
MEMORY_STATES = ("enabled", "disabled", "offline")
OUTCOMES = ("ok", "upstream_error", "client_error", "cancelled")
WRITEBACK_OUTCOMES = ("stored", "not_stored", "failed")
# prompt and completion as the upstream reported them (or as counted when it did not);
# memory: the memory section's share of the prompt.
TOKEN_KINDS = ("prompt", "completion", "memory")
# How an attempt on a backend ended: answered (its whole reply, or its stream to the end);
# connect_error (refused, reset, unknown host: no answer began); timeout (nothing within the
# backend's timeout); status_429, status_5xx, status_4xx (the upstream's error status); broken
# (the connection broke, or the stream ended early); cancelled (the client left, or the turn
# stopped for a reason not the upstream's); other (a reply that is not a valid answer, an
# error event). connect_error, timeout, status_429, status_5xx and broken (before the first
# chunk) are the failures the router falls back from.
ATTEMPT_OUTCOMES = (
    "answered",
    "connect_error",
    "timeout",
    "status_429",
    "status_5xx",
    "status_4xx",
    "broken",
    "cancelled",
    "other",
)
# The MCP tools (gateway_http.mcp.tools.TOOL_NAMES) and how a call of one ended: ok;
# client_error (bad arguments, nothing to store); memory_error (memory offline, unavailable or
# not configured); internal (a bug).
MCP_TOOLS = ("search_memories", "add_memory", "list_memories", "delete_memory", "forget_memories")
MCP_OUTCOMES = ("ok", "client_error", "memory_error", "internal")
# The gateway's own time per turn: tens of microseconds to tens of milliseconds.
OVERHEAD_BUCKETS = (
    0.0001,
    0.00025,
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
)


class GatewayMetrics:
    """The HTTP layer's metrics; :meth:`registry` exposes them."""

    def __init__(self, extra: Iterable[Collector] = ()) -> None:
        """``extra``: other collectors shown on the same ``/metrics`` (the gRPC service's,
        when it runs in this process)."""
        self._extra = tuple(extra)
        turns = Counter(
            "arona_turns",
            "Chat turns by surface (rest, rest_stream, rpc, rpc_ws, responses, responses_stream), "
            "memory state "
            "(enabled, disabled, offline) and outcome (ok, upstream_error, client_error, "
            "cancelled).",
            ("surface", "memory", "outcome"),
            registry=None,
        )
        overhead = Histogram(
            "arona_turn_overhead_seconds",
            "The gateway's own time per completed turn: its whole time minus the upstream call.",
            ("surface",),
            buckets=OVERHEAD_BUCKETS,
            registry=None,
        )
        recall = Histogram(
            "arona_recall_seconds",
            "Time a turn spent recalling memories, by the memory state it got.",
            ("memory",),
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        first_byte = Histogram(
            "arona_upstream_first_byte_seconds",
            "Time from sending a turn upstream to its answer (whole reply) or first chunk "
            "(streamed), for answered turns.",
            ("surface",),
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        writebacks = Counter(
            "arona_writebacks",
            "Turns written back to memory by outcome (stored; not_stored: memory or writeback "
            "off, or nothing to store; failed: the memory service refused or was unreachable, "
            "the gRPC service keeps it in its outbox when it can).",
            ("outcome",),
            registry=None,
        )
        attempts = Counter(
            "arona_upstream_attempts",
            "Attempts on a backend by backend and outcome (answered, connect_error, timeout, "
            "status_429, status_5xx, status_4xx, broken, cancelled, other), counted when each "
            "ends: a turn that fell back counts one attempt on each backend it asked.",
            ("backend", "outcome"),
            registry=None,
        )
        tokens = Counter(
            "arona_tokens",
            "Tokens of metered turns by kind (prompt, completion: as the upstream reported them, "
            "or counted by the gateway when it did not; memory: the memory section's share of "
            "the prompt) and backend.",
            ("kind", "backend"),
            registry=None,
        )
        budget_refusals = Counter(
            "arona_budget_refusals",
            "Turns refused before any upstream call because their principal's monthly budget "
            "is used up.",
            registry=None,
        )
        usage_dropped = Counter(
            "arona_usage_dropped",
            "Usage records given up: the usage store stayed unreachable while more turns "
            "ended than the meter keeps waiting.",
            registry=None,
        )
        mcp_calls = Counter(
            "arona_mcp_tool_calls",
            "MCP tool calls by tool and outcome (ok, client_error, memory_error, internal).",
            ("tool", "outcome"),
            registry=None,
        )
        self._mcp_calls = {(t, o): mcp_calls.labels(t, o) for t in MCP_TOOLS for o in MCP_OUTCOMES}
        self._attempts_counter = attempts
        self._attempts: dict[tuple[str, str], Counter] = {}
        self._tokens_counter = tokens
        self._tokens: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._budget_refusals = budget_refusals
        self._usage_dropped = usage_dropped
        self._turns = {
            (s, m, o): turns.labels(s, m, o)
            for s in SURFACES
            for m in MEMORY_STATES
            for o in OUTCOMES
        }
        self._overhead = {s: overhead.labels(s) for s in SURFACES}
        self._recall = {m: recall.labels(m) for m in MEMORY_STATES}
        self._first_byte = {s: first_byte.labels(s) for s in SURFACES}
        self._writebacks = {o: writebacks.labels(o) for o in WRITEBACK_OUTCOMES}
        self._storage: StorageFaults | None = None
        self.collector = OwnMetrics(
            (
                turns,
                overhead,
                recall,
                first_byte,
                writebacks,
                attempts,
                tokens,
                budget_refusals,
                usage_dropped,
                mcp_calls,
            ),
            self._live,
        )

    def watch_storage(self, storage: StorageFaults) -> None:
        """Show whether this process's files (its journal) can be written, when scraped."""
        self._storage = storage

    def _live(self) -> Iterable[Metric]:
        if self._storage is not None:
            yield storage_gauge(self._storage, HTTP_STORAGE_PARTS)

    def registry(self) -> CollectorRegistry:
        """A registry holding these metrics (and the extra collectors)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        for collector in self._extra:
            registry.register(collector)
        return registry

    def turn(self, surface: str, memory: str, outcome: str) -> None:
        self._turns[surface, memory, outcome].inc()
        logger.debug("chat turn on %s: memory %s, %s", surface, memory, outcome)

    def overhead(self, surface: str, seconds: float) -> None:
        self._overhead[surface].observe(max(seconds, 0.0))

    def recall(self, memory: str, seconds: float) -> None:
        self._recall[memory].observe(seconds)

    def first_byte(self, surface: str, seconds: float) -> None:
        self._first_byte[surface].observe(seconds)

    def writeback(self, outcome: str) -> None:
        self._writebacks[outcome].inc()

    def attempt(self, backend: str, outcome: str) -> None:
        """One attempt on ``backend`` ended with ``outcome`` (one of :data:`ATTEMPT_OUTCOMES`)."""
        child = self._attempts.get((backend, outcome))
        if child is None:
            # Backends are few and named by the configuration, outcomes a fixed set.
            child = self._attempts[backend, outcome] = self._attempts_counter.labels(
                backend, outcome
            )
        child.inc()

    def tokens(self, backend: str, prompt: int, completion: int, memory: int) -> None:
        children = self._tokens.get(backend)
        if children is None:
            # Backends are few and named by the configuration: one set of children each.
            children = self._tokens[backend] = (
                self._tokens_counter.labels("prompt", backend),
                self._tokens_counter.labels("completion", backend),
                self._tokens_counter.labels("memory", backend),
            )
        for child, count in zip(children, (prompt, completion, memory), strict=True):
            if count:
                child.inc(count)

    def budget_refused(self) -> None:
        self._budget_refusals.inc()

    def usage_dropped(self, count: int) -> None:
        self._usage_dropped.inc(count)

    def mcp_tool_call(self, tool: str, outcome: str) -> None:
        self._mcp_calls[tool, outcome].inc()


class NoMetrics(GatewayMetrics):
    """``ARONA_METRICS=false``: nothing is recorded (the turn's debug line is still logged)."""

    def __init__(self) -> None:
        pass

    def watch_storage(self, storage: StorageFaults) -> None:
        pass

    def registry(self) -> CollectorRegistry:
        return CollectorRegistry(auto_describe=False)

    def turn(self, surface: str, memory: str, outcome: str) -> None:
        logger.debug("chat turn on %s: memory %s, %s", surface, memory, outcome)

    def overhead(self, surface: str, seconds: float) -> None:
        pass

    def recall(self, memory: str, seconds: float) -> None:
        pass

    def first_byte(self, surface: str, seconds: float) -> None:
        pass

    def writeback(self, outcome: str) -> None:
        pass

    def attempt(self, backend: str, outcome: str) -> None:
        pass

    def tokens(self, backend: str, prompt: int, completion: int, memory: int) -> None:
        pass

    def budget_refused(self) -> None:
        pass

    def usage_dropped(self, count: int) -> None:
        pass

    def mcp_tool_call(self, tool: str, outcome: str) -> None:
        pass
