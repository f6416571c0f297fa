"""The store's promises on both backends: the embedded SQLite file and PostgreSQL with pgvector.

Each test runs on each backend (``backend_store``), and where two store processes share the
memories (two stores opened on the same file or database) on both too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from arona_store.base import StoreBase
from arona_store.embedding import Embedder
from arona_store.nodes import NewNode
from arona_store.pg.store import PgMemoryStore
from arona_store.ranking import Ranking, semantic_available
from arona_store.store import MemoryStore

from .semantic import needs_semantic

NOW = 1_780_000_000.0
FACTS = [
    "Caroline went to the LGBTQ support group on Tuesday.",
    "Melanie painted a sunrise over the lake last year.",
    "My daughter Mia is allergic to peanuts.",
    "The kids loved the dinosaur exhibit at the museum.",
    "Caroline is applying to adoption agencies.",
]
Opener = Callable[[Ranking], StoreBase]


@pytest.fixture(scope="module")
def model() -> Embedder | None:
    if not semantic_available():
        return None
    return Embedder.load()


@pytest.fixture(params=["sqlite", "postgres"])
def opener(
    request: pytest.FixtureRequest, tmp_path: Path, model: Embedder | None
) -> Iterator[Opener]:
    """Opens stores of one backend on one database (each call: another store process's
    view of the same memories); closes them after the test."""
    opened: list[StoreBase] = []
    url = request.getfixturevalue("store_database_url") if request.param == "postgres" else None

    def open_store(ranking: Ranking = "lexical") -> StoreBase:
        embedder = model if ranking == "hybrid" else None
        if ranking == "hybrid" and embedder is None:
            pytest.skip("the semantic extra is not installed")
        store: StoreBase
        if url is None:
            store = MemoryStore.open(tmp_path / "memory.db", ranking=ranking, embedder=embedder)
        else:
            store = PgMemoryStore.open(url, ranking=ranking, embedder=embedder)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


def _load(store: StoreBase, texts: list[str], scope: str = "episode:a") -> list[str]:
    return store.add_many(
        [NewNode(t, node_type=scope, created_at=NOW - 3600 + i) for i, t in enumerate(texts)]
    )


def test_a_stored_memory_is_recalled_and_a_deleted_one_never(opener: Opener) -> None:
    store = opener("lexical")
    ids = _load(store, FACTS)
    hits = store.query("When did Caroline go to the support group?", 3, now=NOW)
    assert hits[0].text == FACTS[0]
    assert hits[0].node_id == ids[0]
    assert store.delete_many([ids[0], "no-such-id"]) == [True, False]
    after = store.query("When did Caroline go to the support group?", 3, now=NOW)
    assert FACTS[0] not in [h.text for h in after]
    assert store.count() == len(FACTS) - 1


def test_the_same_memory_stored_twice_is_one(opener: Opener) -> None:
    store, other = opener("lexical"), opener("lexical")
    node = NewNode(FACTS[1], node_type="episode:a", created_at=NOW - 60)
    first = store.add_many([node], refresh=True)
    # The same Writeback retried through another store process.
    again = other.add_many([NewNode(FACTS[1], node_type="episode:a", created_at=NOW)], refresh=True)
    assert again == first
    assert other.count() == 1
    hits = store.query("Who painted a sunrise?", 5, now=NOW)
    assert [(h.node_id, h.created_at) for h in hits] == [(first[0], NOW)]  # moved to its new time


def test_every_store_process_sees_the_others_writes_and_deletes_at_once(opener: Opener) -> None:
    one, two = opener("lexical"), opener("lexical")
    assert two.query("dinosaur museum", 3, now=NOW) == []
    ids = _load(one, FACTS)
    assert [h.node_id for h in two.query("dinosaur museum", 3, now=NOW)] == [ids[3]]
    two.delete_many([ids[3]])
    assert one.query("dinosaur museum", 3, now=NOW) == []
    more = _load(two, ["A dinosaur kite flew over the museum."])
    assert [h.node_id for h in one.query("dinosaur museum", 3, now=NOW)] == more


def test_scopes_stay_apart(opener: Opener) -> None:
    store = opener("lexical")
    _load(store, FACTS, scope="episode:a")
    mine = _load(store, ["Caroline moved to Sweden in May."], scope="episode:b")
    hits = store.query("Where did Caroline move?", 10, now=NOW, node_type="episode:b")
    assert [h.node_id for h in hits] == mine
    assert {h.node_type for h in store.query("Caroline", 10, now=NOW)} == {
        "episode:a",
        "episode:b",
    }


def test_both_backends_rank_the_same(tmp_path: Path, store_database_url: str) -> None:
    sqlite = MemoryStore.open(tmp_path / "memory.db")
    pg = PgMemoryStore.open(store_database_url)
    try:
        texts = FACTS * 3 + [f"{fact} Again, day {i}." for i, fact in enumerate(FACTS)]
        for store in (sqlite, pg):
            _load(store, texts)
        for question in ("Caroline support group", "What did Melanie paint?", "peanuts Mia"):
            on_sqlite = sqlite.query(question, 10, now=NOW)
            on_pg = pg.query(question, 10, now=NOW)
            assert [(h.text, h.created_at) for h in on_pg] == [
                (h.text, h.created_at) for h in on_sqlite
            ]
            assert [h.score for h in on_pg] == pytest.approx([h.score for h in on_sqlite])
    finally:
        sqlite.close()
        pg.close()


@needs_semantic
def test_hybrid_finds_a_paraphrase_once_its_vector_lands(opener: Opener) -> None:
    store = opener("hybrid")
    ids = store.add_many(
        [NewNode(t, node_type="episode:a", created_at=NOW - 60) for t in FACTS], embed=False
    )
    assert store.unembedded() == len(FACTS)
    while store.fill_vectors():
        pass
    assert store.unembedded() == 0
    hits = store.query("Does my kid have any food allergy?", 3, now=NOW)
    assert hits and hits[0].node_id == ids[2]


def test_chinese_and_japanese_are_found_by_their_character_pairs(opener: Opener) -> None:
    store = opener("lexical")
    tea, cat, run = "我最喜欢的茶是乌龙茶。", "私の猫の名前はタマです。", "我每天早上跑步。"
    _load(store, [tea, cat, run, *FACTS])
    assert [h.text for h in store.query("你喜欢什么茶？", 3, now=NOW)][:1] == [tea]
    assert [h.text for h in store.query("猫の名前は？", 3, now=NOW)][:1] == [cat]
