"""The report of a run: its table, the targets as ratios to references measured in the same run,
and the Markdown written under ``bench/results/``.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Sequence

from bench import embed_lag, mcp_search, outage, passthrough, pg_scale, recall_bench, responses
from bench.plan import (
    CONCURRENCIES,
    CONFIGS,
    DEFAULT_RANKING,
    REWARM_TURNS,
    ROUTING_WITHIN,
    Config,
    Run,
    cpu_per_turn_us,
    round_sizes,
)

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
    added_within(responses.TARGET, responses.KEY, "mem_on", responses.WITHIN)
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
    if (passed := passthrough.target(r)) is not None:
        add(*passed)
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
