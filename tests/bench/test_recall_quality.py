"""The recall-quality evaluation and the store-level recall benchmark, run for real: the
evaluation's targets hold, and both write what they print."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import recall_bench, recall_quality
from tests.arona_store.semantic import needs_semantic

ROOT = Path(__file__).resolve().parents[2]


def test_the_evaluation_has_enough_facts_each_asked_in_other_words() -> None:
    assert len(recall_quality.ITEMS) >= 50
    facts = [fact for fact, _, _ in recall_quality.ITEMS]
    assert len(set(facts)) == len(facts)
    for word, _ in recall_quality.RARE_WORD:
        assert sum(word in fact for fact in facts) == 1, word


@needs_semantic
@pytest.mark.timeout(180)  # 2 s idle, up to 7 s on a loaded 2-core box; the run may take 120 s
def test_hybrid_meets_the_recall_targets_and_lexical_does_not(tmp_path: Path) -> None:
    out = tmp_path / "quality.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.recall_quality", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {
        cells[0]: cells[1:]
        for line in out.read_text().splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    lexical = [float(x) for x in rows["lexical"][:4]]
    hybrid = [float(x) for x in rows["hybrid"][:4]]
    # recall@3 of at least 0.9; words alone (and the memories stored around) fall short.
    assert hybrid[1] >= 0.9 and lexical[1] < 0.9
    # Questions repeating a fact's rare word, and Chinese/Japanese ones, are found first (by
    # words alone, one rare-word question finds first the memory stored beside its fact, which
    # holds its other word: "Tell me about Mia." and "I can't tell red from green").
    assert hybrid[2] == 1.0 and lexical[2] >= 0.9
    assert hybrid[3] == 1.0 and lexical[3] == 1.0
    assert out.read_text().split("\n", 2)[2] in done.stdout


@needs_semantic
@pytest.mark.timeout(180)  # 3 s idle, up to 12 s on a loaded 2-core box
def test_the_store_recall_benchmark_measures_both_rankings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rows = recall_bench.measure_sizes(tmp_path, sizes=(300,), calls=20)
    assert [(r.nodes, r.ranking) for r in rows] == [(300, "lexical"), (300, "hybrid")]
    assert all(r.calls == 20 and r.empty == 0 and r.p50_ms > 0 for r in rows)
    text = "\n".join(recall_bench.table_lines(rows))
    assert "| 300 | hybrid | 20 |" in text
    # The vectors were embedded once and kept for the next run, which embeds nothing more.
    cached = list((tmp_path / "cache" / "arona-bench").glob("vectors-*.npy"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert len(recall_bench.corpus_vectors(200)) == 200
    assert cached[0].stat().st_mtime_ns == stamp
