"""The benchmark harness in its quickest mode, so that ``make bench`` cannot rot unnoticed.

It runs ``python -m bench`` for real (upstream, store, three gateways, load generator, recall
at two store sizes, each in its own process on 127.0.0.1) with tiny counts and no LiteLLM.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# The quick run took 44 s on an idle 2-core box, and 83 to 188 s with two busy loops beside it
# (alone, or inside a full test run): its limit is ten times the slowest.
RUN_LIMIT_S = 1800


@pytest.mark.timeout(RUN_LIMIT_S + 60)
def test_quick_run_measures_every_configuration_without_failures(tmp_path: Path) -> None:
    out = tmp_path / "result.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--no-litellm",
            "--nodes",
            "500",
            "--big-nodes",
            "1000",
            "--turns",
            "30",
            "--warmup",
            "5",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    assert done.stdout.strip() == table.strip()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "|---" not in line]
    for label in (
        "1. direct to the upstream",
        "2. gateway, memory disabled",
        "3. gateway, memory enabled (recall + writeback), default store",
        "3a. gateway, memory enabled, a Responses turn (POST /v1/responses)",
        "3l. gateway, memory enabled, lexical-ranking store (ARONA_STORE_RANKING=lexical)",
        "3g. gateway, memory enabled, unary gRPC calls (ARONA_GRPC_STREAMS=0)",
        "3u. gateway, memory enabled, ARONA_MEMORY_SCOPE=user",
        "3m. gateway, memory enabled, ARONA_METRICS=false",
        "3j. gateway, memory enabled, no writeback journal",
        "3n. gateway, memory enabled, no usage metering (ARONA_USAGE=false)",
        "3o. gateway, memory enabled, tracing on (OTEL_TRACES_SAMPLER=always_on",
        "3q. gateway, memory enabled, tracing configured but sampled off",
        "3f. gateway, memory enabled, tracing configured to follow its callers",
        "3c. gateway, memory enabled, with a conversation_id (SQLite)",
        "3p. gateway, memory enabled, with a conversation_id (PostgreSQL)",
        "3w. gateway, memory enabled, serve --workers 2",
        "3s. gateway, memory enabled, the store on PostgreSQL (1 store process)",
        "3t. gateway, memory enabled, the store on PostgreSQL (2 store processes)",
        "4. gateway, memory enabled, Philia blackholed",
        "5a. streaming direct",
        "5b. streaming via gateway, memory enabled",
        "6a. embeddings direct to the upstream",
        "6b. embeddings through the gateway (pass-through",
    ):
        measured = [row for row in rows if row.startswith(f"| {label}")]
        # One row per concurrency, every turn answered 200 with the expected memory header.
        assert len(measured) == 2, (label, table)
        assert all(row.rstrip(" |").endswith("| 0 / 0") for row in measured), measured
        # The gateway's CPU per turn (the column before the failures), for gateway rows only,
        # and the store's (the column before it) for rows 3, 3a and 3l.
        cpu_cells = [row.split(" | ")[-2] for row in measured]
        store_cells = [row.split(" | ")[-3] for row in measured]
        if label.startswith(("1.", "5a.", "6a.")):
            assert cpu_cells == ["—", "—"], measured
        else:
            assert all(re.fullmatch(r"\d+", cell) and int(cell) > 0 for cell in cpu_cells), measured
        if label.startswith(("3.", "3a.", "3l.")):
            assert all(re.fullmatch(r"\d+", cell) and int(cell) > 0 for cell in store_cells)
        elif label.startswith(("3s.", "3t.")):
            # The store processes' CPU per turn, and their database's.
            assert all(re.fullmatch(r"\d+ \+ \d+ PostgreSQL", c) for c in store_cells), measured
        else:
            assert store_cells == ["—", "—"], measured
    # Recall alone through gRPC: the default store and the lexical one, at both sizes.
    recall = [
        row
        for row in rows
        if re.match(r"\| (hybrid|lexical) \| (500|1,000) \|", row) and row.count("|") == 9
    ]
    assert len(recall) == 8 and all(row.endswith("| 0 / 0 |") for row in recall), table
    assert [row.split(" | ")[0] for row in recall] == ["| hybrid"] * 4 + ["| lexical"] * 4
    # Recall alone in the store process, both rankings at both sizes.
    store_rows = [row for row in rows if re.match(r"\| [\d,]+ \| (lexical|hybrid) \|", row)]
    assert [("hybrid" in row) for row in store_rows] == [False, True, False, True], table
    assert "LiteLLM peer not measured: skipped (--no-litellm)" in table
    assert "| LiteLLM comparisons | LiteLLM not measured in this run | — |" in table
    assert "memory's own cost: p50 (3 − 2) ≤ 0.5 × the gateway's (2 − 1), c=1" in table
    # The growth of recall alone from the run's store to the big one: a verdict at c=1.
    [growth, growth32] = [row for row in rows if row.startswith("| recall alone (gRPC, default")]
    assert "p50 at 1,000 memories ÷ at 500 ≤ 2×, c=1" in growth, growth
    assert growth.endswith(("| met |", "| **not met** |")), growth
    assert "c=32 (information)" in growth32 and growth32.endswith("| — |"), growth32
    # Beside it, what the store's own recall leaves of that target's allowance.
    [store_share] = [row for row in rows if row.startswith("| the store's recall alone")]
    assert re.search(r"\| \d+\.\d\d× \(\d+\.\d{3} ms vs \d\.\d{3} ms\) \| — \|$", store_share), (
        store_share
    )
    # And the two parts of memory's own cost: the store's CPU in the turns and the gateway's.
    for part in ("| the store's CPU per memory turn in row 3", "| the gateway's own CPU that"):
        [row] = [row for row in rows if row.startswith(part)]
        assert re.search(r"\| -?\d+\.\d\d× \(-?\d+\.\d{3} ms vs \d\.\d{3} ms\) \| — \|$", row), row
    # The store on PostgreSQL at two sizes: recall's growth, and a small scope's own nearest.
    [growth_pg] = [row for row in rows if row.startswith("| the store on PostgreSQL: recall p50")]
    assert re.search(r"\| [\d.]+× \(", growth_pg), growth_pg
    [scope] = [row for row in rows if row.startswith("| the store on PostgreSQL: a scope of 50")]
    assert "| 1.000 of them | met |" in scope, scope
    # What a store core and a database core serve, for each row of the store on PostgreSQL.
    capacity = [row for row in rows if row.startswith("| capacity of the store on PostgreSQL")]
    assert len(capacity) == 2 and all("a PostgreSQL core" in row for row in capacity), table
    # The most memory turns/s the machine's cores allow at rows 3 and 3l's CPU per turn.
    ceilings = [row for row in rows if row.startswith("| most memory turns/s this machine's")]
    assert [("row 3l's" in row) for row in ceilings] == [False, True], table
    for row in ceilings:
        figures = (
            r"\| [\d,]+ turns/s \(\d+ cores ÷ \(\d+\.\d\d ms store \+ \d+\.\d\d ms gateway\)\)"
            r" \| — \|$"
        )
        assert re.search(figures, row), row
    assert "unary calls (3g): memory turn's added p50 ÷ row 3's (streams), c=1" in table
    [passed] = [row for row in rows if row.startswith("| pass-through embeddings (6b − 6a)")]
    assert re.search(r"\| \S+× \(\S+ ms vs \S+ ms\) \| (met|\*\*not met\*\*) \|$", passed), passed
    assert "user-scope memory turn's added p50 ≤ 1.10 × shared mode's, c=1" in table
    assert "writeback journal: memory turn's added p50 ≤ 1.10 × without it, c=1" in table
    assert "usage metering: memory turn's added p50 ≤ 1.05 × without it (3 vs 3n), c=1" in table
    assert (
        "tracing on (3o, always_on): memory turn's added p50 ≤ 1.10 × tracing off (3), c=1" in table
    )
    assert (
        "tracing configured, sampled off (3q): memory turn's added p50 ≤ 1.05 × nothing"
        " configured (3), c=1" in table
    )
    assert (
        "tracing configured to follow its callers, none sampled (3f): memory turn's added p50"
        " ≤ 1.05 × nothing configured (3), c=1" in table
    )
    assert "serve --workers 2 turns/s ÷ --workers 1, c=32" in table
    # The throughput line also says how far apart its rounds were.
    [share] = [row for row in rows if row.startswith("| memory-enabled turns/s ÷ memory-disabled")]
    assert re.search(r"\| \d+% \(rounds: \d+%–\d+%\) \| — \|$", share), share
    # The CPU target at c=32 (a verdict) and the same figure at c=1 (information), each with
    # both µs figures and the rounds' own ratios.
    [cpu32, cpu1] = [row for row in rows if row.startswith("| gateway CPU per memory turn")]
    assert "≤ 0.70 × unary calls (3g), c=32" in cpu32, cpu32
    assert cpu32.endswith(("| met |", "| **not met** |")), cpu32
    assert "c=1 (information)" in cpu1 and cpu1.endswith("| — |"), cpu1
    for row in (cpu32, cpu1):
        figures = r"\| \d+\.\d\d× \(\d+ µs vs \d+ µs\) \(rounds: \d+\.\d\d–\d+\.\d\d×\) \|"
        assert re.search(figures, row), row
    # The store's CPU per memory turn against the model's own for that turn, the gateway's CPU
    # per memory turn, and recall alone in the store's process at both sizes: verdicts.
    [model] = [row for row in rows if row.startswith("| store CPU per memory turn, default")]
    assert re.search(
        r"\| \d+\.\d\d× \(\d+\.\d\d ms vs \d+\.\d\d ms = \d+\.\d\d question \+ \d+\.\d\d episode\)"
        r" \| (met|\*\*not met\*\*) \|$",
        model,
    ), model
    [gateway] = [row for row in rows if row.startswith("| memory turn's gateway CPU")]
    assert re.search(r"≤ 2\.0 ms \| \d+\.\d\d ms \| (met|\*\*not met\*\*) \|$", gateway), gateway
    [in_store] = [row for row in rows if row.startswith("| recall alone in the store's process")]
    assert "p50 at 1,000 memories ÷ at 500 ≤ 2×" in in_store, in_store
    assert in_store.endswith(("| met |", "| **not met** |")), in_store
    # A new memory's wait for its vector at c=32, how many the model embedded a step, and the
    # target's verdict.
    assert "## A new memory's wait for its vector (hybrid store, c=32)" in table
    [lag] = [row for row in rows if row.startswith("| store answered → vector stored")]
    assert re.search(r"\| \d+ / \d+ / \d+ ms over [\d,]+ stores \|$", lag), lag
    [batching] = [row for row in rows if row.startswith("| memories embedded a step")]
    assert re.search(r"\| \d+\.\d \([\d,]+ in [\d,]+ steps\) \|$", batching), batching
    [target] = [row for row in rows if row.startswith("| a new memory's vector stored")]
    assert target.endswith(("| met |", "| **not met** |")), target
    # The store outage: a short one in quick mode, every answered turn stored afterwards, and
    # the replay measured against the rate episodes arrived.
    assert "## Store outage under load (SIGKILL, then started again)" in table
    [lost] = [row for row in rows if row.startswith("| answered turns the store never got")]
    assert re.search(r"\| 0 of [\d,]+ — met \|$", lost), lost
    [replay] = [row for row in rows if row.startswith("| replay rate")]
    assert re.search(r"\| [\d,]+/s = \d+\.\d× the rate episodes arrived \|$", replay), replay
