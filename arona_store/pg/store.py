"""The memory store on PostgreSQL: :class:`PgMemoryStore`, what the server calls instead of the
embedded store's :class:`~arona_store.store.MemoryStore` when given a database URL.

The database is the source of truth (:mod:`arona_store.pg.schema`); a store process holds only
what is derived from it (:mod:`arona_store.pg.retrieval`: the node table and the word engine,
built from the database when it opens, then kept up by the change log), so any number of store
processes serve the same memories:

- a write takes the write lock (:data:`~arona_store.pg.schema.WRITE_LOCK`, a transaction-level
  advisory lock) for its transaction, so identical stores through two processes are one memory
  (the second finds the first, :mod:`arona_store.writes`: a Writeback retried through another
  store process stores one node, not two), and the change log's numbers commit in order;
- a recall reads one snapshot (``REPEATABLE READ``) and first catches up with the change log in
  it: a memory written through another process is recalled at once, and a deleted one is gone
  from every process's next recall (the word engine's copy of it is dirty until its next commit,
  and a dirty key is read from the snapshot, where the memory is gone);
- vectors are pgvector's (``halfvec``, HNSW), searched in the database: a store process holds
  none of them.

The ranking is the embedded store's, over the same interfaces (:mod:`arona_store.base`), so the
same memories rank the same on both backends; the character pairs of Chinese, Japanese and
Korean text, an FTS5 index of their own in the embedded store, are a field of the word engine
here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from arona_common.redact import redact_url
from arona_store.base import StoreBase, hit
from arona_store.hybrid import vector_model_id
from arona_store.nodes import MemoryHit, Row
from arona_store.pg import schema
from arona_store.pg.link import Link
from arona_store.pg.retrieval import (
    PgDocuments,
    PgNodes,
    PgSnapshots,
    PgVectors,
    PgWords,
    snapshot_reader,
    vector_text,
)
from arona_store.ranking import Ranking, RankingError, check_ranking
from arona_store.retrieval.engine_words import EngineWords
from arona_store.retrieval.tantivy_index import WordEngine

if TYPE_CHECKING:
    from arona_store.embedding import Embedder

logger = logging.getLogger(__name__)

# How many changes the log keeps (checkpoint prunes older ones): a store process that has not
# read it for that many changes reads every node again (arona_store.pg.retrieval.PgNodes).
KEEP_CHANGES = 100_000

_TWIN = (
    "SELECT seq, id FROM memory_nodes WHERE digest = %s AND node_type = %s AND text = %s"
    " AND source_episode_id IS NOT DISTINCT FROM %s AND related_node_ids = %s"
    " AND properties = %s ORDER BY seq DESC LIMIT 1"
)
_KEYS_FROM = "SELECT seq FROM memory_nodes WHERE seq >= %s ORDER BY seq LIMIT 1000"
_INSERT = (
    "INSERT INTO memory_nodes (seq, id, node_type, text, created_at, source_episode_id,"
    " related_node_ids, properties, digest, embedding)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s::halfvec)"
)
_MOVE = "UPDATE memory_nodes SET seq = %s, created_at = %s WHERE seq = %s"
_PUT_VECTOR = "UPDATE memory_nodes SET embedding = %s::halfvec WHERE id = %s AND embedding IS NULL"
_HITS = "SELECT seq, id, node_type, text, created_at FROM memory_nodes WHERE seq = ANY(%s)"
_UNEMBEDDED_OF = "SELECT id, text FROM memory_nodes WHERE id = ANY(%s) AND embedding IS NULL"
_UNEMBEDDED = (
    "SELECT seq, id, text FROM memory_nodes WHERE embedding IS NULL AND seq < %s"
    " ORDER BY seq DESC LIMIT %s"
)


def halfvec_text(blob: bytes | None) -> str | None:
    """A vector as the embedded store keeps it (float16, little-endian) in pgvector's text
    form (every float16 is printed exactly, so it is stored back as the same value)."""
    if blob is None:
        return None
    return vector_text(np.frombuffer(blob, dtype="<f2").astype(np.float32))


class PgMemoryStore(StoreBase):
    """Nodes persisted in PostgreSQL, recalled by words, context and meaning. Thread-safe; use
    :meth:`open`."""

    def __init__(self, url: str, writer: Link, reader: Link, embedder: Embedder | None) -> None:
        self._writer = writer  # writes, behind _lock
        self._reader = reader  # recalls, behind _read_lock
        self.backend = "postgresql"
        self.where = redact_url(url)
        self._snapshots = PgSnapshots(url)
        engine = WordEngine(self._snapshots)
        self._pg_nodes = PgNodes(reader)
        super().__init__(
            self._pg_nodes,
            engine,
            EngineWords(PgWords(self._pg_nodes), PgDocuments(reader), engine, pairs=True),
            embedder,
            PgVectors(reader, self._pg_nodes),
        )

    @classmethod
    def open(
        cls, url: str, *, ranking: Ranking = "lexical", embedder: Embedder | None = None
    ) -> PgMemoryStore:
        """Open the store in the database at ``url``, bringing its schema up to date
        (:func:`~arona_store.pg.schema.migrate`: one-line errors), and build this process's
        word engine from it before answering (its time is logged)."""
        ranking = check_ranking(ranking)
        if ranking == "hybrid" and embedder is None:
            from arona_store.embedding import Embedder

            embedder = Embedder.load()
        if embedder is not None and embedder.dimension != schema.DIMENSION:
            raise RankingError(
                f"the store on PostgreSQL keeps {schema.DIMENSION}-dimension vectors; "
                f"the model gives {embedder.dimension}"
            )
        schema.migrate(url)
        writer = Link(url, schema.open_connection)
        reader = Link(url, snapshot_reader)
        try:
            if embedder is not None:
                _prepare_vectors(writer, vector_model_id(embedder))
        except BaseException:
            writer.close()
            raise
        store = cls(url, writer, reader, embedder)
        with store._read_lock:
            try:
                store._pg_nodes.sync()
            finally:
                reader.rollback()
        store._engine.start(inline=True)
        logger.info("memory store opened on %s (ranking: %s)", store.where, store.ranking)
        return store

    def _write(
        self, rows: list[Row], vectors: list[bytes | None], refresh: bool, *, wait: bool
    ) -> list[str] | None:
        with self._writer.transaction() as conn:
            if wait:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (schema.WRITE_LOCK,))
            else:
                locked = conn.execute(
                    "SELECT pg_try_advisory_xact_lock(%s)", (schema.WRITE_LOCK,)
                ).fetchone()[0]
                if not locked:
                    return None
            return _write_rows(conn, rows, vectors, refresh)

    def _put_vectors(self, pairs: list[tuple[bytes, str]]) -> None:
        with self._lock:
            self._check_open()
            with self._writer.transaction() as conn, conn.cursor() as cursor:
                cursor.executemany(
                    _PUT_VECTOR, [(halfvec_text(vec), node_id) for vec, node_id in pairs]
                )

    def _begin_read(self) -> None:
        pass  # the reader's first statement opens its snapshot (snapshot_reader)

    def _end_read(self) -> None:
        self._reader.rollback()

    def _catch_up(self) -> None:
        self._engine.mark(self._pg_nodes.sync())

    def _hits(self, ranked: list[tuple[float, int]]) -> list[MemoryHit]:
        if not ranked:
            return []
        rows = {
            int(row[0]): row
            for row in self._reader.execute(_HITS, ([seq for _, seq in ranked],)).fetchall()
        }
        return [hit(score, *rows[seq][1:]) for score, seq in ranked if seq in rows]

    def _read(self, sql: str, params: Sequence[Any]) -> list[Any]:
        """One statement's rows on the reader, in a snapshot of its own (read lock held)."""
        try:
            return list(self._reader.execute(sql, params).fetchall())
        finally:
            self._reader.rollback()

    def _unembedded_of(self, ids: list[str]) -> list[tuple[str, str]]:
        if not ids:
            return []
        return [(str(i), str(t)) for i, t in self._read(_UNEMBEDDED_OF, (ids,))]

    def _unembedded_below(self, below: int, batch: int) -> list[tuple[int, str, str]]:
        rows = self._read(_UNEMBEDDED, (below, batch))
        return [(int(seq), str(node_id), str(text)) for seq, node_id, text in rows]

    def _unembedded_count(self) -> int:
        return int(
            self._read("SELECT count(*) FROM memory_nodes WHERE embedding IS NULL", ())[0][0]
        )

    def delete_many(self, node_ids: Sequence[str]) -> list[bool]:
        """Remove nodes in one transaction; for each, whether it existed. Every store
        process's next recall is without them (module docstring). PostgreSQL keeps a deleted
        row's bytes in its data files until they are vacuumed and overwritten, and in its
        write-ahead log until it is recycled (see docs/forgetting.md)."""
        with self._lock:
            self._check_open()
            with self._writer.transaction() as conn:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (schema.WRITE_LOCK,))
                return [
                    conn.execute(
                        "DELETE FROM memory_nodes WHERE id = %s RETURNING seq", (node_id,)
                    ).fetchone()
                    is not None
                    for node_id in node_ids
                ]

    def count(self) -> int:
        with self._read_lock:
            self._check_open()
            return int(self._read("SELECT count(*) FROM memory_nodes", ())[0][0])

    def checkpoint(self) -> None:
        """Prune the change log to its last :data:`KEEP_CHANGES` changes."""
        with self._lock:
            self._check_open()
            with self._writer.transaction() as conn:
                conn.execute(
                    "DELETE FROM memory_changes"
                    " WHERE change <= (SELECT max(change) FROM memory_changes) - %s",
                    (KEEP_CHANGES,),
                )

    def close(self) -> None:
        with self._lock, self._read_lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            self._writer.close()
        self._engine.close()
        self._snapshots.close()
        if self._query_embedding is not None:
            self._query_embedding.shutdown(wait=False, cancel_futures=True)
        logger.info("memory store closed")


def _prepare_vectors(writer: Link, model_id: str) -> None:
    """Drop the stored vectors if they come from another model than ``model_id`` (the
    background fill embeds the nodes again), and record the model."""
    with writer.transaction() as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (schema.WRITE_LOCK,))
        row = conn.execute("SELECT value FROM memory_meta WHERE key = 'vector_model'").fetchone()
        if row is not None and row[0] == model_id:
            return
        if row is not None:
            logger.info("memory store: vectors of model %s dropped for %s", row[0], model_id)
            conn.execute("UPDATE memory_nodes SET embedding = NULL WHERE embedding IS NOT NULL")
        conn.execute(
            "INSERT INTO memory_meta (key, value) VALUES ('vector_model', %s)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (model_id,),
        )


def _write_rows(
    conn: Any, rows: list[Row], vectors: list[bytes | None], refresh: bool
) -> list[str]:
    """:func:`arona_store.writes.write_rows` on PostgreSQL (write lock held): insert ``rows``,
    or with ``refresh`` move their identical stored nodes to their time; their ids."""
    ids: list[str] = []
    resume: dict[int, int] = {}
    for row, vector in zip(rows, vectors, strict=True):
        wanted = row[0]
        twin = None
        if refresh:
            _, _, node_type, text, _, source, related, properties, digest = row
            found = conn.execute(
                _TWIN, (digest, node_type, text, source, related, properties)
            ).fetchone()
            twin = None if found is None else (int(found[0]), str(found[1]))
        if twin is not None:
            twin_seq, twin_id = twin
            ids.append(twin_id)
            if vector is not None:
                conn.execute(_PUT_VECTOR, (halfvec_text(vector), twin_id))
            if twin_seq >= wanted:
                continue  # already at least that recent
            key = _free_key(conn, resume.get(wanted, wanted))
            resume[wanted] = key + 1
            conn.execute(_MOVE, (key, row[4], twin_seq))
            continue
        key = _free_key(conn, resume.get(wanted, wanted))
        resume[wanted] = key + 1
        conn.execute(_INSERT, (key, *row[1:], halfvec_text(vector)))
        ids.append(row[1])
    return ids


def _free_key(conn: Any, key: int) -> int:
    """The first key at or after ``key`` that no node holds (write lock held)."""
    while True:
        taken = [int(row[0]) for row in conn.execute(_KEYS_FROM, (key,))]
        for seq in taken:
            if seq != key:
                return key
            key += 1
        if len(taken) < 1000:
            return key
