"""Recall alone, in the store's own process, for both rankings: ``python -m bench.recall_bench``.

For each store size (10,000 and 100,000 generated episodes, :mod:`bench.corpus`, with the
timestamps ``bench.run`` gives them) one database is written with every node's vector, then
opened once ``lexical`` (which ignores the vectors) and once ``hybrid``, and each is asked the
corpus queries in turn: latency p50/p99 of :meth:`MemoryStore.query` (what the store's recall
thread runs for one ``Sync.MemoryQueryRequest``), the time to open the store (the hybrid one
loads and checks the model and reads every vector) and the memory its vectors take.

Embedding 100,000 episodes takes about ten minutes on two cores, so only the first
:data:`EMBEDDED` episodes are embedded (and cached under ``~/.cache/arona-bench``, keyed by
the texts and the model's sha256); the nodes after them reuse those vectors in turn. A
brute-force search costs the same whatever the vectors hold, so the latency is that of a full
store; what a recall finds is measured by :mod:`bench.recall_quality`.

``bench.run`` (``make bench``) calls :func:`measure_sizes` and :func:`table_lines` for its
"recall alone in the store" rows and :func:`preload` for the store of its hybrid memory-turn
row.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from arona_store.ranking import Ranking, semantic_available
from arona_store.store import MemoryStore, NewNode
from bench import corpus
from bench.loadgen import percentile

RESULTS = Path(__file__).parent / "results" / "recall_bench.md"
SIZES = (10_000, 100_000)
EMBEDDED = 10_000
CALLS = 400
WARMUP = 40
WORDS_TIMEOUT_S = 600
BATCH = 32


@dataclass(frozen=True)
class RecallRow:
    """Recall alone at one store size with one ranking."""

    nodes: int
    ranking: str
    calls: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    # Process CPU time per recall (all threads), which other load on the machine barely moves.
    cpu_p50_ms: float
    open_s: float
    # From opening to the word index built (arona_store.retrieval.tantivy_index).
    words_s: float
    vectors_mb: float
    empty: int


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "arona-bench"


def corpus_nodes(
    count: int, now: float | None = None, node_types: Sequence[str] = ("episode",)
) -> list[NewNode]:
    """The episodes ``bench.run`` preloads (same texts, same ages: up to 90 days), taking the
    ``node_types`` in turn."""
    rng = random.Random(corpus.SEED + count)
    now = time.time() if now is None else now
    return [
        NewNode(
            text=text,
            node_type=node_types[i % len(node_types)],
            created_at=now - rng.uniform(0, 90 * 86400),
        )
        for i, text in enumerate(corpus.episodes(count))
    ]


def corpus_vectors(count: int) -> list[bytes]:
    """The stored form of the vectors of the first ``count`` corpus episodes.

    Every store size draws its episodes from the same sequence (:func:`bench.corpus.episodes`),
    so one cache file holds the vectors of its longest prefix embedded so far (keyed by the
    corpus seed and the model's sha256) and grows when more are asked for; embedding uses
    every core."""
    import numpy as np

    from arona_store.embedding import MODEL_SHA256, Embedder
    from arona_store.vectors import to_blob

    cached = _cache_dir() / f"vectors-{corpus.SEED}-{MODEL_SHA256[:16]}.npy"
    matrix = np.load(cached) if cached.is_file() else np.zeros((0, 384), np.float32)
    if len(matrix) < count:
        texts = list(corpus.episodes(count))[len(matrix) :]
        embedder = Embedder.load()
        chunks = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            parts = list(pool.map(embedder.embed, chunks))
        matrix = np.vstack([matrix, *parts])
        cached.parent.mkdir(parents=True, exist_ok=True)
        np.save(cached, matrix)
    return [to_blob(row) for row in matrix[:count]]


def preload(
    db_path: Path,
    count: int,
    ranking: Ranking = "hybrid",
    node_types: Sequence[str] = ("episode",),
) -> int:
    """Write a store of ``count`` corpus episodes at ``db_path`` (taking the ``node_types``
    in turn); for ``hybrid``, with their vectors (the first :data:`EMBEDDED` embedded, the
    rest reusing them in turn), so a hybrid store opened on it has nothing left to embed.
    Returns the node count."""
    nodes = corpus_nodes(count, node_types=node_types)
    if ranking == "hybrid":
        vectors = corpus_vectors(min(count, EMBEDDED))
        nodes = [
            NewNode(
                text=node.text,
                node_type=node.node_type,
                created_at=node.created_at,
                vector=vectors[i % len(vectors)],
            )
            for i, node in enumerate(nodes)
        ]
    store = MemoryStore.open(db_path, ranking=ranking)
    try:
        for start in range(0, len(nodes), 5000):
            store.add_many(nodes[start : start + 5000])
        assert store.unembedded() == 0
        return store.count()
    finally:
        store.close()


def measure(db_path: Path, ranking: Ranking, calls: int = CALLS) -> RecallRow:
    """Open the store at ``db_path`` with ``ranking`` and time ``calls`` recalls."""
    started = time.perf_counter()
    store = MemoryStore.open(db_path, ranking=ranking)
    opened = time.perf_counter() - started
    try:
        # A store of more than 20,000 memories builds its word index after it opens.
        if not store.wait_for_words(WORDS_TIMEOUT_S):
            raise RuntimeError(f"the word index was not built within {WORDS_TIMEOUT_S} s")
        words = time.perf_counter() - started
        nodes = store.count()
        for i in range(WARMUP):
            store.query(corpus.QUERIES[i % len(corpus.QUERIES)], 10)
        latencies: list[float] = []
        cpu: list[float] = []
        empty = 0
        for i in range(calls):
            query = corpus.QUERIES[i % len(corpus.QUERIES)]
            began, began_cpu = time.perf_counter(), time.process_time()
            hits = store.query(query, 10)
            latencies.append(time.perf_counter() - began)
            cpu.append(time.process_time() - began_cpu)
            empty += not hits
    finally:
        store.close()
    ordered = sorted(latencies)
    vectors_mb = 0.0
    if ranking == "hybrid":
        from arona_store.vectors import REDUCED_DIMS  # numpy: the semantic extra

        # The vectors (float32) plus their float32 projections.
        vectors_mb = nodes * (384 + REDUCED_DIMS) * 4 / 1e6
    return RecallRow(
        nodes=nodes,
        ranking=ranking,
        calls=calls,
        p50_ms=percentile(ordered, 0.5) * 1000,
        p99_ms=percentile(ordered, 0.99) * 1000,
        mean_ms=statistics.fmean(ordered) * 1000,
        cpu_p50_ms=statistics.median(cpu) * 1000,
        open_s=opened,
        words_s=words,
        vectors_mb=vectors_mb,
        empty=empty,
    )


def model_cpu_ms(rounds: int = 3) -> tuple[float, float]:
    """The embedding model's own CPU for one of ``bench.run``'s memory turns, in ms (medians
    over the corpus questions, ``rounds`` times each): embedding the turn's question (the
    recall) and its episode (what the gateway writes back: the question and the upstream's
    reply), as the store embeds them. The reference the store's CPU per turn is held to."""
    from arona_store.embedding import Embedder
    from arona_store.hybrid import embedding_text
    from bench.upstream import REPLY

    embedder = Embedder.load()
    questions: list[float] = []
    episodes: list[float] = []
    for _ in range(rounds):
        for query in corpus.QUERIES:
            began = time.process_time()
            embedder.embed([query])
            questions.append(time.process_time() - began)
            episode = embedding_text(f"User: {query}\nAssistant: {REPLY}")
            began = time.process_time()
            embedder.embed([episode])
            episodes.append(time.process_time() - began)
    return statistics.median(questions) * 1000, statistics.median(episodes) * 1000


def measure_sizes(work: Path, sizes: Sequence[int] = SIZES, calls: int = CALLS) -> list[RecallRow]:
    """Recall alone at each of ``sizes`` with ``lexical`` and (with the semantic extra)
    ``hybrid``, on stores written under ``work``."""
    hybrid = semantic_available()
    rows: list[RecallRow] = []
    for size in sizes:
        db = work / f"recall-{size}" / "memory.db"
        preload(db, size, "hybrid" if hybrid else "lexical")
        rows.append(measure(db, "lexical", calls))
        if hybrid:
            rows.append(measure(db, "hybrid", calls))
    return rows


def table_lines(rows: Sequence[RecallRow]) -> list[str]:
    """The rows as a Markdown table, with what they mean."""
    lines = [
        "Recall alone in the store process (`MemoryStore.query`, limit 10, the 20 corpus"
        " queries in turn, one at a time); `CPU` is the process CPU time a recall takes (what"
        " other load on the machine barely changes); `open` the time to open the store"
        " (hybrid: load and check the model, read every vector); `words` the time from opening"
        " until the word index is built (before the store opens up to 20,000 memories, after"
        " beyond: the recalls are measured once it is); `vectors` the memory the hybrid index"
        " takes."
        f" Beyond the first {EMBEDDED:,} episodes the vectors are reused in turn (the search"
        " costs the same whatever they hold).",
        "",
        "| store nodes | ranking | calls | p50 ms | p99 ms | mean ms | CPU ms (p50) | open s"
        " | words s | vectors MB | empty |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.nodes:,} | {r.ranking} | {r.calls} | {r.p50_ms:.2f} | {r.p99_ms:.2f}"
            f" | {r.mean_ms:.2f} | {r.cpu_p50_ms:.2f} | {r.open_s:.2f} | {r.words_s:.2f}"
            f" | {r.vectors_mb:.0f}"
            f" | {r.empty} |"
        )
    by = {(r.nodes, r.ranking): r for r in rows}
    for size in sorted({r.nodes for r in rows}):
        lexical, hybrid = by.get((size, "lexical")), by.get((size, "hybrid"))
        if lexical is not None and hybrid is not None and lexical.p50_ms > 0:
            lines.append("")
            lines.append(
                f"At {size:,} nodes a hybrid recall takes {hybrid.p50_ms / lexical.p50_ms:.1f}×"
                f" the lexical one (p50), {hybrid.p50_ms - lexical.p50_ms:.1f} ms more"
                " (embedding the query and searching every vector)."
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recall_bench", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="arona-recall-bench-") as tmp:
        rows = measure_sizes(Path(tmp), args.sizes, args.calls)
    text = "\n".join(["# Recall alone, both rankings", "", *table_lines(rows)]) + "\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
