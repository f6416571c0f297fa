"""The embedded store's database: :class:`MemoryStore`, the one object the server calls.

:class:`MemoryStore` owns one SQLite database in WAL mode. It is synchronous and thread-safe.
Writes go through one connection and recalls through another, each behind its own lock: in WAL
mode a recall reads a consistent snapshot while a write is under way, so it never waits for
one. The node count and a count of changes live in the database (``counters``, kept by
triggers), so a recall reads them in the same snapshot as the nodes, and writes by any other
process are counted too.

Where each part lives:

- :mod:`arona_store.base`: what every backend shares (the write and recall entry points, the
  model, the ranking over the retrieval boundary); this module is the SQLite backend;
- :mod:`arona_store.nodes`: a node's row, its time-ordered key, :class:`StoreError`;
- :mod:`arona_store.schema`: tables, triggers and the migrations of older databases;
- :mod:`arona_store.writes`: the write path (keys, identical nodes refreshed);
- :mod:`arona_store.words`, :mod:`arona_store.cjk`: what a question is searched for;
- :mod:`arona_store.context`: each memory's context document (its neighbours);
- :mod:`arona_store.scoring`: the lexical score (words, context, recency for near-ties);
- :mod:`arona_store.retrieval`: the word index and node table the recall reads (FTS5 behind);
- :mod:`arona_store.lexical`: the lexical recall (candidates of both indexes);
- :mod:`arona_store.hybrid`: the hybrid recall (words and sentence embeddings);
- :mod:`arona_store.floor`: when nothing is relevant;
- :mod:`arona_store.vectors`, :mod:`arona_store.embedding`: the vectors and the model;
- :mod:`arona_store.pg`: the backend on PostgreSQL.

Opening a store merges each of its full-text indexes (:data:`FULL_TEXT_INDEXES`) into one
segment (FTS5 ``optimize``, a no-op when already merged): a bulk-loaded index otherwise costs
every query a probe per segment, and every ``bm25()`` a walk of each segment's matches. The
context index was once left out: a store of 100,000 memories loaded in batches of 5,000 kept it
in 8 segments, and its hybrid recall took 20.5 ms instead of 17.2.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from arona_store.base import DEFAULT_LIMIT, MAX_LIMIT, StoreBase, hit
from arona_store.hybrid import vector_model_id
from arona_store.nodes import MemoryHit, NewNode, Row, StoreError
from arona_store.ranking import Ranking, check_ranking
from arona_store.retrieval.engine_words import EngineWords
from arona_store.retrieval.fts5 import Fts5Words
from arona_store.retrieval.resident import ResidentNodes
from arona_store.retrieval.tantivy_index import SqliteDocuments, WordEngine, sqlite_snapshot
from arona_store.schema import (
    BUSY_TIMEOUT_MS,
    COUNTERS,
    FULL_TEXT_INDEXES,
    ensure_exp,
    prepare_schema,
    prepare_vectors,
)
from arona_store.writes import (
    FILL_VECTOR,
    UNEMBEDDED,
    UNEMBEDDED_COUNT,
    begin_write,
    delete_node,
    erase_deleted,
    unembedded_of,
    write_rows,
)

if TYPE_CHECKING:
    from arona_store.embedding import Embedder
    from arona_store.vectors import VectorIndex

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "MemoryHit", "MemoryStore", "NewNode", "StoreError"]

logger = logging.getLogger(__name__)

# Up to this many memories the word index is built before the store opens, beyond it while
# it runs (arona_store.retrieval.tantivy_index).
INLINE_WORD_INDEX = 20_000


class MemoryStore(StoreBase):
    """Nodes persisted in SQLite, recalled by words, context and meaning. Thread-safe; use
    :meth:`open`."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        reader: sqlite3.Connection,
        path: Path,
        embedder: Embedder | None = None,
    ) -> None:
        self._conn = conn  # writes, behind _lock
        self._reader = reader  # recalls and counts, behind _read_lock
        self.path = path
        self.backend = "sqlite"
        self.where = str(path)
        # The retrieval engines over the reader (arona_store.retrieval).
        engine = WordEngine(functools.partial(sqlite_snapshot, path))
        index: VectorIndex | None = None
        if embedder is not None:
            from arona_store.vectors import VectorIndex

            index = VectorIndex(embedder.dimension)
        self._resident = ResidentNodes(reader)
        self._vectors = index  # the same, typed as this store keeps it
        super().__init__(
            self._resident,
            engine,
            EngineWords(Fts5Words(reader), SqliteDocuments(reader), engine),
            embedder,
            index,
        )
        # Deleted nodes may still be in a full-text segment or the write-ahead log.
        self._erase_due = False

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        checkpoint_on_commit: bool = True,
        ranking: Ranking = "lexical",
        embedder: Embedder | None = None,
    ) -> MemoryStore:
        """Open (creating as needed, parent folders included) the database at ``path``.

        ``checkpoint_on_commit=False`` turns off SQLite's automatic WAL checkpoints, for an
        owner that calls :meth:`checkpoint` itself off its latency-sensitive path.

        ``ranking="hybrid"`` loads the embedding model (``embedder`` if given; it needs the
        ``semantic`` extra, :class:`~arona_store.ranking.RankingError` otherwise) and reads the
        stored vectors; nodes without one are embedded by :meth:`fill_vectors`.
        """
        ranking = check_ranking(ranking)
        if ranking == "hybrid" and embedder is None:
            from arona_store.embedding import Embedder

            embedder = Embedder.load()
        db_path = Path(path)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        # The server may drive the store from a thread that is not the opener's; a lock per
        # connection serialises its use, so sharing them across threads is safe.
        conn = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            # What a delete frees is zeroed, not left in the file (forget means gone).
            conn.execute("PRAGMA secure_delete=ON")
            if not checkpoint_on_commit:
                conn.execute("PRAGMA wal_autocheckpoint=0")
            prepare_schema(conn)
            if embedder is not None:
                prepare_vectors(conn, vector_model_id(embedder))
            for index in FULL_TEXT_INDEXES:
                conn.execute(f"INSERT INTO {index}({index}) VALUES ('optimize')")
            reader = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error:
            conn.close()
            raise
        try:
            reader.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            reader.execute("PRAGMA query_only=1")
            ensure_exp(reader)
        except sqlite3.Error:
            reader.close()
            conn.close()
            raise
        store = cls(conn, reader, db_path, embedder)
        with store._read_lock:
            store._reader.execute("BEGIN")
            try:
                store._resident.sync()
                if store._vectors is not None:
                    store._vectors.sync(store._reader)
            finally:
                store._reader.execute("COMMIT")
        # A small store's word index is ready when it opens (0.65 s per 10,000 memories).
        store._engine.start(inline=len(store._resident) <= INLINE_WORD_INDEX)
        logger.info("memory store opened at %s (ranking: %s)", db_path, store.ranking)
        return store

    def _put_vectors(self, pairs: list[tuple[bytes, str]]) -> None:
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(FILL_VECTOR, pairs)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _write(
        self, rows: list[Row], vectors: list[bytes | None], refresh: bool, *, wait: bool
    ) -> list[str] | None:
        if not begin_write(self._conn, wait):
            return None
        try:
            ids = write_rows(self._conn, rows, vectors, refresh)
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        return ids

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the database file (PASSIVE: waits for nobody).

        Stores opened with ``checkpoint_on_commit=False`` leave this to their owner, so that
        no write pays for it (a checkpoint syncs the database file)."""
        with self._lock:
            self._check_open()
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def _begin_read(self) -> None:
        self._reader.execute("BEGIN")

    def _end_read(self) -> None:
        self._reader.execute("COMMIT")

    def _catch_up(self) -> None:
        self._engine.mark(self._resident.sync())
        if self._vectors is not None:
            self._vectors.sync(self._reader)

    def _hits(self, ranked: list[tuple[float, int]]) -> list[MemoryHit]:
        if not ranked:
            return []
        marks = ", ".join("?" * len(ranked))
        rows = {
            row[0]: row
            for row in self._reader.execute(
                f"SELECT seq, id, node_type, text, created_at FROM nodes WHERE seq IN ({marks})",
                [seq for _, seq in ranked],
            )
        }
        return [hit(score, *rows[seq][1:]) for score, seq in ranked if seq in rows]

    def _unembedded_of(self, ids: list[str]) -> list[tuple[str, str]]:
        return unembedded_of(self._reader, ids)

    def _unembedded_below(self, below: int, batch: int) -> list[tuple[int, str, str]]:
        rows = self._reader.execute(UNEMBEDDED, (below, batch)).fetchall()
        return [(int(seq), str(node_id), str(text)) for seq, node_id, text in rows]

    def _unembedded_count(self) -> int:
        return int(self._reader.execute(UNEMBEDDED_COUNT).fetchone()[0])

    def delete_many(self, node_ids: Sequence[str]) -> list[bool]:
        """Remove nodes in one transaction, then erase them from the database's files; for
        each, whether it existed.

        Nothing of a deleted node is left once this returns: not its row, vector or index
        entries, not its words in its neighbours' context documents, and not in a full-text
        segment, a freed page or the write-ahead log (:func:`~arona_store.writes.erase_deleted`:
        a fraction of a second at 10,000 memories, so many deletes are best given at once).
        If the erasure fails the nodes are still deleted, and the next call erases them.
        """
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                found = [delete_node(self._conn, node_id) for node_id in node_ids]
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            if any(found):
                self._erase_due = True
            if self._erase_due:
                erase_deleted(self._conn)
                self._erase_due = False
            return found

    def count(self) -> int:
        """How many nodes are stored."""
        with self._read_lock:
            self._check_open()
            return int(self._reader.execute(COUNTERS).fetchone()[0])

    def close(self) -> None:
        """Close the database; idempotent. Later calls raise :class:`StoreError`."""
        with self._lock, self._read_lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            self._conn.close()
        self._engine.close()
        if self._query_embedding is not None:
            self._query_embedding.shutdown(wait=False, cancel_futures=True)
        if self._vectors is not None:
            self._vectors.close()
        logger.info("memory store closed")
