"""MemoryStore, the SQLite half: ranking formula, recency, bulk load, deletes, large stores."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from arona_store.store import (
    PRUNE_MIN_NODES,
    MemoryStore,
    NewNode,
    StoreError,
    build_fts_query,
    recency_of,
    score_of,
)

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = 86400.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MemoryStore]:
    opened = MemoryStore.open(tmp_path / "deep" / "er" / "store.db")
    yield opened
    opened.close()


def test_open_creates_parent_folders_and_a_wal_database(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "store.db"
    store = MemoryStore.open(path)
    store.add("hello world", "episode")
    store.close()
    assert path.is_file()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_half_life_is_fourteen_days() -> None:
    now = NOW.timestamp()
    assert recency_of(now, now) == 1.0
    assert recency_of(now - 14 * DAY, now) == pytest.approx(0.5)
    assert recency_of(now - 28 * DAY, now) == pytest.approx(0.25)
    # A timestamp from the future counts as brand new, never as a bonus above 1.
    assert recency_of(now + 5 * DAY, now) == 1.0


def test_scores_stay_within_zero_and_one() -> None:
    now = NOW.timestamp()
    for bm25 in (0.0, -1e-6, -0.5, -3.0, -50.0, -1e9, 2.0):
        for age in (0.0, 1.0, 14.0, 365.0, 36500.0):
            assert 0.0 < score_of(bm25, now - age * DAY, now) < 1.0
    # More relevant scores higher at equal age, newer scores higher at equal relevance.
    assert score_of(-5.0, now, now) > score_of(-1.0, now, now)
    assert score_of(-5.0, now, now) > score_of(-5.0, now - DAY, now)


def test_fts_expression_quotes_every_word() -> None:
    assert build_fts_query('NEAR(tea "oolong") -green* col:x') == (
        '"near" OR "tea" OR "oolong" OR "green" OR "col" OR "x"'
    )
    assert build_fts_query("What is it?") is None
    assert build_fts_query("") is None


def test_recency_orders_equal_relevance_and_now_is_respected(store: MemoryStore) -> None:
    old = store.add("the blue bicycle", "episode", NOW - timedelta(days=30))
    new = store.add("the red bicycle", "episode", NOW - timedelta(days=1))
    hits = store.query("bicycle", 5, now=NOW)
    assert [h.node_id for h in hits] == [new, old]
    # Seen from a point in time where both are equally old, the tie-break is still stable
    # (newer created_at first) and repeated queries agree.
    later = NOW + timedelta(days=3650)
    assert [h.node_id for h in store.query("bicycle", 5, now=later)] == [new, old]
    assert store.query("bicycle", 5, now=NOW) == hits


def test_stemming_lets_word_forms_match(store: MemoryStore) -> None:
    store.add("I love hiking in the mountains", "episode", NOW)
    hits = store.query("do you remember my hikes?", 5, now=NOW)
    assert [h.text for h in hits] == ["I love hiking in the mountains"]


def test_add_many_bulk_loads_and_returns_ids(store: MemoryStore) -> None:
    ids = store.add_many(
        [
            ("first note about kayaks", "episode"),
            ("second note about canoes", "entity", NOW - timedelta(days=2)),
            NewNode(text="third note about rafts", node_type="artifact", properties={"k": "v"}),
        ]
    )
    assert len(set(ids)) == 3
    assert store.count() == 3
    hits = store.query("canoes", 5, now=NOW)
    assert [(h.node_id, h.node_type) for h in hits] == [(ids[1], "entity")]


def test_add_many_is_all_or_nothing(store: MemoryStore) -> None:
    with pytest.raises(StoreError):
        store.add_many([("fine text", "episode"), ("   ", "episode")])
    assert store.count() == 0


def test_delete_removes_from_the_index(store: MemoryStore) -> None:
    keep = store.add("apples are red", "episode", NOW)
    drop = store.add("apples are green", "episode", NOW)
    assert store.delete(drop) is True
    assert store.delete(drop) is False
    assert [h.node_id for h in store.query("green apples", 10, now=NOW)] == [keep]
    assert store.count() == 1


def test_limit_is_validated(store: MemoryStore) -> None:
    for limit in (0, 101, -1):
        with pytest.raises(StoreError):
            store.query("tea", limit)


def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = MemoryStore.open(tmp_path / "s.db")
    store.close()
    store.close()
    with pytest.raises(StoreError):
        store.query("tea", 5)
    with pytest.raises(StoreError):
        store.add("tea", "episode")


def test_large_store_ranks_rare_words_over_words_in_every_node(store: MemoryStore) -> None:
    # Every node is an episode holding "user" and "assistant", like real chat turns.
    filler = [
        (f"User: errand {i} today\nAssistant: ok, errand {i}", "episode", NOW - timedelta(hours=i))
        for i in range(PRUNE_MIN_NODES + 200)
    ]
    store.add_many(filler)
    planted = store.add(
        "User: my passport number ends in 4471\nAssistant: noted",
        "episode",
        NOW - timedelta(days=9),
    )
    hits = store.query("user: what does my passport number end in?", 5, now=NOW)
    assert hits[0].node_id == planted
    assert [h.node_id for h in hits] == [planted]
    # Only words that are in every node: the newest such nodes, best first, scores in range.
    common = store.query("user assistant", 3, now=NOW)
    assert [h.text for h in common] == [
        f"User: errand {i} today\nAssistant: ok, errand {i}" for i in range(3)
    ]
    assert all(0.0 < h.score <= 1.0 for h in common)
    assert [h.score for h in common] == sorted((h.score for h in common), reverse=True)


def test_concurrent_callers_from_threads_are_safe(store: MemoryStore) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(30):
                store.add(f"thread {n} wrote line {i} about lanterns", "episode")
                store.query("lanterns", 5)
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert store.count() == 120
