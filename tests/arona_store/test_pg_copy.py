"""``arona-gateway store-copy``: an embedded store's memories into PostgreSQL and back, lossless
(every column, every vector's bytes, the indexes a recall reads: it ranks as before),
resumable after a copy stopped between batches, refused in one line where it cannot run.

The sources are real embedded stores (:class:`~arona_store.store.MemoryStore`) on files in
``tmp_path``, the PostgreSQL side a fresh database with pgvector (``store_database_url``).
Vectors are given with each memory (``NewNode.vector``), so only the ranking test's hybrid case
loads the model.
"""

from __future__ import annotations

import io
import os
import random
import sqlite3
import struct
import subprocess
import sys
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from arona_store.hybrid import vector_model_id
from arona_store.pg import schema
from arona_store.pg.copy import (
    CopyError,
    PostgresDatabase,
    SqliteFile,
    copy_command,
    copy_store,
)
from arona_store.ranking import Ranking, semantic_available
from arona_store.store import MemoryHit, MemoryStore, NewNode

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
DIMENSION = 384
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
SCOPES = ("episode:alice", "episode:bob", "episode", "fact:alice")
TEXTS = (
    "User: I went to the LGBTQ support group yesterday\nAssistant: That sounds powerful.",
    "User: My daughter Mia is allergic to peanuts.\nAssistant: Noted, no peanuts for Mia.",
    "User: 我最喜欢的茶是乌龙茶。\nAssistant: 乌龙茶很好喝。",
    "User: 私の猫の名前はタマです。\nAssistant: かわいい名前ですね。",
    "User: I am painting a sunrise over the lake this weekend.",
    "User: 東京に住んでいます。",
    "User: My car is a blue Honda and it needs new tyres.",
    "User: Mein Lieblingstee ist Pfefferminztee.",
    "User: We adopted a dog called Biscuit from the shelter.",
    "User: 我每天早上跑步，然后喝一杯乌龙茶。",
)
# Batches in the tests: several per store, so the stops and resumes fall between them.
BATCH = 40
MEMORIES = 180


class StandInModel:
    """What a hybrid store needs of its model when every memory comes with its vector: a name
    and a dimension. Embedding anything is a test's mistake."""

    model_id = "stand-in-model"
    dimension = DIMENSION

    def embed(self, texts: Any) -> Any:
        raise AssertionError("nothing is embedded: vectors are given")


class Killed(Exception):
    """The copy stopped in the middle of a batch (the process killed)."""


def _vector(rng: random.Random) -> bytes:
    return struct.pack(f"<{DIMENSION}e", *(rng.uniform(-1.0, 1.0) for _ in range(DIMENSION)))


def _build(path: Path, count: int = MEMORIES, seed: int = 7) -> None:
    """A hybrid store at ``path`` with ``count`` memories in several scopes: times over years
    (some at one instant, so keys collide), properties, related ids and source episodes, a
    third without a vector; then one memory said again (it moves) and one deleted."""
    rng = random.Random(seed)
    store = MemoryStore.open(path, ranking="hybrid", embedder=StandInModel())  # type: ignore[arg-type]
    try:
        ids: list[str] = []
        for i in range(count):
            at = NOW - timedelta(days=3 * (count - i), minutes=rng.randrange(600))
            if i % 17 == 0:
                at = datetime(1999, 12, 31, 23, 59, tzinfo=UTC)  # one instant, several memories
            node = NewNode(
                text=f"{TEXTS[i % len(TEXTS)]} ({i})",
                node_type=SCOPES[i % len(SCOPES)],
                created_at=at,
                source_episode_id=f"ep-{i // 3}" if i % 2 else None,
                related_node_ids=ids[-2:] if i % 5 == 0 else (),
                properties={"turn": str(i), "lang": "mixed"} if i % 4 == 0 else {},
                vector=None if i % 3 == 0 else _vector(rng),
            )
            ids.extend(store.add_many([node], embed=False))
        again = NewNode(
            text=f"{TEXTS[4 % len(TEXTS)]} (4)",
            node_type=SCOPES[4 % len(SCOPES)],
            created_at=NOW,
            properties={"turn": "4", "lang": "mixed"},
        )
        assert store.add_many([again], refresh=True, embed=False) == [ids[4]]
        assert store.delete(ids[9])
    finally:
        store.close()


def _sqlite(path: Path, sql: str) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(path)) as conn:
        return [tuple(row) for row in conn.execute(sql)]


def _everything(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """What an embedded store's file holds of its memories: every column of every memory, its
    vector, the vector model, and the indexes the write path keeps (context, character pairs)."""
    return {
        "nodes": _sqlite(path, "SELECT * FROM nodes ORDER BY seq"),
        "vectors": _sqlite(path, "SELECT node_id, vec FROM vectors ORDER BY node_id"),
        "model": _sqlite(path, "SELECT model FROM vector_model"),
        "context": _sqlite(path, "SELECT rowid, text FROM nodes_ctx ORDER BY rowid"),
        "pairs": _sqlite(path, "SELECT rowid, grams FROM nodes_cjk ORDER BY rowid"),
        "words": _sqlite(path, "SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH 'peanuts'"),
    }


def _pg(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with schema.connect(url) as conn:
        return [tuple(row) for row in conn.execute(sql, args)]


def _pg_vectors(url: str) -> dict[str, bytes]:
    """Each stored vector's float16 values, read from pgvector's own text form."""
    out: dict[str, bytes] = {}
    for node_id, text in _pg(
        url, "SELECT id, embedding::text FROM memory_nodes WHERE embedding IS NOT NULL"
    ):
        values = [float(v) for v in text.strip("[]").split(",")]
        out[node_id] = struct.pack(f"<{len(values)}e", *values)
    return out


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "memory.db"
    _build(path)
    return path


# -- lossless -----------------------------------------------------------------------------------


def test_a_store_copied_to_postgresql_and_back_is_the_same_memory_for_memory(
    source: Path, tmp_path: Path, store_database_url: str
) -> None:
    original = _everything(source)
    assert len(original["nodes"]) == MEMORIES - 1  # one deleted
    assert {row[2] for row in original["nodes"]} == set(SCOPES)
    assert 0 < len(original["vectors"]) < len(original["nodes"])  # some memories have none
    assert original["pairs"] and original["context"]

    there = copy_store(SqliteFile(source), PostgresDatabase(store_database_url), batch=BATCH)
    assert (there.copied, there.present) == (MEMORIES - 1, 0)
    assert there.with_vectors == len(original["vectors"])
    assert there.after == there.total == MEMORIES - 1

    # In PostgreSQL: every column as stored, every vector's values, the model named.
    columns = (
        "seq, id, node_type, text, created_at, source_episode_id, related_node_ids,"
        " properties, digest"
    )
    assert [
        (*row[:8], bytes(row[8]))
        for row in _pg(store_database_url, f"SELECT {columns} FROM memory_nodes ORDER BY seq")
    ] == original["nodes"]
    assert _pg_vectors(store_database_url) == dict(original["vectors"])
    assert (
        _pg(store_database_url, "SELECT value FROM memory_meta WHERE key = 'vector_model'")
        == original["model"]
    )
    # Each copied memory is in the change log that store processes follow, in key order.
    logged = _pg(store_database_url, "SELECT seq FROM memory_changes ORDER BY change")
    assert [seq for (seq,) in logged] == [row[0] for row in original["nodes"]]

    back = tmp_path / "back" / "memory.db"
    returned = copy_store(PostgresDatabase(store_database_url), SqliteFile(back), batch=BATCH)
    assert (returned.copied, returned.with_vectors) == (there.copied, there.with_vectors)
    assert _everything(back) == original


# -- a recall on the copy -----------------------------------------------------------------------

QUESTIONS: tuple[tuple[str, str | None], ...] = (
    ("Who is allergic to peanuts?", None),
    ("What did I paint at the lake?", "episode:alice"),
    ("我喜欢什么茶？", None),
    ("猫の名前は何ですか？", None),
    ("Where did I go yesterday, the support group?", "episode:bob"),
    ("What is the name of our dog from the shelter?", None),
)


def _semantic() -> bool:
    return semantic_available() or os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def model() -> Any:
    """The real model for the hybrid case; None without the extra (off CI)."""
    if not _semantic():
        return None
    from arona_store.embedding import Embedder

    return Embedder.load()


def _seen(hit: MemoryHit) -> tuple[str, str, str, float]:
    return (hit.node_id, hit.node_type, hit.text, hit.created_at)


@pytest.mark.parametrize("ranking", ["lexical", "hybrid"])
def test_a_recall_on_the_copy_ranks_as_on_the_original(
    ranking: Ranking, model: Any, tmp_path: Path, store_database_url: str
) -> None:
    if ranking == "hybrid" and model is None:
        pytest.skip("the semantic extra is not installed")
    embedder = model if ranking == "hybrid" else None
    original = MemoryStore.open(tmp_path / "memory.db", ranking=ranking, embedder=embedder)
    try:
        for i in range(60):
            at = NOW - timedelta(hours=7 * (60 - i))
            original.add_many([NewNode(TEXTS[i % len(TEXTS)], SCOPES[i % 3], at)])
        original.delete(original.query("Biscuit shelter", 1, now=NOW)[0].node_id)
        copy_store(SqliteFile(original.path), PostgresDatabase(store_database_url), batch=BATCH)
        back = tmp_path / "back.db"
        copy_store(PostgresDatabase(store_database_url), SqliteFile(back), batch=BATCH)
        copied = MemoryStore.open(back, ranking=ranking, embedder=embedder)
        try:
            assert copied.unembedded() == 0  # the vectors came along: nothing to embed again
            for question, scope in QUESTIONS:
                expected = original.query(question, 10, now=NOW, node_type=scope)
                assert expected, question
                hits = copied.query(question, 10, now=NOW, node_type=scope)
                # The same memories in the same order; the scores as the original's, up to
                # the word engine's float32 sums (its index there was built write by write).
                assert [_seen(h) for h in hits] == [_seen(h) for h in expected], question
                assert [h.score for h in hits] == pytest.approx([h.score for h in expected])
        finally:
            copied.close()
    finally:
        original.close()


# -- resumable ------------------------------------------------------------------------------------


def _stop_at(batch: int) -> Any:
    def hook(number: int) -> None:
        if number == batch:
            raise Killed

    return hook


def test_a_copy_into_postgresql_stopped_midway_finishes_without_duplicates_or_gaps(
    source: Path, store_database_url: str
) -> None:
    original = _everything(source)
    database = PostgresDatabase(store_database_url)
    with pytest.raises(Killed):
        copy_store(SqliteFile(source), database, batch=BATCH, before_commit=_stop_at(3))
    # The two batches committed are there; nothing of the third.
    held = _pg(store_database_url, "SELECT seq FROM memory_nodes ORDER BY seq")
    assert [seq for (seq,) in held] == [row[0] for row in original["nodes"][: 2 * BATCH]]

    again = copy_store(SqliteFile(source), database, batch=BATCH)
    assert (again.present, again.copied) == (2 * BATCH, MEMORIES - 1 - 2 * BATCH)
    assert again.after == MEMORIES - 1
    rows = _pg(store_database_url, "SELECT seq, id FROM memory_nodes ORDER BY seq")
    assert rows == [(row[0], row[1]) for row in original["nodes"]]
    assert _pg_vectors(store_database_url) == dict(original["vectors"])


def test_a_copy_back_stopped_midway_finishes_with_every_index_right(
    source: Path, tmp_path: Path, store_database_url: str
) -> None:
    original = _everything(source)
    database = PostgresDatabase(store_database_url)
    copy_store(SqliteFile(source), database, batch=BATCH)
    back = SqliteFile(tmp_path / "back.db")
    with pytest.raises(Killed):
        copy_store(database, back, batch=BATCH, before_commit=_stop_at(2))
    assert len(_sqlite(back.path, "SELECT seq FROM nodes")) == BATCH

    again = copy_store(database, back, batch=BATCH)
    assert (again.present, again.copied) == (BATCH, MEMORIES - 1 - BATCH)
    # The memories on each side of where it stopped have their neighbours in their context.
    assert _everything(back.path) == original


def test_a_destination_holding_other_memories_keeps_them_and_gains_every_one_of_the_source(
    source: Path, tmp_path: Path, store_database_url: str
) -> None:
    other = tmp_path / "other.db"
    _build(other, count=50, seed=11)  # its 1999 memories share keys with the source's
    database = PostgresDatabase(store_database_url)
    copy_store(SqliteFile(other), database, batch=BATCH)
    first = copy_store(SqliteFile(source), database, batch=BATCH)
    assert first.after == 49 + MEMORIES - 1
    stored = _pg(store_database_url, "SELECT id, node_type, text, created_at FROM memory_nodes")
    expected = [row[1:5] for row in _sqlite(source, "SELECT * FROM nodes")]
    expected += [row[1:5] for row in _sqlite(other, "SELECT * FROM nodes")]
    assert sorted(stored) == sorted(expected)

    # Run again (say, after the source took new memories): only the new ones are copied.
    later = MemoryStore.open(source, ranking="hybrid", embedder=StandInModel())  # type: ignore[arg-type]
    try:
        later.add_many(
            [NewNode("User: I started learning the cello.", "episode:alice", NOW)], embed=False
        )
    finally:
        later.close()
    out = io.StringIO()
    assert copy_command(str(source), store_database_url, out=out, err=io.StringIO()) == 0
    lines = out.getvalue().splitlines()
    assert lines[-2].startswith("store-copy: copied 1 memory (0 with vectors) in ")
    assert lines[-2].endswith(f"; {MEMORIES - 1:,} the destination held already")
    assert lines[-1] == (
        f"store-copy: the destination holds {49 + MEMORIES}: the source's {MEMORIES}"
        " and 49 of its own"
    )


# -- refused ------------------------------------------------------------------------------------


def test_vectors_of_another_model_are_refused_in_one_line(
    source: Path, store_database_url: str
) -> None:
    schema.migrate(store_database_url)
    with schema.connect(store_database_url) as conn:
        conn.execute("INSERT INTO memory_meta (key, value) VALUES ('vector_model', 'other/text')")
    with pytest.raises(CopyError) as refused:
        copy_store(SqliteFile(source), PostgresDatabase(store_database_url), batch=BATCH)
    message = str(refused.value)
    assert "\n" not in message
    assert "other/text" in message and vector_model_id(StandInModel()) in message  # type: ignore[arg-type]
    assert _pg(store_database_url, "SELECT count(*) FROM memory_nodes") == [(0,)]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, "store-copy", *args], capture_output=True, text=True, timeout=60, check=False
    )


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_the_command_copies_both_ways_and_says_what_it_did(
    source: Path, tmp_path: Path, store_database_url: str
) -> None:
    there = _run(str(source.parent), store_database_url)  # the data directory will do
    assert there.returncode == 0, there.stderr
    lines = there.stdout.splitlines()
    assert lines[0].startswith(f"store-copy: {MEMORIES - 1} memories (")
    assert f"from {source} to postgresql://" in lines[0]
    assert lines[-2].startswith(f"store-copy: copied {MEMORIES - 1} memories (")
    assert lines[-1] == f"store-copy: the source and the destination both hold {MEMORIES - 1}"

    back = tmp_path / "new" / "memory.db"
    returned = _run(store_database_url, str(back))
    assert returned.returncode == 0, returned.stderr
    assert returned.stdout.splitlines()[-1] == lines[-1]
    assert _everything(back) == _everything(source)

    again = _run(store_database_url, str(back))
    assert again.returncode == 0
    assert "copied 0 memories (0 with vectors)" in again.stdout
    assert f"; {MEMORIES - 1} the destination held already" in again.stdout


def test_progress_is_a_line_every_few_seconds(source: Path, store_database_url: str) -> None:
    ticks = iter(range(0, 1000, 3))  # each look at the clock, 3 s later
    out, err = io.StringIO(), io.StringIO()
    code = copy_command(
        str(source), store_database_url, out=out, err=err, clock=lambda: next(ticks), batch=BATCH
    )
    assert code == 0
    progress = err.getvalue().splitlines()
    assert progress[0].startswith(f"store-copy: {BATCH} of {MEMORIES - 1} memories (22%), ")
    assert progress[-1].startswith(f"store-copy: {4 * BATCH} of {MEMORIES - 1} memories (")
    assert "with vectors) in " in out.getvalue()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("a.db", "b.db"), "one of SOURCE and DEST must be a postgresql:// URL"),
        (("postgresql://127.0.0.1/a", "postgresql://127.0.0.1/b"), "one of SOURCE and DEST"),
        (("missing.db", "postgresql://127.0.0.1/a"), "missing.db: no embedded memory store there"),
        (("mysql://u:pw@127.0.0.1/m", "b.db"), "not a postgresql:// URL nor a file"),
    ],
)
def test_a_mistake_is_one_line(tmp_path: Path, args: tuple[str, str], said: str) -> None:
    done = subprocess.run(
        [COMMAND, "store-copy", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    line = _one_line_error(done)
    assert line.startswith("arona-gateway: error: ")
    assert said in line
    assert "pw@" not in line


def test_a_database_or_a_file_without_a_store_is_refused_and_left_alone(
    tmp_path: Path, store_database_url: str
) -> None:
    other = tmp_path / "conversations.db"
    with closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE conversations (id TEXT)")
    line = _one_line_error(_run(store_database_url, str(other)))
    assert "no memory store in this database" in line
    assert _pg(store_database_url, "SELECT to_regclass('memory_nodes')") == [(None,)]
    schema.migrate(store_database_url)
    for args in ((store_database_url, str(other)), (str(other), store_database_url)):
        line = _one_line_error(_run(*args))
        assert f"{other}: not an embedded memory store" in line
    assert _sqlite(other, "SELECT name FROM sqlite_master") == [("conversations",)]


def test_an_unreachable_database_is_said_without_its_password(source: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once closed
    line = _one_line_error(_run(str(source), f"postgresql://arona:s3cret-pw@127.0.0.1:{port}/m"))
    assert f"127.0.0.1:{port}" in line
    assert "s3cret-pw" not in line
