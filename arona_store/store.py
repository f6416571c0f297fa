"""The embedded store's database: :class:`MemoryStore`, the one object the server calls.

:class:`MemoryStore` owns one SQLite database in WAL mode. It is synchronous and thread-safe.
Writes go through one connection and recalls through another, each behind its own lock: in WAL
mode a recall reads a consistent snapshot while a write is under way, so it never waits for
one. The node count and a count of changes live in the database (``counters``, kept by
triggers), so a recall reads them in the same snapshot as the nodes, and writes by any other
process are counted too.

Where each part lives:

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
- :mod:`arona_store.vectors`, :mod:`arona_store.embedding`: the vectors and the model.

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
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from arona_store.cjk import cjk_grams
from arona_store.floor import first_person, names_held, names_unknown
from arona_store.hybrid import embedding_text, hybrid_ranked, query_vector, vector_model_id
from arona_store.lexical import LexicalRanker
from arona_store.nodes import MemoryHit, NewNode, Row, StoreError, Timestamp, epoch, now_key
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
from arona_store.words import MAX_QUERY_TERMS, query_terms
from arona_store.writes import (
    FILL_VECTOR,
    UNEMBEDDED,
    UNEMBEDDED_COUNT,
    NodeItem,
    begin_write,
    delete_node,
    erase_deleted,
    rows_of,
    unembedded_of,
    write_rows,
)

if TYPE_CHECKING:
    from arona_store.embedding import Embedder
    from arona_store.vectors import Vector, VectorIndex

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "MemoryHit", "MemoryStore", "NewNode", "StoreError"]

logger = logging.getLogger(__name__)

DEFAULT_LIMIT = 10
MAX_LIMIT = 100
# Threads embedding queries (as many as recalls run at once: arona_store.server).
QUERY_EMBEDDING_THREADS = 2
# Up to this many memories the word index is built before the store opens, beyond it while
# it runs (arona_store.retrieval.tantivy_index).
INLINE_WORD_INDEX = 20_000
# Nodes embedded per step of the background fill.
FILL_BATCH = 32


class MemoryStore:
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
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._closed = False
        # The retrieval engines over the reader (arona_store.retrieval), and what the lexical
        # recall learns about the words (reader only).
        self._nodes = ResidentNodes(reader)
        self._engine = WordEngine(functools.partial(sqlite_snapshot, path))
        self._words = EngineWords(Fts5Words(reader), SqliteDocuments(reader), self._engine)
        self._lexical = LexicalRanker(self._words, self._nodes)
        self.path = path
        # Hybrid ranking only: the model and the vectors' in-memory copy (reader only).
        self._embedder = embedder
        self._index: VectorIndex | None = None
        # Hybrid ranking: the threads that embed queries while their words are looked up.
        self._query_embedding: ThreadPoolExecutor | None = None
        if embedder is not None:
            from arona_store.vectors import VectorIndex

            self._index = VectorIndex(embedder.dimension)
            self._query_embedding = ThreadPoolExecutor(
                max_workers=QUERY_EMBEDDING_THREADS, thread_name_prefix="arona-store-query"
            )
        # The background fill's cursor: nodes below this key may still lack a vector.
        self._fill_below = 2**63 - 1
        # Deleted nodes may still be in a full-text segment or the write-ahead log.
        self._erase_due = False

    @property
    def ranking(self) -> Ranking:
        """``hybrid`` when the store embeds its nodes, ``lexical`` otherwise."""
        return "lexical" if self._embedder is None else "hybrid"

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
                store._nodes.sync()
                if store._index is not None:
                    store._index.sync(store._reader)
            finally:
                store._reader.execute("COMMIT")
        # A small store's word index is ready when it opens (0.65 s per 10,000 memories).
        store._engine.start(inline=len(store._nodes) <= INLINE_WORD_INDEX)
        logger.info("memory store opened at %s (ranking: %s)", db_path, store.ranking)
        return store

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the memory store is closed")

    def add(
        self,
        text: str,
        node_type: str = "episode",
        created_at: Timestamp | None = None,
        *,
        source_episode_id: str | None = None,
        related_node_ids: Sequence[str] = (),
        properties: Mapping[str, str] | None = None,
        refresh: bool = False,
    ) -> str:
        """Persist one node and return its id (a new UUID string).

        With ``refresh``, a node identical to a stored one moves that node to ``created_at``
        instead (never back in time) and returns its id (:mod:`arona_store.writes`).
        """
        node = NewNode(
            text=text,
            node_type=node_type,
            created_at=created_at,
            source_episode_id=source_episode_id,
            related_node_ids=related_node_ids,
            properties=dict(properties or {}),
        )
        return self.add_many([node], refresh=refresh)[0]

    def add_many(
        self,
        nodes: Iterable[NodeItem],
        *,
        refresh: bool = False,
        embed: bool = True,
    ) -> list[str]:
        """Persist many nodes in one transaction (the bulk-load path); returns their ids.

        Items are :class:`NewNode` or ``(text, node_type[, created_at])`` tuples. ``refresh``
        as for :meth:`add`. A hybrid store embeds the nodes given without a vector first
        (milliseconds each), unless ``embed`` is off: they then wait for :meth:`fill_vectors`.
        """
        rows, vectors = rows_of(nodes)
        if embed:
            vectors = self._with_vectors(rows, vectors)
        ids = self._add_rows(rows, vectors, refresh, wait=True)
        assert ids is not None  # a waiting call always gets to write
        return ids

    def try_add_many(
        self,
        nodes: Iterable[NodeItem],
        *,
        refresh: bool = False,
        embed: bool = True,
    ) -> list[str] | None:
        """Like :meth:`add_many`, but None at once, having written nothing, if another caller
        (a thread here, or another process) is writing; for callers that must not wait."""
        rows, vectors = rows_of(nodes)
        if embed:
            vectors = self._with_vectors(rows, vectors)
        return self._add_rows(rows, vectors, refresh, wait=False)

    def _with_vectors(self, rows: list[Row], vectors: list[bytes | None]) -> list[bytes | None]:
        """Every node's vector for a hybrid store (embedding those without), none for a
        lexical one."""
        if self._embedder is None:
            return vectors
        missing = [i for i, vector in enumerate(vectors) if vector is None]
        if missing:
            from arona_store.vectors import to_blob

            embedded = self._embedder.embed([embedding_text(rows[i][3]) for i in missing])
            vectors = list(vectors)
            for i, vector in zip(missing, embedded, strict=True):
                vectors[i] = to_blob(vector)
        return vectors

    def embed(self, texts: Sequence[str]) -> list[bytes]:
        """The stored form of ``texts``' vectors (hybrid store only), to pass as
        :attr:`NewNode.vector`; callers that must not spend milliseconds on a thread embed
        with this elsewhere first."""
        if self._embedder is None:
            raise StoreError("a lexical store does not embed")
        from arona_store.vectors import to_blob

        return [
            to_blob(vector) for vector in self._embedder.embed([embedding_text(t) for t in texts])
        ]

    def fill_missing(self, ids: Sequence[str]) -> int:
        """Embed and store the vectors of those nodes ``ids`` that have none (hybrid store only;
        blocks for the embedding: call it from a worker thread); how many. A node that has one
        (a refresh keeps its identical node's) is not embedded again; a node deleted meanwhile,
        even while its text is embedded, gets none (:meth:`_put_vectors`)."""
        if self._embedder is None:
            return 0
        with self._read_lock:
            self._check_open()
            missing = unembedded_of(self._reader, list(ids))
        if not missing:
            return 0
        vectors = self.embed([text for _, text in missing])
        self._put_vectors([(vec, node[0]) for node, vec in zip(missing, vectors, strict=True)])
        return len(missing)

    def _put_vectors(self, pairs: list[tuple[bytes, str]]) -> None:
        """Store (vector, node id) pairs in one transaction; a node deleted meanwhile gets
        none."""
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(FILL_VECTOR, pairs)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _add_rows(
        self, rows: list[Row], vectors: list[bytes | None], refresh: bool, *, wait: bool
    ) -> list[str] | None:
        if self._embedder is None:
            # A lexical store keeps no vectors (it may not have their table).
            vectors = [None] * len(rows)
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            self._check_open()
            if not begin_write(self._conn, wait):
                return None
            try:
                ids = write_rows(self._conn, rows, vectors, refresh)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return ids
        finally:
            self._lock.release()

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the database file (PASSIVE: waits for nobody).

        Stores opened with ``checkpoint_on_commit=False`` leave this to their owner, so that
        no write pays for it (a checkpoint syncs the database file)."""
        with self._lock:
            self._check_open()
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def query(
        self,
        text: str,
        limit: int = DEFAULT_LIMIT,
        now: Timestamp | None = None,
        node_type: str | None = None,
    ) -> list[MemoryHit]:
        """The best ``limit`` nodes for ``text``, best first (:mod:`arona_store.lexical`,
        :mod:`arona_store.hybrid`).

        ``node_type`` (the wire's ``node_type_filter``) keeps only nodes of exactly that type;
        their scores are the ones they have without the filter.
        """
        hits = self._query(text, limit, now, node_type, wait=True)
        assert hits is not None  # a waiting call always gets the lock
        return hits

    def try_query(
        self,
        text: str,
        limit: int = DEFAULT_LIMIT,
        now: Timestamp | None = None,
        node_type: str | None = None,
    ) -> list[MemoryHit] | None:
        """Like :meth:`query`, but None at once if another caller holds the store.

        For callers that must not wait behind a write (an event loop thread): they can run
        the query elsewhere when it returns None.
        """
        return self._query(text, limit, now, node_type, wait=False)

    def _query(
        self,
        text: str,
        limit: int,
        now: Timestamp | None,
        node_type: str | None,
        *,
        wait: bool,
    ) -> list[MemoryHit] | None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise StoreError(f"limit must be an integer between 1 and {MAX_LIMIT}")
        terms = query_terms(text)
        if not terms:
            return []
        grams = cjk_grams(text)[:MAX_QUERY_TERMS]
        at = now_key(epoch(now))
        pending: Future[Vector | None] | None = None
        if self._embedder is not None and self._query_embedding is not None:
            # Embedded on another thread while the words' candidates are looked up.
            try:
                pending = self._query_embedding.submit(query_vector, self._embedder, text)
            except RuntimeError:  # its threads are stopped: the store is closed
                self._check_open()
                raise
        try:
            return self._ranked_hits(text, terms, grams, limit, at, node_type, pending, wait)
        finally:
            if pending is not None:
                pending.cancel()  # not needed after all (nothing to rank, or busy)

    def _ranked_hits(
        self,
        text: str,
        terms: list[str],
        grams: list[str],
        limit: int,
        at: int,
        node_type: str | None,
        pending: Future[Vector | None] | None,
        wait: bool,
    ) -> list[MemoryHit] | None:
        if not self._read_lock.acquire(blocking=wait):
            return None
        try:
            self._check_open()
            # One read transaction: counts, matches and nodes all come from one snapshot,
            # whatever is committed meanwhile.
            self._reader.execute("BEGIN")
            try:
                self._engine.mark(self._nodes.sync())
                self._words.begin()
                held, unknown = names_held(self._words, text, node_type)
                if names_unknown(held, unknown):
                    return []  # it asks about something this memory never heard of
                if self._index is None or pending is None:
                    ranked = self._lexical.ranked(terms, grams, limit, at, node_type)
                else:
                    self._index.sync(self._reader)
                    ranked = hybrid_ranked(
                        self._nodes,
                        self._lexical,
                        self._index,
                        terms,
                        grams,
                        pending.result,
                        limit,
                        at,
                        node_type,
                        personal=held > 0 or first_person(text),
                    )
                return self._hits(ranked)
            finally:
                self._reader.execute("COMMIT")
        finally:
            self._read_lock.release()

    def _hits(self, ranked: list[tuple[float, int]]) -> list[MemoryHit]:
        """The nodes of ``ranked`` (score, seq) as hits, in that order (read transaction
        open)."""
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
        return [
            MemoryHit(
                node_id=row[1],
                node_type=row[2],
                text=row[3],
                score=min(1.0, max(0.0, score)),
                created_at=row[4],
            )
            for score, seq in ranked
            if (row := rows.get(seq)) is not None
        ]

    def wait_for_words(self, timeout: float) -> bool:
        """Wait until the word engine is built and holds every write a recall has taken in
        (a large store builds it while it already answers); whether it did within ``timeout``
        seconds."""
        return self._engine.wait_clean(timeout)

    def unembedded(self) -> int:
        """How many nodes have no vector yet (0 for a lexical store)."""
        if self._embedder is None:
            return 0
        with self._read_lock:
            self._check_open()
            return int(self._reader.execute(UNEMBEDDED_COUNT).fetchone()[0])

    def fill_vectors(self, batch: int = FILL_BATCH) -> int:
        """Embed up to ``batch`` nodes that have no vector, newest first, and store their
        vectors; how many (0 once every node older than the first call has one, and always
        for a lexical store). Blocks for the embedding (milliseconds a node): call it from a
        worker thread, again until it returns 0."""
        if self._embedder is None:
            return 0
        with self._read_lock:
            self._check_open()
            rows = self._reader.execute(UNEMBEDDED, (self._fill_below, batch)).fetchall()
        if not rows:
            return 0
        vectors = self.embed([text for _, _, text in rows])
        self._put_vectors([(vec, row[1]) for row, vec in zip(rows, vectors, strict=True)])
        self._fill_below = min(seq for seq, _, _ in rows)
        return len(rows)

    def delete(self, node_id: str) -> bool:
        """Remove a node (and its index entries, and its words from its neighbours' context);
        True if it existed. See :meth:`delete_many`."""
        return self.delete_many([node_id])[0]

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
        if self._index is not None:
            self._index.close()
        logger.info("memory store closed")
