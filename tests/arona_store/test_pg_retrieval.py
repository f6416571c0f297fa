"""The retrieval boundary on PostgreSQL: the same memories give the same documents, the same
node table and the same lexical ranking as in the embedded store's SQLite file; the change log
carries writes and deletes to every reader; a small scope gets all of its nearest vectors."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from arona_store.cjk import cjk_grams
from arona_store.lexical import LexicalRanker
from arona_store.nodes import NewNode, now_key
from arona_store.pg import schema
from arona_store.pg.retrieval import (
    PgDocuments,
    PgNodes,
    PgVectors,
    PgWords,
    pg_snapshot,
    snapshot_reader,
    vector_text,
)
from arona_store.retrieval.engine_words import EngineWords
from arona_store.retrieval.resident import ResidentNodes
from arona_store.retrieval.tantivy_index import WordEngine, sqlite_snapshot
from arona_store.store import MemoryStore
from arona_store.words import query_terms

_COLUMNS = (
    "seq, id, node_type, text, created_at, source_episode_id, related_node_ids, properties, digest"
)
_VOCABULARY = (
    "caroline melanie support group painting camping lake pottery adoption counselor "
    "charity race sunrise kids museum guitar violin hiking beach park concert bakery"
).split()
QUESTIONS = [
    "When did Caroline go to the support group?",
    "What did Melanie paint at the lake?",
    "Which concert did the kids like?",
    "pottery adoption",
]


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_VOCABULARY) for _ in range(rng.randint(4, 12))) for _ in range(count)
    ]


@pytest.fixture
def twin(tmp_path: Path, store_database_url: str) -> Iterator[tuple[MemoryStore, str]]:
    """An embedded store of 300 memories in three scopes, and the same rows in PostgreSQL."""
    store = MemoryStore.open(tmp_path / "memory.db")
    nodes = [
        NewNode(text, node_type=f"episode:{i % 3}", created_at=1_700_000_000 + i * 60)
        for i, text in enumerate(_texts(300, seed=7))
    ]
    store.add_many(nodes)
    schema.migrate(store_database_url)
    rows = store._reader.execute(f"SELECT {_COLUMNS} FROM nodes").fetchall()
    with schema.connect(store_database_url) as conn:
        with conn.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO memory_nodes ({_COLUMNS}) VALUES ({', '.join(['%s'] * 9)})", rows
            )
    try:
        yield store, store_database_url
    finally:
        store.close()


def _pg_lexical(url: str) -> tuple[Any, PgNodes, WordEngine, EngineWords]:
    reader = snapshot_reader(url)
    nodes = PgNodes(reader)
    engine = WordEngine(functools.partial(pg_snapshot, url))
    words = EngineWords(PgWords(nodes), PgDocuments(reader), engine)
    return reader, nodes, engine, words


def test_documents_and_node_table_are_the_embedded_stores(twin: tuple[MemoryStore, str]) -> None:
    store, url = twin
    with sqlite_snapshot(store.path) as sqlite_documents, pg_snapshot(url) as pg_documents:
        expected = list(sqlite_documents.all())
        assert list(pg_documents.all()) == expected
        some = [seq for seq, *_ in expected[::17]]
        assert pg_documents.of(some) == sqlite_documents.of(some)
    reader = snapshot_reader(url)
    try:
        nodes = PgNodes(reader)
        assert nodes.sync() is None  # the first load
        reader.rollback()
        resident = ResidentNodes(store._reader)
        resident.sync()
        keys = [seq for seq, *_ in expected]
        assert nodes.ids(keys) == resident.ids(keys)
        assert nodes.neighbours(keys) == resident.neighbours(keys)
        assert nodes.texts(keys[:5]) == resident.texts(keys[:5])
    finally:
        reader.close()


def test_the_lexical_ranking_is_the_same_on_both(twin: tuple[MemoryStore, str]) -> None:
    store, url = twin
    reader, nodes, engine, words = _pg_lexical(url)
    try:
        nodes.sync()
        engine.start(inline=True)
        ranker = LexicalRanker(words, nodes)
        assert store.wait_for_words(30)
        at = now_key(1_700_100_000)
        for question in QUESTIONS:
            for scope in (None, "episode:1"):
                terms, grams = query_terms(question), cjk_grams(question)
                words.begin()
                on_pg = ranker.ranked(terms, grams, 10, at, scope)
                reader.rollback()
                store._reader.execute("BEGIN")
                try:
                    store._engine.mark(store._nodes.sync())
                    store._words.begin()
                    on_sqlite = store._lexical.ranked(terms, grams, 10, at, scope)
                finally:
                    store._reader.execute("COMMIT")
                assert on_pg, question
                assert [seq for _, seq in on_pg] == [seq for _, seq in on_sqlite], question
                assert [s for s, _ in on_pg] == pytest.approx([s for s, _ in on_sqlite], rel=1e-6)
    finally:
        engine.close()
        reader.close()


def test_every_reader_follows_writes_and_deletes_by_the_change_log(
    twin: tuple[MemoryStore, str],
) -> None:
    _, url = twin
    readers = [_pg_lexical(url) for _ in range(2)]  # two store processes' readers
    for reader, nodes, engine, _ in readers:
        nodes.sync()
        reader.rollback()
        engine.start(inline=True)
    with schema.connect(url) as conn:
        oldest, middle, newest = conn.execute(
            "SELECT min(seq), percentile_disc(0.5) WITHIN GROUP (ORDER BY seq), max(seq)"
            " FROM memory_nodes WHERE node_type = 'episode:1'"
        ).fetchone()
        gone_id = conn.execute("SELECT id FROM memory_nodes WHERE seq = %s", (middle,)).fetchone()[
            0
        ]
        conn.execute("DELETE FROM memory_nodes WHERE seq = %s", (middle,))
        conn.execute(
            f"INSERT INTO memory_nodes ({_COLUMNS}) VALUES"
            " (%s, 'new-old', 'episode:1', 'zeppelin over the lake', 1.0, NULL, '[]', '{}',"
            " '\\x00')",
            (oldest - 1,),
        )
        conn.execute(
            f"INSERT INTO memory_nodes ({_COLUMNS}) VALUES"
            " (%s, 'new-new', 'episode:1', 'a zeppelin again', 2.0, NULL, '[]', '{}', '\\x00')",
            (newest + 1,),
        )
        keys = [row[0] for row in conn.execute("SELECT seq FROM memory_nodes ORDER BY seq")]
    for reader, nodes, engine, words in readers:
        changed = nodes.sync()
        assert changed is not None and {oldest - 1, newest + 1, middle} <= changed
        engine.mark(changed)
        words.begin()  # the dirty documents, from this snapshot
        assert nodes.key_of(gone_id) is None
        assert set(words.top("turn", ["zeppelin"], 10, "episode:1")) == {oldest - 1, newest + 1}
        reader.rollback()
        fresh = PgNodes(reader)
        fresh.sync()
        assert len(nodes) == len(fresh) == len(keys)
        assert nodes.ids(keys) == fresh.ids(keys)
        assert nodes.neighbours(keys) == fresh.neighbours(keys)
        reader.rollback()
        assert engine.wait_clean(30)  # and once committed into the engine
        words.begin()
        assert set(words.top("turn", ["zeppelin"], 10, "episode:1")) == {oldest - 1, newest + 1}
        reader.rollback()
        engine.close()
        reader.close()


def test_a_small_scope_gets_all_of_its_nearest_vectors(store_database_url: str) -> None:
    schema.migrate(store_database_url)
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((600, schema.DIMENSION)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with schema.connect(store_database_url) as conn:
        with conn.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO memory_nodes ({_COLUMNS}, embedding) VALUES"
                " (%s, %s, %s, 'text', 1.0, NULL, '[]', '{}', '\\x00', %s::halfvec)",
                [
                    (i, f"n{i}", "episode:small" if i < 8 else "episode:big", vector_text(v))
                    for i, v in enumerate(vectors)
                ],
            )
    reader = snapshot_reader(store_database_url)
    try:
        nodes = PgNodes(reader)
        nodes.sync()
        search = PgVectors(reader, nodes)
        query = vectors[100] + 0.1 * vectors[3]
        query /= np.linalg.norm(query)
        found = search.top_nodes(query, 8, "episode:small")
        assert {node_id for _, node_id in found} == {f"n{i}" for i in range(8)}
        exact = vectors[:8] @ query
        assert [node_id for _, node_id in found] == [f"n{i}" for i in np.argsort(-exact)]
        assert [c for c, _ in found] == pytest.approx(sorted(exact, reverse=True), abs=2e-3)
        best = search.top_nodes(query, 1)
        assert best[0][1] == "n100"
        assert search.cosines(query, ["n3", "missing"]) == [
            pytest.approx(float(vectors[3] @ query), abs=2e-3),
            None,
        ]
    finally:
        reader.close()
