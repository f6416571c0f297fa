"""MemoryStore, the SQLite half: ranking formula, recency, bulk load, deletes, large stores."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from arona_store.context import neighbours_many
from arona_store.lexical import (
    CONTEXT_COMMON,
    CONTEXT_ONLY_SHARE,
    PRUNE_MIN_NODES,
    WORD_WEIGHT,
)
from arona_store.retrieval.resident import ResidentNodes
from arona_store.retrieval.tantivy_index import WordEngine
from arona_store.schema import FULL_TEXT_INDEXES
from arona_store.scoring import (
    QUESTION_WEIGHT,
    RECENCY_WEIGHT,
    is_question,
    recency_of,
    relevance_of,
    score_of,
    strength_of,
)
from arona_store.store import MemoryHit, MemoryStore, NewNode, StoreError
from arona_store.words import build_fts_query, query_terms
from tests.support.erasure import files_holding

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


def _segments(path: Path, index: str) -> int:
    """How many segments an FTS5 index has: its structure record (rowid 10 of its ``_data``
    table) is a 4-byte cookie, an optional ``FLGS`` block of 8 bytes, then varints: the
    number of levels, then of segments."""
    with closing(sqlite3.connect(path)) as conn:
        blob = conn.execute(f"SELECT block FROM {index}_data WHERE id = 10").fetchone()[0]
    at = 12 if blob[4:8] == b"FLGS" else 4
    values: list[int] = []
    while len(values) < 2:
        value = 0
        while True:
            byte = blob[at]
            at += 1
            value = (value << 7) | (byte & 0x7F)
            if not byte & 0x80:
                break
        values.append(value)
    return values[1]


def test_reopening_merges_every_full_text_index_and_recalls_the_same(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = MemoryStore.open(path)
    for batch in range(3):  # each write leaves a segment in each index
        store.add_many(
            [
                NewNode(text=f"User: batch {batch} note {i} about sailing 帆船 {i}")
                for i in range(20)
            ]
        )
    now = time.time()
    store.query("sailing note 帆船", 1, now)
    assert store._engine.wait_clean(30.0)  # the word engine holds them all, as after reopening
    before = [(hit.node_id, hit.score) for hit in store.query("sailing note 帆船", 10, now)]
    store.close()
    assert all(_segments(path, index) >= 3 for index in FULL_TEXT_INDEXES)
    store = MemoryStore.open(path)
    try:
        assert [_segments(path, index) for index in FULL_TEXT_INDEXES] == [1, 1, 1]
        after = [(hit.node_id, hit.score) for hit in store.query("sailing note 帆船", 10, now)]
        assert after == before
    finally:
        store.close()


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
            assert 0.0 < score_of(bm25, bm25 / 2, now - age * DAY, now) < 1.0
    # More relevant scores higher at equal age, newer scores higher at equal relevance.
    assert score_of(-5.0, -2.0, now, now) > score_of(-1.0, -2.0, now, now)
    assert score_of(-5.0, -2.0, now, now) > score_of(-5.0, -2.0, now - DAY, now)


def test_recency_only_breaks_near_ties() -> None:
    # A memory of a year ago that matches a little better beats one of today.
    now = NOW.timestamp()
    assert score_of(-5.5, -5.5, now - 365 * DAY, now) > score_of(-5.0, -5.0, now, now)
    assert score_of(-5.0, -5.0, now - 365 * DAY, now) >= 0.98 * score_of(-5.0, -5.0, now, now)


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
    # The others are its neighbours, found by their context only, and score lower.
    assert all(h.score < hits[0].score for h in hits[1:])
    # Only words that are in every node: the newest such nodes, best first, scores in range.
    common = store.query("user assistant", 3, now=NOW)
    assert [h.text for h in common] == [
        f"User: errand {i} today\nAssistant: ok, errand {i}" for i in range(3)
    ]
    assert all(0.0 < h.score <= 1.0 for h in common)
    assert [h.score for h in common] == sorted((h.score for h in common), reverse=True)


def test_a_question_whose_known_words_are_all_common_finds_their_memories(
    store: MemoryStore,
) -> None:
    # Most of the store repeats one question (a load test's writebacks); a new question of the
    # same words plus one no memory holds ("2067") must still recall them, not nothing.
    store.add_many(
        (f"note {i} about errands", "episode", NOW - timedelta(days=1)) for i in range(400)
    )
    store.add_many(
        (f"User: which tea do I prefer in the morning {i}", "episode", NOW - timedelta(minutes=i))
        for i in range(PRUNE_MIN_NODES)
    )
    hits = store.query("which tea do I prefer in the morning 2067", 5, now=NOW)
    assert [h.text for h in hits] == [
        f"User: which tea do I prefer in the morning {i}" for i in range(5)
    ]
    assert store.query("which xylophone 2067", 5, now=NOW) == []


def test_a_long_word_without_a_full_stop_is_recalled_at_once(store: MemoryStore) -> None:
    # An oversized question written back (each side kept to 16,000 characters and more, one
    # "word" without punctuation): telling whether it only asks took 11 s a recall, each
    # following recall that matched it held the store that long.
    long_side = "q" * 16_000 + "\n[… 984,000 characters omitted …]\n" + "q" * 16_000
    store.add(f"User: {long_side} which tea?\nAssistant: {long_side} which tea?", "episode")
    store.add("User: I prefer oolong tea\nAssistant: noted", "episode")
    started = time.monotonic()
    hits = store.query("q" * 3_990 + " which tea do I prefer?", 5)
    # About a millisecond now; a tenfold margin and more for a loaded machine.
    assert time.monotonic() - started < 2.0
    assert hits[0].text == "User: I prefer oolong tea\nAssistant: noted"
    assert is_question(f"User: {long_side} which tea?")
    assert not is_question(f"User: {long_side}\nAssistant: noted")


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


def _words(rng: random.Random, vocabulary: list[str], count: int, skewed: bool = False) -> str:
    """``count`` words of ``vocabulary``; ``skewed``: the i-th drawn 10 / (i + 10) as often
    as the first, as words are (the first in most context documents, the last in few)."""
    if skewed:
        weights = [1 / (i + 10) for i in range(len(vocabulary))]
        return " ".join(rng.choices(vocabulary, weights, k=count))
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def test_ranking_equals_a_full_ranking_of_every_match(tmp_path: Path) -> None:
    # Large enough for word counts to be used; no word is in half the nodes, so the store
    # matches every query word against the memories' own text, and the context documents
    # with the words in under a third of them (the first few words are in more): a
    # brute-force ranking can check it.
    rng = random.Random(7)
    vocabulary = [f"w{i}" for i in range(300)]
    now = NOW.timestamp()
    path = tmp_path / "s.db"
    store = MemoryStore.open(path)
    try:
        store.add_many(
            (
                _words(rng, vocabulary, rng.randint(3, 12), skewed=True),
                rng.choice(["episode", "episode:b"]),
                now - rng.uniform(0, 120 * DAY),
            )
            for _ in range(PRUNE_MIN_NODES + 500)
        )
        queries = ("w1 w2 w3", "w7", "w10 w20 w30 w40", "w5 w5 w6", "w59 w0", "w45 w55")
        common = _context_common(path)
        # Queries whose words are all common in the context documents, some, or none.
        assert {"w0", "w1", "w2", "w3", "w7"} <= common
        assert not {"w40", "w45", "w55", "w59"} & common
        for query in queries:
            expected = _full_ranking(store, query, now)
            # Each index proposes its best 40: the best ten by both are among them.
            for limit in (1, 5, 10):
                hits = store.query(query, limit, now=NOW)
                _assert_ranked_as(hits, expected, limit)
    finally:
        store.close()


def _large_store(path: Path, vocabulary: list[str], created_at: float) -> MemoryStore:
    """A store just large enough for word counts and measured bounds to be used, its nodes
    made of ``vocabulary`` and all written at ``created_at``."""
    rng = random.Random(3)
    store = MemoryStore.open(path)
    store.add_many(
        (f"plain note {i} " + _words(rng, vocabulary, 12), "e", created_at)
        for i in range(PRUNE_MIN_NODES)
    )
    return store


def _context_common(path: Path) -> set[str]:
    """The words found in a third of the context documents or more (of a large store)."""
    with closing(sqlite3.connect(path)) as check:
        total = check.execute("SELECT count(*) FROM nodes").fetchone()[0]
        check.execute("CREATE VIRTUAL TABLE temp.v USING fts5vocab(main, nodes_ctx, row)")
        rows = check.execute("SELECT term, doc FROM temp.v").fetchall()
    assert total >= PRUNE_MIN_NODES
    return {term for term, docs in rows if docs * CONTEXT_COMMON >= total}


def _assert_ranked_as(
    hits: list[MemoryHit], expected: list[tuple[float, float, str]], limit: int
) -> None:
    """``hits`` are the best ``limit`` of the full ranking ``expected``, in its order, with its
    scores: two memories whose scores differ by less than the word engine's single-precision
    rounding (one in a million) may come either way round."""
    score_of = {node_id: score for score, _, node_id in expected}
    assert [score_of.get(h.node_id) for h in hits] == pytest.approx(
        [score for score, _, _ in expected[:limit]], rel=1e-6
    )
    assert [h.score for h in hits] == pytest.approx([score_of[h.node_id] for h in hits], rel=1e-6)


def _full_ranking(store: MemoryStore, query: str, now: float) -> list[tuple[float, float, str]]:
    """Every match of ``query`` (by its words or its context) scored by the formula, best
    first: its own BM25, its context's (without the words common there), its four
    neighbours' contexts' and the words it holds, each read from the store's word index for
    every node (not only the candidates a recall finds); one matched through its context
    only is kept when half as strong as the best (the brute-force check)."""
    terms = query_terms(query)
    # Both rankings from the word engine as it holds every memory (a memory written since
    # its last commit is scored apart: the same formula, not the same bits).
    store.query(query, 1, now=NOW)  # the writes since the last recall taken in
    assert store._engine.wait_clean(30.0)
    with store._read_lock:
        store._reader.execute("BEGIN")
        try:
            assert not store._nodes.sync()
            words = store._words
            words.begin()
            nodes = store._reader.execute(
                "SELECT seq, id, node_type, created_at, text FROM nodes"
            ).fetchall()
            every = sorted(seq for seq, *_ in nodes)
            total = len(every)
            assert total >= PRUNE_MIN_NODES
            rare = [t for t in terms if words.count("context", t) * CONTEXT_COMMON < total]
            turn = words.scores("turn", terms, every)
            context = words.scores("context", rare, every) if rare else {}
            held = words.held(terms, every)
        finally:
            store._reader.execute("COMMIT")
    by_type: dict[str, list[int]] = {}
    for seq, _, node_type, _, _ in sorted(nodes):
        by_type.setdefault(node_type, []).append(seq)
    strengths = {}
    for seq, _, node_type, _, _ in nodes:
        if seq not in turn and seq not in context:
            continue
        keys = by_type[node_type]
        i = keys.index(seq)
        near = [context.get(k, 0.0) for k in keys[max(0, i - 2) : i] + keys[i + 1 : i + 3]]
        strength = strength_of(turn.get(seq, 0.0), context.get(seq, 0.0), near)
        strengths[seq] = strength + WORD_WEIGHT * held.get(seq, 0)
    best = max(strengths.values(), default=0.0)
    ranked = []
    for seq, node_id, _, created, text in nodes:
        if seq not in strengths:
            continue
        if turn.get(seq, 0.0) <= 0.0 and strengths[seq] < CONTEXT_ONLY_SHARE * best:
            continue  # matched through its context only, and weakly
        score = relevance_of(strengths[seq])
        score *= (1 - RECENCY_WEIGHT) + RECENCY_WEIGHT * recency_of(created, now)
        if is_question(text):
            score *= QUESTION_WEIGHT
        ranked.append((score, seq, node_id))
    return [(score, float(seq), node_id) for score, seq, node_id in sorted(ranked, reverse=True)]


def test_ranking_stays_exact_while_the_store_changes(tmp_path: Path) -> None:
    # Words repeated within a node and nodes of very different lengths spread the term
    # factors; between recalls the store gains new nodes, nodes written in the past, refreshed
    # copies and deletions, and grows longer on average, so every remembered bound on a
    # word's term factor is put to the test against a full ranking.
    rng = random.Random(11)
    vocabulary = [f"w{i}" for i in range(40)]
    now = NOW.timestamp()
    path = tmp_path / "churn.db"
    store = MemoryStore.open(path)
    queries = ("w1 w2 w3", "w7", "w10 w20 w30", "w5 w6", "w39 w0 w11")
    try:
        ids = store.add_many(
            (
                _words(rng, vocabulary, rng.randint(2, 30)),
                "episode",
                now - rng.uniform(0, 60 * DAY),
            )
            for _ in range(PRUNE_MIN_NODES + 300)
        )
        for round_ in range(12):
            for query in queries:
                expected = _full_ranking(store, query, now)
                hits = store.query(query, 5, now=NOW)
                _assert_ranked_as(hits, expected, 5)
            change = round_ % 4
            if change == 0:  # new nodes, some long with a word many times over
                for _ in range(30):
                    word = rng.choice(vocabulary)
                    store.add(f"{word} " * rng.randint(1, 8) + _words(rng, vocabulary, 40), "e")
            elif change == 1:  # nodes written in the past, among the old ones
                store.add_many(
                    (f"{rng.choice(vocabulary)} " * 6, "e", now - rng.uniform(1, 50) * DAY)
                    for _ in range(20)
                )
            elif change == 2:  # deletions
                for node_id in rng.sample(ids, 40):
                    store.delete(node_id)
            else:  # the oldest episode holding "w7" stored again: refreshed to now
                with closing(sqlite3.connect(path)) as check:
                    oldest, text = check.execute(
                        "SELECT id, text FROM nodes WHERE node_type = 'episode'"
                        " AND seq IN (SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH 'w7')"
                        " ORDER BY seq LIMIT 1"
                    ).fetchone()
                assert store.add(text, "episode", refresh=True) == oldest
    finally:
        store.close()


@pytest.mark.parametrize("written", ["above the measured nodes", "among the measured nodes"])
def test_a_node_written_after_a_word_was_measured_is_never_skipped(
    tmp_path: Path, written: str
) -> None:
    # "kiwi" is measured on long nodes holding it once. Then a short node saying it five
    # times (a far larger term factor) is written three days back, and five more long ones a
    # day back: a recall reads those five first, and were the old measure trusted for the
    # new node, it would stop before reaching the best match of all.
    now = NOW.timestamp()
    path = tmp_path / "measured.db"
    store = _large_store(path, ["rain", "wind", "snow"], now - 40 * DAY)
    try:
        store.add_many(("kiwi " + "rain " * 20, "e", now - (20 + i) * DAY) for i in range(5))
        # The newest node when "kiwi" is measured: before the new ones, or after them.
        newest = now - 20 * DAY + 1 if written == "above the measured nodes" else now - 3600
        store.add("weather log", "e", newest)
        store.query("kiwi", 5, now=NOW)
        best = store.add("kiwi kiwi kiwi kiwi kiwi", "e", now - 3 * DAY)
        store.add_many(("kiwi " + "rain " * 20, "e", now - DAY + i) for i in range(5))

        expected = _full_ranking(store, "kiwi", now)
        assert expected[0][2] == best
        _assert_ranked_as(store.query("kiwi", 5, now=NOW), expected, 5)
    finally:
        store.close()


def test_a_rare_word_is_bounded_down_to_its_oldest_node(tmp_path: Path) -> None:
    # "kiwi" is in one short node a month old, the best match of all; "rain" in many newer,
    # weaker ones. Below a word's oldest node the bound leaves it out, so a wrong idea of
    # where that node is would stop the scan among the "rain" nodes, before reaching it.
    rng = random.Random(5)
    now = NOW.timestamp()
    path = tmp_path / "rare.db"
    store = _large_store(path, ["wind", "snow", "fog"], now - 90 * DAY)
    try:
        store.add_many(
            ("rain " + _words(rng, ["wind", "snow", "fog"], 25), "e", now - i * DAY / 10)
            for i in range(300)
        )
        best = store.add("kiwi kiwi kiwi rain", "e", now - 30 * DAY)
        expected = _full_ranking(store, "kiwi rain", now)
        assert expected[0][2] == best
        for _ in range(2):  # measured, then from the remembered measure
            hits = store.query("kiwi rain", 5, now=NOW)
            _assert_ranked_as(hits, expected, 5)
    finally:
        store.close()


def test_nodes_sharing_a_timestamp_are_all_kept_newest_insert_first(store: MemoryStore) -> None:
    first = store.add_many([(f"lantern {i}", "episode", NOW) for i in range(50)])
    later = store.add("lantern 50", "episode", NOW)
    assert store.count() == 51
    hits = store.query("lantern", 100, now=NOW)
    assert len(hits) == 51
    assert {h.node_id for h in hits} == {*first, later}
    assert all(h.created_at == NOW.timestamp() for h in hits)


@pytest.mark.parametrize("created_at", [float("nan"), float("inf"), -float("inf"), 1e13])
def test_impossible_timestamps_are_refused(store: MemoryStore, created_at: float) -> None:
    with pytest.raises(StoreError, match="created_at"):
        store.add_many([("fine", "episode"), ("bad", "episode", created_at)])
    assert store.count() == 0


def test_timestamps_before_1970_and_in_the_future_rank_by_time(store: MemoryStore) -> None:
    ancient = store.add("kite flying", "episode", -5e8)
    future = store.add("kite flying", "episode", NOW + timedelta(days=400))
    recent = store.add("kite flying", "episode", NOW - timedelta(days=1))
    hits = store.query("kite", 5, now=NOW)
    assert [h.node_id for h in hits] == [future, recent, ancient]
    assert all(0.0 < h.score < 1.0 for h in hits)


def test_refresh_moves_an_identical_node_to_now_and_keeps_its_id(store: MemoryStore) -> None:
    kite = store.add("kite flying", "episode", NOW - timedelta(days=30), refresh=True)
    bike = store.add("kite and bike", "episode", NOW - timedelta(days=10), refresh=True)
    assert [h.node_id for h in store.query("kite", 5, now=NOW)] == [bike, kite]

    again = store.add("kite flying", "episode", NOW - timedelta(days=1), refresh=True)
    assert again == kite
    assert store.count() == 2
    hits = store.query("kite", 5, now=NOW)
    assert [h.node_id for h in hits] == [kite, bike]
    assert hits[0].created_at == (NOW - timedelta(days=1)).timestamp()

    # Never back in time: an older copy leaves the node where it is.
    assert store.add("kite flying", "episode", NOW - timedelta(days=60), refresh=True) == kite
    assert store.query("kite", 5, now=NOW)[0].created_at == (NOW - timedelta(days=1)).timestamp()


def test_refresh_only_merges_nodes_identical_in_every_field(store: MemoryStore) -> None:
    base = store.add("kite flying", "episode", NOW, refresh=True)
    variants = [
        store.add("kite flying", "entity", NOW, refresh=True),
        store.add("Kite flying", "episode", NOW, refresh=True),
        store.add("kite flying", "episode", NOW, properties={"a": "b"}, refresh=True),
        store.add("kite flying", "episode", NOW, source_episode_id="e1", refresh=True),
        store.add("kite flying", "episode", NOW, related_node_ids=["n1"], refresh=True),
        # Without refresh, a copy is a new node (the bulk-load path).
        store.add("kite flying", "episode", NOW),
    ]
    assert len({base, *variants}) == 7
    assert store.count() == 7
    batch = store.add_many([("same words", "episode", NOW)] * 3, refresh=True)
    assert len(set(batch)) == 1 and store.count() == 8


def test_a_version_2_database_gets_digests_and_keeps_its_nodes(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    store = MemoryStore.open(path)
    kept = store.add("lantern by the door", "episode", NOW - timedelta(days=3))
    store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP INDEX nodes_digest")
        conn.execute("ALTER TABLE nodes DROP COLUMN digest")
        conn.execute("PRAGMA user_version = 2")
    upgraded = MemoryStore.open(path)
    try:
        assert [h.node_id for h in upgraded.query("lantern", 5, now=NOW)] == [kept]
        again = upgraded.add("lantern by the door", "episode", NOW, refresh=True)
        assert again == kept and upgraded.count() == 1
    finally:
        upgraded.close()


_OLD_LAYOUT = """
CREATE TABLE nodes (
    seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, node_type TEXT NOT NULL,
    text TEXT NOT NULL, created_at REAL NOT NULL, source_episode_id TEXT,
    related_node_ids TEXT NOT NULL DEFAULT '[]', properties TEXT NOT NULL DEFAULT '{}'
);
CREATE VIRTUAL TABLE nodes_fts USING fts5(
    text, content='nodes', content_rowid='seq', tokenize='porter unicode61 remove_diacritics 2'
);
CREATE INDEX nodes_created ON nodes(created_at, seq);
CREATE TRIGGER nodes_ai AFTER INSERT ON nodes BEGIN
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
END;
"""


def test_a_database_with_insertion_ordered_keys_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.executescript(_OLD_LAYOUT)
        # Inserted oldest last, so insertion order and time order disagree.
        for i, days in enumerate((1, 5, 30, 2)):
            old.execute(
                "INSERT INTO nodes (id, node_type, text, created_at) VALUES (?, ?, ?, ?)",
                (f"id-{i}", "episode", f"ferry ride {i}", (NOW - timedelta(days=days)).timestamp()),
            )
    store = MemoryStore.open(path)
    try:
        assert store.count() == 4
        hits = store.query("ferry", 10, now=NOW)
        assert [h.node_id for h in hits] == ["id-0", "id-3", "id-1", "id-2"]
        assert store.delete("id-3") is True
        assert [h.node_id for h in store.query("ferry", 10, now=NOW)] == ["id-0", "id-1", "id-2"]
    finally:
        store.close()
    reopened = MemoryStore.open(path)
    try:
        assert [h.node_id for h in reopened.query("ride", 10, now=NOW)] == ["id-0", "id-1", "id-2"]
    finally:
        reopened.close()


def test_writes_through_another_connection_are_seen(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    reader = MemoryStore.open(path)
    writer = MemoryStore.open(path)
    try:
        assert reader.query("harbour", 5) == []
        assert reader.count() == 0
        writer.add_many((f"errand {i}", "episode") for i in range(PRUNE_MIN_NODES))
        planted = writer.add("the harbour opens at six", "episode")
        assert reader.count() == PRUNE_MIN_NODES + 1
        assert reader.query("harbour", 5)[0].node_id == planted
    finally:
        reader.close()
        writer.close()


def test_a_recall_reads_committed_nodes_while_a_write_is_under_way(store: MemoryStore) -> None:
    store.add("quiet pond", "episode", NOW)
    # A write transaction left open on the writer connection: a recall neither waits for it
    # nor sees its uncommitted node.
    with store._lock:
        store._conn.execute("BEGIN IMMEDIATE")
        store._conn.execute(
            "INSERT INTO nodes (seq, id, node_type, text, created_at) VALUES (1, 'x', 'e', ?, 0)",
            ("noisy pond",),
        )
        hits = store.try_query("pond", 5, now=NOW)
        assert hits is not None and [h.text for h in hits] == ["quiet pond"]
        assert store.count() == 1
        store._conn.execute("COMMIT")
    assert [h.text for h in store.query("pond", 5, now=NOW)] == ["quiet pond", "noisy pond"]
    assert store.count() == 2


def test_try_query_gives_way_to_another_recall(store: MemoryStore) -> None:
    store.add("quiet pond", "episode", NOW)
    acquired = store._read_lock.acquire(timeout=5)
    assert acquired
    try:
        assert store.try_query("pond", 5, now=NOW) is None
    finally:
        store._read_lock.release()
    hits = store.try_query("pond", 5, now=NOW)
    assert hits is not None and [h.text for h in hits] == ["quiet pond"]


def test_try_add_many_writes_nothing_while_another_writer_holds_the_database(
    tmp_path: Path,
) -> None:
    path = tmp_path / "busy.db"
    store = MemoryStore.open(path)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        assert store.try_add_many([("held back", "episode")]) is None
        other.execute("ROLLBACK")
        with store._lock:
            assert store.try_add_many([("held back", "episode")]) is None
        assert store.count() == 0
        ids = store.try_add_many([("held back", "episode")])
        assert ids is not None and [h.node_id for h in store.query("held", 5)] == ids
    finally:
        other.close()
        store.close()


def test_checkpoints_can_be_left_to_the_owner(tmp_path: Path) -> None:
    path = tmp_path / "wal.db"
    store = MemoryStore.open(path, checkpoint_on_commit=False)
    try:
        size = path.stat().st_size
        for i in range(300):
            store.add(f"note {i} " + "lantern " * 40, "episode")
        # Nothing copied into the database file yet: every page is still in the log.
        assert path.stat().st_size == size
        store.checkpoint()
        assert path.stat().st_size > size
        assert store.count() == 300
    finally:
        store.close()


def test_a_node_type_filter_ranks_its_own_nodes_with_their_unfiltered_scores(
    store: MemoryStore,
) -> None:
    rng = random.Random(7)
    words = "tea oolong green milk sugar lyon paris peanut daughter garden".split()
    nodes = [
        NewNode(
            " ".join(rng.choice(words) for _ in range(6)),
            f"episode:{i % 7}",
            NOW - timedelta(minutes=i),
        )
        for i in range(PRUNE_MIN_NODES + 400)
    ]
    store.add_many(nodes)
    for query in ("oolong peanut", "tea", "daughter garden lyon"):
        everything = store.query(query, 100, now=NOW)
        for scope in ("episode:0", "episode:3"):
            expected = [(h.node_id, h.score) for h in everything if h.node_type == scope][:5]
            got = store.query(query, 5, now=NOW, node_type=scope)
            assert {h.node_type for h in got} == {scope}
            # Each filtered hit has the score it has unfiltered (to the word engine's single
            # precision), and none better is left out.
            assert [h.score for h in got] == pytest.approx(
                [score for _, score in expected], rel=1e-6
            )
            assert len(got) == 5
    assert store.query("tea", 5, now=NOW, node_type="episode:nobody") == []


def _contexts(path: Path) -> dict[str, str]:
    """Every node's context document as stored, by node text."""
    with closing(sqlite3.connect(path)) as check:
        rows = check.execute(
            "SELECT n.text, c.text FROM nodes n JOIN nodes_ctx c ON c.rowid = n.seq"
        ).fetchall()
        assert check.execute("SELECT count(*) FROM nodes_ctx").fetchone()[0] == len(rows)
    return dict(rows)


def _expected_contexts(path: Path) -> dict[str, str]:
    """The documents worked out from scratch: two neighbours each side, same node type."""
    with closing(sqlite3.connect(path)) as check:
        rows = check.execute("SELECT node_type, text FROM nodes ORDER BY node_type, seq").fetchall()
    out = {}
    for i, (node_type, text) in enumerate(rows):
        same = [j for j in range(max(0, i - 2), min(len(rows), i + 3)) if rows[j][0] == node_type]
        out[text] = "\n".join(rows[j][1] for j in same)
    return out


def _neighbours_found(path: Path) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Every node's neighbours as a recall looks them up (all in one statement), and as worked
    out from scratch: the keys of the two nodes each side of the same type, nearest first."""
    with closing(sqlite3.connect(path)) as check:
        rows = check.execute("SELECT node_type, seq FROM nodes ORDER BY node_type, seq").fetchall()
        found = neighbours_many(check, [seq for _, seq in rows] + [-1])
    expected = {}
    for i, (node_type, seq) in enumerate(rows):
        before = [rows[j] for j in range(i - 1, max(-1, i - 3), -1) if rows[j][0] == node_type]
        after = [rows[j] for j in range(i + 1, min(len(rows), i + 3)) if rows[j][0] == node_type]
        expected[seq] = [s for _, s in before + after]
    return found, expected


def test_each_memory_is_indexed_with_its_neighbours_of_the_same_type(tmp_path: Path) -> None:
    # Writes, backdated writes, refreshed copies and deletes, in two scopes: after each, every
    # node's context document is its own text between the two nodes before and after it of
    # its own type, and a deleted memory's words are in no document any more.
    rng = random.Random(5)
    path = tmp_path / "ctx.db"
    store = MemoryStore.open(path)
    now = NOW.timestamp()
    try:
        ids: dict[str, str] = {}
        deleted: list[str] = []
        for step in range(60):
            action = rng.random()
            if action < 0.55 or len(ids) < 6:
                text = f"note {step} {rng.choice(['tea', 'cat', 'rain'])}"
                when = now - rng.uniform(0, 30) * DAY if rng.random() < 0.3 else now + step
                ids[text] = store.add(text, rng.choice(["episode:a", "episode:b"]), when)
            elif action < 0.8:
                text = rng.choice(sorted(ids))
                with closing(sqlite3.connect(path)) as check:
                    (node_type,) = check.execute(
                        "SELECT node_type FROM nodes WHERE id = ?", (ids[text],)
                    ).fetchone()
                assert store.add(text, node_type, now + 100 + step, refresh=True) == ids[text]
            else:
                text = rng.choice(sorted(ids))
                assert store.delete(ids.pop(text))
                deleted.append(text.split()[1])
            assert _contexts(path) == _expected_contexts(path), step
            found, expected = _neighbours_found(path)
            assert found == expected, step
        # Each note's number is its own word: a deleted note's is in no document.
        with closing(sqlite3.connect(path)) as check:
            for number in deleted:
                found = check.execute(
                    "SELECT count(*) FROM nodes_ctx WHERE nodes_ctx MATCH ?", (f'"{number}"',)
                ).fetchone()[0]
                assert found == 0, number
        assert deleted
    finally:
        store.close()


def test_the_node_table_a_recall_reads_follows_every_write_of_any_process(
    tmp_path: Path,
) -> None:
    # The keys, ids and neighbours a recall reads from memory (ResidentNodes) are those of its
    # snapshot after new, backdated, refreshed and deleted nodes, written by this store or by
    # another process's (a second store on the same file), in two scopes.
    rng = random.Random(11)
    path = tmp_path / "resident.db"
    ours, theirs = MemoryStore.open(path), MemoryStore.open(path)
    reader = sqlite3.connect(path, isolation_level=None)
    table = ResidentNodes(reader)
    now = NOW.timestamp()
    try:
        ids: dict[str, tuple[str, str]] = {}
        for step in range(80):
            store = rng.choice([ours, theirs])
            action = rng.random()
            if action < 0.55 or len(ids) < 6:
                text = f"note {step}"
                node_type = rng.choice(["episode:a", "episode:b"])
                when = now - rng.uniform(0, 30) * DAY if rng.random() < 0.2 else now + step
                ids[text] = (store.add(text, node_type, when), node_type)
            elif action < 0.85:
                text = rng.choice(sorted(ids))
                node_id, node_type = ids[text]
                assert store.add(text, node_type, now + 100 + step, refresh=True) == node_id
            else:
                assert store.delete(ids.pop(rng.choice(sorted(ids)))[0])
            reader.execute("BEGIN")
            try:
                table.sync()
                keys = {str(i): s for s, i in reader.execute("SELECT seq, id FROM nodes")}
                assert len(table) == len(keys), step
                assert table.ids(list(keys.values())) == {s: i for i, s in keys.items()}, step
                assert all(table.key_of(i) == s for i, s in keys.items()), step
                assert table.neighbours(list(keys.values())) == neighbours_many(
                    reader, list(keys.values())
                ), step
            finally:
                reader.execute("COMMIT")
    finally:
        reader.close()
        ours.close()
        theirs.close()


def test_a_version_4_database_gets_its_contexts_indexed(tmp_path: Path) -> None:
    path = tmp_path / "v4.db"
    store = MemoryStore.open(path)
    store.add_many((f"turn {i}", "episode", NOW + timedelta(seconds=i)) for i in range(5))
    store.close()
    with closing(sqlite3.connect(path)) as old:
        old.execute("DROP TABLE nodes_ctx")
        old.execute("PRAGMA user_version = 4")
        old.commit()
    reopened = MemoryStore.open(path)
    try:
        assert _contexts(path) == _expected_contexts(path)
        assert _contexts(path)["turn 2"] == "turn 0\nturn 1\nturn 2\nturn 3\nturn 4"
    finally:
        reopened.close()


def test_a_deleted_memory_is_in_no_file_of_the_store(tmp_path: Path) -> None:
    # Its row, its vector and index entries, its words in its neighbours' context documents,
    # a full-text segment that still held them, a freed page, the write-ahead log: nothing
    # of it is left once delete() returns, while the store is open and after it closes.
    folder = tmp_path / "store"
    store = MemoryStore.open(folder / "memory.db", checkpoint_on_commit=False)
    try:
        store.add_many([(f"note {i} about tea, cakes and weather", "episode") for i in range(200)])
        secret = store.add("My hamster is called Glimmerquark; my locker code is 73914466")
        kept = store.add("My neighbour's cat is called Zephyrine", "episode")
        store.add_many([(f"later note {i} about coffee", "episode") for i in range(200)])
        store.checkpoint()  # the memory is in the database file, not only in the log
        assert files_holding(folder, ["Glimmerquark"])
        assert store.delete_many([secret, "no-such-node"]) == [True, False]
        assert files_holding(folder, ["Glimmerquark", "73914466"]) == {}
        assert not [h for h in store.query("hamster Glimmerquark locker") if "hamster" in h.text]
        # What was not deleted stays, and is still found.
        assert files_holding(folder, ["Zephyrine"])
        assert store.query("Zephyrine")[0].node_id == kept
    finally:
        store.close()
    assert files_holding(folder, ["Glimmerquark", "73914466"]) == {}


def _engine(store: MemoryStore) -> WordEngine:
    engine = store._engine
    assert engine.ready  # a small store's word index is built before it opens
    return engine


def test_the_word_engine_never_returns_what_the_database_no_longer_holds(
    tmp_path: Path,
) -> None:
    # Candidates come from the word engine (tantivy, in memory), which takes in writes a
    # batch at a time: until then a new memory is found, and a deleted or refreshed one is
    # found as the database now has it, and so once the engine has them.
    path = tmp_path / "engine.db"
    store = MemoryStore.open(path)
    store.add_many((f"User: note {i} about the harbour walk", "episode", NOW) for i in range(30))
    store.close()
    store = MemoryStore.open(path)
    try:
        engine = _engine(store)
        gone = store.add("User: my locker code is quillfeather 4471", "episode", NOW)
        kept = store.add("User: the spare key is under the quillfeather pot", "episode", NOW)
        for settled in (False, True):
            found = [hit.node_id for hit in store.query("quillfeather locker code", 10, NOW)]
            assert found[:2] == [gone, kept], settled
            assert store.delete(gone)
            found = [hit.node_id for hit in store.query("quillfeather locker code", 10, NOW)]
            assert gone not in found and found[0] == kept, settled
            assert store.query("harbour walk", 40, NOW), settled
            if not settled:
                # The same once the engine holds the changes.
                assert engine.wait_clean(30.0)
                gone = store.add("User: my locker code is quillfeather 4471", "episode", NOW)
                assert store.query("quillfeather", 10, NOW)
                assert engine.wait_clean(30.0)
    finally:
        store.close()


def test_the_word_engine_is_built_again_when_a_change_cannot_be_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Another process rewrites a memory's text in place: the keys tell nothing, so the word
    # index is built again from the database (one log line), and recalls find the new words
    # meanwhile and after.
    path = tmp_path / "rebuilt.db"
    store = MemoryStore.open(path)
    try:
        node = store.add("User: the boat is moored at pier nine", "episode", NOW)
        store.add_many((f"User: filler {i} of the day", "episode", NOW) for i in range(10))
        assert store.query("boat pier", 5, NOW)  # a recall takes the writes in
        assert _engine(store).wait_clean(30.0)
        with closing(sqlite3.connect(path)) as other:
            other.execute(
                "UPDATE nodes SET text = 'User: the boat is moored at dock seven' WHERE id = ?",
                (node,),
            )
            other.commit()
        with caplog.at_level("INFO", logger="arona_store.retrieval.tantivy_index"):
            assert [hit.node_id for hit in store.query("dock seven", 5, NOW)] == [node]
            assert store._engine.wait_clean(30.0)
            assert [hit.node_id for hit in store.query("dock seven", 5, NOW)] == [node]
            assert node not in {hit.node_id for hit in store.query("pier nine", 5, NOW)}
        built = [r.message for r in caplog.records if "word index built" in r.message]
        assert len(built) == 1, built
    finally:
        store.close()
