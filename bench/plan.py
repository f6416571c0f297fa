"""What a benchmark run is made of: its configurations (one row each: which gateway, which store,
which environment), its options, and the run's state as the parts fill it in, with the helpers
that read a measurement (turns served, CPU per turn, rounds pooled).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arona_store.ranking import ranking_from_env
from bench import embed_lag, mcp_search, outage, passthrough, pg_scale, recall_bench, responses
from bench.loadgen import Stats
from bench.procs import Proc, clean_env, cpu_ns, process_tree

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
STORE_TOKEN = "bench-store-token"
# LiteLLM refuses to start without a master key; this one only ever exists on loopback.
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 2
# The caller of the user-scope gateway: an API key named "bench", so principal "key:bench".
USER_KEY_NAME = "bench"
USER_KEY = "bench-user-key-" + "0123456789abcdef"
# How many users share the user-scope gateway's store (the caller is one of them).
USER_SCOPES = 4
# Conversations a round of the conversation rows takes in turn (so each gets a few turns of
# history, the same on both backends).
CONVERSATIONS = 100


def user_node_types() -> list[str]:
    """The node types of the user-scope store: the caller's scope first, then the others'."""
    from arona_grpc.scopes import scope_id, scoped_node_type

    scopes = [f"key:{USER_KEY_NAME}"] + [f"key:other-{i}" for i in range(1, USER_SCOPES)]
    return [scoped_node_type(scope_id(scope)) for scope in scopes]


MODEL = "bench-model"
CONCURRENCIES = (1, 32)
# Warm-up turns before each round after the first (new connections, same processes).
REWARM_TURNS = 50
# Between two measurements, the processes of the run must be idle (below this share of one
# core over one window), or the next one pays for the last one's leftovers: writebacks still
# being stored, a WAL checkpoint, LiteLLM's own bookkeeping. Waited for at most SETTLE_MAX_S.
SETTLE_WINDOW_S = 0.1
SETTLE_IDLE_SHARE = 0.05
SETTLE_MAX_S = 5.0
BLACKHOLE_TIMEOUT_S = "0.5"
# The gateways that share the run's store of the default configuration.
DEFAULT_STORE_GATEWAYS = frozenset(
    {
        "gw_on",
        "gw_unary",
        "gw_nometrics",
        "gw_nojournal",
        "gw_nousage",
        "gw_traced",
        "gw_traced_off",
        "gw_traced_follow",
        "gw_workers",
        "gw_pg",
        "gw_routing",
        "gw_pgstore",
        "gw_pgstore2",
    }
)
# What a run measures (--parts): the chat turns, recall alone through gRPC at two store sizes,
# recall alone inside the store process, a new memory's wait for its vector (bench.embed_lag)
# a store outage under load (bench.outage) and the store on PostgreSQL at 100,000 and
# 1,000,000 memories (bench.pg_scale), and search_memories over MCP against a gRPC Recall
# (bench.mcp_search).
PARTS = ("turns", "recall", "store-recall", "embed-lag", "outage", "pg-scale", "mcp")
PY = sys.executable
# What `make run` gives: hybrid with the semantic extra installed, lexical without.
DEFAULT_RANKING = ranking_from_env({})


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    target: str
    stream: bool = False
    expect: str = "any"
    baseline: str = "direct"
    # A bearer to send (the user-scope gateway knows callers by their API key).
    api_key: str = ""
    # Each turn carries a conversation_id, taking this many conversations in turn.
    conversations: int = 0
    # The memory store processes whose CPU time per turn is measured too (comma-separated
    # names; "" for none), and the database server's ("" for none).
    store: str = ""
    database: str = ""

    @property
    def gateway(self) -> bool:
        """Whether the target is one of the run's gateways (whose CPU time is measured)."""
        return self.target.startswith("gw_")


CONFIGS = (
    Config("direct", "1. direct to the upstream (no gateway)", "upstream"),
    Config("mem_off", "2. gateway, memory disabled", "gw_off", expect="disabled"),
    Config(
        "mem_on",
        "3. gateway, memory enabled (recall + writeback), default store",
        "gw_on",
        expect="enabled",
        store="store",
    ),
    Config(responses.KEY, responses.LABEL, "gw_on", expect="enabled", store="store"),
    Config(
        "mem_lexical",
        "3l. gateway, memory enabled, lexical-ranking store (ARONA_STORE_RANKING=lexical)",
        "gw_lexical",
        expect="enabled",
        store="store_lexical",
    ),
    Config(
        "mem_unary",
        "3g. gateway, memory enabled, unary gRPC calls (ARONA_GRPC_STREAMS=0)",
        "gw_unary",
        expect="enabled",
    ),
    Config(
        "mem_user",
        "3u. gateway, memory enabled, ARONA_MEMORY_SCOPE=user (API key)",
        "gw_user",
        expect="enabled",
        api_key=USER_KEY,
    ),
    Config(
        "mem_on_nometrics",
        "3m. gateway, memory enabled, ARONA_METRICS=false",
        "gw_nometrics",
        expect="enabled",
    ),
    Config(
        "mem_routing",
        "3r. gateway, memory enabled, two backends (ARONA_BACKENDS; the model by glob)",
        "gw_routing",
        expect="enabled",
    ),
    Config(
        "mem_nojournal",
        "3j. gateway, memory enabled, no writeback journal (ARONA_WRITEBACK_JOURNAL=false)",
        "gw_nojournal",
        expect="enabled",
    ),
    Config(
        "mem_nousage",
        "3n. gateway, memory enabled, no usage metering (ARONA_USAGE=false)",
        "gw_nousage",
        expect="enabled",
    ),
    Config(
        "mem_traced",
        "3o. gateway, memory enabled, tracing on (OTEL_TRACES_SAMPLER=always_on, a local "
        "OTLP/HTTP sink)",
        "gw_traced",
        expect="enabled",
    ),
    Config(
        "mem_traced_off",
        "3q. gateway, memory enabled, tracing configured but sampled off "
        "(OTEL_TRACES_SAMPLER=always_off, the same sink)",
        "gw_traced_off",
        expect="enabled",
    ),
    Config(
        "mem_traced_follow",
        "3f. gateway, memory enabled, tracing configured to follow its callers "
        "(OTEL_TRACES_SAMPLER=parentbased_always_off, the same sink; no turn carries a "
        "traceparent)",
        "gw_traced_follow",
        expect="enabled",
    ),
    Config(
        "conv_sqlite",
        "3c. gateway, memory enabled, with a conversation_id (SQLite)",
        "gw_on",
        expect="enabled",
        conversations=CONVERSATIONS,
    ),
    Config(
        "conv_pg",
        "3p. gateway, memory enabled, with a conversation_id (PostgreSQL)",
        "gw_pg",
        expect="enabled",
        conversations=CONVERSATIONS,
    ),
    Config(
        "mem_pgstore",
        "3s. gateway, memory enabled, the store on PostgreSQL (1 store process)",
        "gw_pgstore",
        expect="enabled",
        store="store_pg_a",
        database="pg_store",
    ),
    Config(
        "mem_pgstore2",
        "3t. gateway, memory enabled, the store on PostgreSQL (2 store processes)",
        "gw_pgstore2",
        expect="enabled",
        store="store_pg_a,store_pg_b",
        database="pg_store",
    ),
    Config(
        "mem_workers",
        "3w. gateway, memory enabled, serve --workers 2",
        "gw_workers",
        expect="enabled",
    ),
    Config(
        "blackhole",
        "4. gateway, memory enabled, Philia blackholed",
        "gw_blackhole",
        expect="offline",
    ),
    Config("stream_direct", "5a. streaming direct: time to first event", "upstream", True),
    Config(
        "stream_mem_on",
        "5b. streaming via gateway, memory enabled: time to first event",
        "gw_on",
        True,
        expect="enabled",
        baseline="stream_direct",
    ),
    Config("litellm", "LiteLLM proxy, no memory (peer)", "litellm"),
    *(
        Config(key, label, target, expect=expect, baseline=baseline or "direct")
        for key, label, target, baseline, expect in passthrough.ROWS
    ),
)


@dataclass
class Options:
    quick: bool
    nodes: int
    big_nodes: int
    turns: int
    warmup: int
    max_seconds: float
    rounds: int
    litellm: str | None
    litellm_note: str
    out: Path
    keep: bool
    # Only these configurations (their keys; None: all) and only these parts (PARTS).
    rows: frozenset[str] | None = None
    parts: frozenset[str] = frozenset(PARTS)


@dataclass
class Run:
    options: Options
    work: Path
    procs: list[Proc] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    grpc_targets: dict[str, str] = field(default_factory=dict)
    results: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    # Each round's turns/s, per (configuration, concurrency), in round order.
    rounds: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    # Each round's gateway CPU per turn (µs), per (configuration, concurrency), in round order;
    # only for gateway rows, and only where /proc could be read.
    cpu_rounds: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    # Recall alone through gRPC, per (ranking, store nodes, concurrency).
    recall: dict[tuple[str, int, int], dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    store_recall: list[recall_bench.RecallRow] = field(default_factory=list)
    # Run at the end whatever happened (a PostgreSQL cluster's removal).
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    litellm_version: str | None = None
    outage: outage.OutageResult | None = None
    embed_lag: embed_lag.LagResult | None = None
    # The embedding model's own CPU for one memory turn: (question, episode) in ms.
    model_cpu: tuple[float, float] | None = None
    # Servers the run did not start as a Proc (a PostgreSQL cluster), by name: their root pid.
    servers: dict[str, int] = field(default_factory=dict)
    # The store on PostgreSQL loaded and recalled at two sizes (bench.pg_scale).
    pg_scale: list[tuple[pg_scale.Loaded, pg_scale.Measured]] = field(default_factory=list)
    mcp: mcp_search.McpResult | None = None

    def gateway_pids(self, names: str) -> list[int]:
        """The processes of the gateways (or stores, or servers) ``names`` (comma-separated)
        right now: each one started and all below it (``serve --workers``: its gRPC service
        and HTTP workers; a PostgreSQL server: its backends)."""
        pids: list[int] = []
        for name in names.split(","):
            if name in self.servers:
                pids += process_tree(self.servers[name])
                continue
            [proc] = [proc for proc in self.procs if proc.name == name]
            pids += process_tree(proc.popen.pid)
        return pids

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, self.work, env=env or clean_env({}), cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        while self.cleanups:
            self.cleanups.pop()()

    def settle(self) -> float:
        """Wait until the run's processes are idle; the seconds waited.

        Reads each process's CPU time, all threads, from ``/proc`` (nanoseconds); where
        there is no ``/proc`` it does not wait.
        """
        pids = [proc.popen.pid for proc in self.procs if proc.popen.poll() is None]
        started = time.monotonic()
        before = cpu_ns(pids)
        if before is None:
            return 0.0
        while time.monotonic() - started < SETTLE_MAX_S:
            time.sleep(SETTLE_WINDOW_S)
            after = cpu_ns(pids) or 0
            if after - before < SETTLE_IDLE_SHARE * SETTLE_WINDOW_S * 1e9:
                break
            before = after
        return time.monotonic() - started


# Row 3r: the gateway of row 3 with a backends file instead of ARONA_UPSTREAM_URL. Two
# backends (both the bench upstream, under two names); the benchmark's model is served by the
# second one's glob, with the first as its fallback (never needed: the upstream never fails).
ROUTING_WITHIN = 1.05
ROUTING_BACKENDS = """
[backends.first]
base_url = "{url}"
api_key_env = "BENCH_FIRST_KEY"
models = ["gpt-4o", "gpt-*", "claude-*"]
aliases = {{ fast = "gpt-4o-mini" }}

[backends.second]
base_url = "{url}"
api_key_env = "BENCH_SECOND_KEY"
models = ["bench-*"]

[fallbacks]
"bench-*" = [{{ backend = "first", model = "{model}" }}]
"""


def served(result: dict[str, Any]) -> int:
    """Every turn a measurement sent and got an answer to, failures included."""
    return int(result["ok"]) + int(result["errors"]) + int(result["wrong_header"])


def cpu_per_turn_us(result: dict[str, Any], key: str = "cpu_ns") -> float | None:
    """The gateway's CPU time per turn of a measurement or pooled rounds, in µs: its
    processes' CPU time over the measured turns ÷ those turns; None where not measured.
    ``key="store_cpu_ns"``: the memory store's instead (``"database_cpu_ns"``: its database
    server's)."""
    cpu = result.get(key)
    turns = served(result)
    return cpu / turns / 1000 if cpu is not None and turns > 0 else None


def pool(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several rounds: their turns, failures and time added up, their
    latencies pooled before the percentiles are taken."""
    pooled = Stats(
        latencies=[x for part in parts for x in part["latencies_s"]],
        firsts=[x for part in parts for x in part["firsts_s"]],
        errors=sum(part["errors"] for part in parts),
        wrong_header=sum(part["wrong_header"] for part in parts),
        error_samples=[x for part in parts for x in part["error_samples"]][:5],
    )
    elapsed = sum(part["elapsed_s"] for part in parts)
    result = pooled.summary(elapsed, any(part["capped"] for part in parts))
    for key in ("cpu_ns", "store_cpu_ns", "database_cpu_ns"):
        cpus = [part.get(key) for part in parts]
        if cpus and all(cpu is not None for cpu in cpus):
            result[key] = sum(cpu for cpu in cpus if cpu is not None)
    return result


def round_sizes(turns: int, rounds: int) -> list[int]:
    """``turns`` split into ``rounds`` nearly equal, non-empty parts."""
    rounds = max(1, min(rounds, turns))
    return [turns // rounds + (1 if i < turns % rounds else 0) for i in range(rounds)]
