"""What every store backend shares: the write and recall entry points, the model, the ranking.

:class:`StoreBase` is the store the server calls, whatever keeps its memories: the embedded
store's SQLite file (:class:`arona_store.store.MemoryStore`) or PostgreSQL
(:class:`arona_store.pg.store.PgMemoryStore`). It checks what it is given, embeds, and runs
one ranking (:mod:`arona_store.lexical`, :mod:`arona_store.hybrid`) over the retrieval
boundary's interfaces (:mod:`arona_store.retrieval`: the node table, the word index, the
vectors), in one read snapshot of the backend a recall; a backend supplies those and its reads
and writes (the methods left to it below).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from arona_store.cjk import cjk_grams
from arona_store.floor import first_person, names_held, names_unknown
from arona_store.hybrid import embedding_text, hybrid_ranked, query_vector
from arona_store.lexical import LexicalRanker
from arona_store.nodes import MemoryHit, NewNode, Row, StoreError, Timestamp, epoch, now_key
from arona_store.ranking import Ranking
from arona_store.retrieval import NodeTable, VectorSearch
from arona_store.retrieval.engine_words import EngineWords
from arona_store.retrieval.tantivy_index import WordEngine
from arona_store.words import MAX_QUERY_TERMS, query_terms
from arona_store.writes import NodeItem, rows_of

if TYPE_CHECKING:
    from arona_store.embedding import Embedder
    from arona_store.vectors import Vector

DEFAULT_LIMIT = 10
MAX_LIMIT = 100
# Threads embedding queries (as many as recalls run at once: arona_store.server).
QUERY_EMBEDDING_THREADS = 2
# Nodes embedded per step of the background fill.
FILL_BATCH = 32


class StoreBase:
    """Nodes recalled by words, context and meaning (module docstring). Thread-safe: writes
    behind one lock, recalls behind another, each on a connection of its own."""

    # What keeps the memories ("sqlite", "postgresql"), and where (a path, a URL without its
    # credentials), as errors and logs say it.
    backend = ""
    where = ""

    def __init__(
        self,
        nodes: NodeTable,
        engine: WordEngine,
        words: EngineWords,
        embedder: Embedder | None,
        index: VectorSearch | None,
    ) -> None:
        self._lock = threading.Lock()  # the writer connection
        self._read_lock = threading.Lock()  # the reader connection
        self._closed = False
        self._nodes = nodes
        self._engine = engine
        self._words = words
        self._lexical = LexicalRanker(words, nodes)
        # Hybrid ranking only: the model and the vectors.
        self._embedder = embedder
        self._index = index if embedder is not None else None
        # Hybrid ranking: the threads that embed queries while their words are looked up.
        self._query_embedding: ThreadPoolExecutor | None = None
        if embedder is not None:
            self._query_embedding = ThreadPoolExecutor(
                max_workers=QUERY_EMBEDDING_THREADS, thread_name_prefix="arona-store-query"
            )
        # The background fill's cursor: nodes below this key may still lack a vector.
        self._fill_below = 2**63 - 1

    @property
    def ranking(self) -> Ranking:
        """``hybrid`` when the store embeds its nodes, ``lexical`` otherwise."""
        return "lexical" if self._embedder is None else "hybrid"

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
            missing = self._unembedded_of(list(ids))
        if not missing:
            return 0
        vectors = self.embed([text for _, text in missing])
        self._put_vectors([(vec, node[0]) for node, vec in zip(missing, vectors, strict=True)])
        return len(missing)

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
            self._begin_read()
            try:
                self._catch_up()
                self._words.begin()
                held, unknown = names_held(self._words, text, node_type)
                if names_unknown(held, unknown):
                    return []  # it asks about something this memory never heard of
                if self._index is None or pending is None:
                    ranked = self._lexical.ranked(terms, grams, limit, at, node_type)
                else:
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
                self._end_read()
        finally:
            self._read_lock.release()

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
            return self._unembedded_count()

    def fill_vectors(self, batch: int = FILL_BATCH) -> int:
        """Embed up to ``batch`` nodes that have no vector, newest first, and store their
        vectors; how many (0 once every node older than the first call has one, and always
        for a lexical store). Blocks for the embedding (milliseconds a node): call it from a
        worker thread, again until it returns 0."""
        if self._embedder is None:
            return 0
        with self._read_lock:
            self._check_open()
            rows = self._unembedded_below(self._fill_below, batch)
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

    # What a backend supplies.

    def delete_many(self, node_ids: Sequence[str]) -> list[bool]:
        """Remove nodes in one transaction, leaving no trace of them in the backend's indexes
        or files; for each, whether it existed."""
        raise NotImplementedError

    def count(self) -> int:
        """How many nodes are stored."""
        raise NotImplementedError

    def checkpoint(self) -> None:
        """The backend's periodic upkeep, off every write's path (the server calls it)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the store; idempotent. Later calls raise :class:`StoreError`."""
        raise NotImplementedError

    def _add_rows(
        self, rows: list[Row], vectors: list[bytes | None], refresh: bool, *, wait: bool
    ) -> list[str] | None:
        """Write ``rows`` in one transaction (``refresh``: an identical stored node moves to
        the new time instead, :mod:`arona_store.writes`); their ids, or None at once if
        ``wait`` is off and another writer holds the writer lock or the database."""
        if self._embedder is None:
            # A lexical store keeps no vectors (it may not have their table).
            vectors = [None] * len(rows)
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            self._check_open()
            return self._write(rows, vectors, refresh, wait=wait)
        finally:
            self._lock.release()

    def _write(
        self, rows: list[Row], vectors: list[bytes | None], refresh: bool, *, wait: bool
    ) -> list[str] | None:
        """:meth:`_add_rows`'s transaction (writer lock held): None at once if ``wait`` is off
        and another process holds the database's write lock."""
        raise NotImplementedError

    def _begin_read(self) -> None:
        """Open the recall's read snapshot on the reader connection (read lock held)."""
        raise NotImplementedError

    def _end_read(self) -> None:
        """Close the recall's read snapshot."""
        raise NotImplementedError

    def _catch_up(self) -> None:
        """Bring the node table, the word engine's dirty keys and the vectors up to the
        snapshot (read snapshot open)."""
        raise NotImplementedError

    def _hits(self, ranked: list[tuple[float, int]]) -> list[MemoryHit]:
        """The nodes of ``ranked`` (score, seq) as hits, in that order, scores clamped to
        [0, 1] (read snapshot open)."""
        raise NotImplementedError

    def _unembedded_of(self, ids: list[str]) -> list[tuple[str, str]]:
        """Of the nodes ``ids``, those stored without a vector, as (id, text) (read lock
        held)."""
        raise NotImplementedError

    def _unembedded_below(self, below: int, batch: int) -> list[tuple[int, str, str]]:
        """Up to ``batch`` nodes without a vector below the key ``below``, newest first, as
        (seq, id, text) (read lock held)."""
        raise NotImplementedError

    def _unembedded_count(self) -> int:
        """How many nodes have no vector (read lock held)."""
        raise NotImplementedError

    def _put_vectors(self, pairs: list[tuple[bytes, str]]) -> None:
        """Store (vector, node id) pairs in one transaction; a node deleted meanwhile gets
        none."""
        raise NotImplementedError


def hit(score: float, node_id: str, node_type: str, text: str, created_at: float) -> MemoryHit:
    """A ranked node as the recall returns it, its score clamped to [0, 1]."""
    return MemoryHit(
        node_id=node_id,
        node_type=node_type,
        text=text,
        score=min(1.0, max(0.0, score)),
        created_at=created_at,
    )
