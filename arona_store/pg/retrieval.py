"""The retrieval boundary's PostgreSQL side: what a recall on the store on PostgreSQL reads.

The ranking is the embedded store's (:mod:`arona_store.lexical`, :mod:`arona_store.hybrid`),
behind the same interfaces (:mod:`arona_store.retrieval`), read in one snapshot of the
database (a ``REPEATABLE READ`` transaction on the store process's reader connection):

- :class:`PgNodes`, the node table: each memory's id and node type by key, in memory (as the
  embedded store's :class:`~arona_store.retrieval.resident.ResidentNodes`), following the
  database by its change log (``memory_changes``, :mod:`arona_store.pg.schema`), whoever
  wrote: the memories written or deleted through another store process are in the next recall's
  node table, and the keys whose documents changed go to the word engine as dirty;
- :class:`PgDocuments`, what the word engine indexes (each memory's own text and its context
  document, made from its neighbours' texts in the same statement: nothing is stored twice);
- :class:`PgVectors`, the nearest vectors: pgvector's HNSW index in the database, with
  ``hnsw.iterative_scan`` on, so a scope's filter does not leave it short; a small scope's own
  memories are compared exactly, so it gets all of its own nearest however many others there
  are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from arona_store.context import AFTER, BEFORE
from arona_store.retrieval import Field
from arona_store.retrieval.resident import KeyTable, near
from arona_store.retrieval.tantivy_index import Document, Documents

if TYPE_CHECKING:
    from arona_store.vectors import Vector

# A memory's context document (arona_store.context): the texts of BEFORE nodes of its type
# before it, its own, and AFTER after it, in key order, one per line.
_WINDOW = (
    "concat_ws(E'\\n', "
    + ", ".join(f"lag(text, {i}) OVER w" for i in range(BEFORE, 0, -1))
    + ", text, "
    + ", ".join(f"lead(text, {i}) OVER w" for i in range(1, AFTER + 1))
    + ")"
)
_ALL_DOCUMENTS = (
    f"SELECT seq, node_type, text, {_WINDOW} FROM memory_nodes"
    " WINDOW w AS (PARTITION BY node_type ORDER BY seq) ORDER BY seq DESC"
)
_DOCUMENTS_OF = (
    "SELECT n.seq, n.node_type, n.text, concat_ws(E'\\n',"
    " (SELECT string_agg(b.text, E'\\n' ORDER BY b.seq) FROM (SELECT seq, text FROM memory_nodes"
    f"  WHERE node_type = n.node_type AND seq < n.seq ORDER BY seq DESC LIMIT {BEFORE}) b),"
    " n.text,"
    " (SELECT string_agg(a.text, E'\\n' ORDER BY a.seq) FROM (SELECT seq, text FROM memory_nodes"
    f"  WHERE node_type = n.node_type AND seq > n.seq ORDER BY seq LIMIT {AFTER}) a))"
    " FROM memory_nodes n WHERE n.seq = ANY(%s) ORDER BY n.seq DESC"
)
_ALL_NODES = "SELECT seq, id, node_type FROM memory_nodes ORDER BY seq"
_NODES_OF = "SELECT seq, id, node_type FROM memory_nodes WHERE seq = ANY(%s)"
_TEXTS_OF = "SELECT seq, text FROM memory_nodes WHERE seq = ANY(%s)"
_LAST_CHANGE = "SELECT coalesce(max(change), 0), coalesce(min(change), 0) FROM memory_changes"
_CHANGES_SINCE = "SELECT change, seq FROM memory_changes WHERE change > %s ORDER BY change"
_NEAREST = (
    "SELECT id, 1 - (embedding <=> %(q)s::halfvec) FROM memory_nodes"
    " WHERE embedding IS NOT NULL{scope} ORDER BY embedding <=> %(q)s::halfvec LIMIT %(k)s"
)
# Every vector of one scope, the nearest first: exact (the CTE keeps the HNSW index out).
_NEAREST_IN_SCOPE = (
    "WITH scope AS MATERIALIZED (SELECT id, embedding FROM memory_nodes"
    " WHERE node_type = %(t)s AND embedding IS NOT NULL)"
    " SELECT id, 1 - (embedding <=> %(q)s::halfvec) FROM scope"
    " ORDER BY embedding <=> %(q)s::halfvec LIMIT %(k)s"
)
_COSINES_OF = (
    "SELECT id, 1 - (embedding <=> %s::halfvec) FROM memory_nodes"
    " WHERE id = ANY(%s) AND embedding IS NOT NULL"
)
# Candidates an HNSW scan keeps (pgvector's default is 40; more for a search of more than half
# as many).
EF_SEARCH = 100
# What each reader connection sets once: a scope's filter is applied after the index is
# scanned, so an iterative scan goes on until k nodes of the scope are found (bounded by
# hnsw.max_scan_tuples).
READER_SETTINGS = f"SET hnsw.iterative_scan = strict_order; SET hnsw.ef_search = {EF_SEARCH}"
# A scope of up to this many memories is searched exactly, every vector compared (about a
# millisecond for 2,000): an approximate index scan filtered to a small scope may miss some of
# its nearest, however far it iterates.
EXACT_SCOPE = 2_000


def vector_text(vector: Vector) -> str:
    """A vector in pgvector's text form (a Python list's is one: ``[0.5, -0.25]``)."""
    return str(vector.tolist())


class PgDocuments:
    """:class:`~arona_store.retrieval.tantivy_index.Documents` read through ``conn``'s open
    transaction."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def all(self) -> Iterable[Document]:
        # A server-side cursor: the store's memories are not all held at once.
        with self._conn.cursor(name="arona_documents") as cursor:
            cursor.itersize = 2_000
            cursor.execute(_ALL_DOCUMENTS)
            for seq, node_type, text, context in cursor:
                yield int(seq), str(node_type), str(text), str(context)

    def of(self, keys: Sequence[int]) -> list[Document]:
        rows = self._conn.execute(_DOCUMENTS_OF, (list(keys),)).fetchall()
        return [(int(s), str(t), str(x), str(c)) for s, t, x, c in rows]


def snapshot_reader(url: str) -> Any:
    """A connection whose every transaction reads one snapshot (``REPEATABLE READ``, read
    only): a recall's, or the word engine's; end each with ``rollback()``."""
    from psycopg import IsolationLevel

    from arona_store.pg.schema import open_connection

    conn = open_connection(url, autocommit=True)
    conn.execute(READER_SETTINGS)
    conn.autocommit = False
    conn.isolation_level = IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    return conn


@contextmanager
def pg_snapshot(url: str) -> Iterator[Documents]:
    """A connection of its own with a snapshot open, closed after."""
    conn = snapshot_reader(url)
    try:
        yield PgDocuments(conn)
        conn.rollback()
    finally:
        conn.close()


class PgSnapshots:
    """The word engine's snapshots of the database (its thread only), on one connection kept
    for as long as the engine runs (a new connection is a new server process for PostgreSQL),
    opened again after it was lost."""

    def __init__(self, url: str) -> None:
        from arona_store.pg.link import Link

        self._link = Link(url, snapshot_reader)

    @contextmanager
    def __call__(self) -> Iterator[Documents]:
        try:
            yield PgDocuments(self._link)
        finally:
            self._link.rollback()

    def close(self) -> None:
        self._link.close()


class PgNodes(KeyTable):
    """:class:`~arona_store.retrieval.NodeTable` in memory, following the database's change
    log through the store's reader connection: call :meth:`sync` in each recall's transaction
    before anything else."""

    def __init__(self, reader: Any) -> None:
        super().__init__()
        self._reader = reader
        self._last: int | None = None

    @property
    def last_change(self) -> int:
        """The newest change of the log this table holds (0 before the first sync)."""
        return self._last or 0

    def sync(self) -> set[int] | None:
        """Catch up with the open transaction's snapshot; the keys whose own text or context
        document changed since the last sync (those named by the change log, and their
        neighbours before and after, old and new), None on the first sync or when the log no
        longer reaches back to the last one (every node read again)."""
        last, first = self._reader.execute(_LAST_CHANGE).fetchone()
        if self._last is not None and last == self._last:
            return set()
        if self._last is None or (first > self._last + 1 and self._last > 0):
            self._load()
            self._last = int(last)
            return None
        changes = self._reader.execute(_CHANGES_SINCE, (self._last,)).fetchall()
        keys = sorted({int(seq) for _, seq in changes})
        changed = set(keys)
        for seq in keys:
            node_type = self._type_of.get(seq)
            if node_type is not None:
                changed.update(near(self._keys[node_type], seq))
                self._drop(seq)
        for seq, node_id, node_type in self._reader.execute(_NODES_OF, (keys,)):
            moved = self._key_of.get(node_id)
            if moved is not None:  # moved from a key pruned from the log's reach
                changed.update(near(self._keys[self._type_of[moved]], moved))
                changed.add(moved)
                self._drop(moved)
            self._put(int(seq), str(node_id), str(node_type))
        for seq in keys:
            node_type = self._type_of.get(seq)
            if node_type is not None:
                changed.update(near(self._keys[node_type], seq))
        self._last = int(changes[-1][0]) if changes else int(last)
        return changed

    def _load(self) -> None:
        self._id_of, self._key_of, self._type_of, self._keys = {}, {}, {}, {}
        with self._reader.cursor(name="arona_nodes") as cursor:
            cursor.itersize = 10_000
            cursor.execute(_ALL_NODES)
            for seq, node_id, node_type in cursor:
                self._put(int(seq), str(node_id), str(node_type))

    def texts(self, seqs: Sequence[int]) -> dict[int, str]:
        if not seqs:
            return {}
        rows = self._reader.execute(_TEXTS_OF, (list(seqs),))
        return {int(seq): str(text) for seq, text in rows}


class PgWords:
    """What answers for the word engine before it is built (the store on PostgreSQL builds it
    before it answers, and again only after the change log was pruned past a lagging process):
    nothing matches meanwhile (a recall finds memories by meaning only). The node count is the
    node table's."""

    def __init__(self, nodes: PgNodes) -> None:
        self._nodes = nodes

    def counters(self) -> tuple[int, int]:
        return len(self._nodes), self._nodes.last_change

    def count(self, field: Field, word: str) -> int:
        return 0

    def top(
        self,
        field: Field,
        words: Sequence[str],
        depth: int,
        node_type: str | None,
        counts: object = None,
    ) -> dict[int, float]:
        return {}

    def scores(self, field: Field, words: Sequence[str], seqs: Sequence[int]) -> dict[int, float]:
        return {}

    def held(self, words: Sequence[str], seqs: Sequence[int]) -> dict[int, int]:
        return {}

    def holds(self, word: str, node_type: str | None) -> bool:
        return False


class PgVectors:
    """:class:`~arona_store.retrieval.VectorSearch` in the database, read through the recall's
    transaction (so a deleted node is never named): pgvector's HNSW index, or every vector of
    a small scope (:data:`EXACT_SCOPE`; ``nodes`` says how many a scope holds)."""

    def __init__(self, reader: Any, nodes: KeyTable) -> None:
        self._reader = reader
        self._nodes = nodes
        # The last query's text form: a recall searches and then scores with one vector.
        self._query: Vector | None = None
        self._query_text = ""

    def _text(self, query: Vector) -> str:
        if query is not self._query:
            self._query, self._query_text = query, vector_text(query)
        return self._query_text

    def top_nodes(
        self, query: Vector, k: int, node_type: str | None = None
    ) -> list[tuple[float, str]]:
        if k <= 0:
            return []
        if node_type is not None and self._nodes.count_of(node_type) <= EXACT_SCOPE:
            rows = self._reader.execute(
                _NEAREST_IN_SCOPE, {"q": self._text(query), "k": k, "t": node_type}
            )
            return [(float(cosine), str(node_id)) for node_id, cosine in rows]
        if 2 * k > EF_SEARCH:
            self._reader.execute(f"SET LOCAL hnsw.ef_search = {2 * k}")
        sql = _NEAREST.format(scope=" AND node_type = %(t)s" if node_type is not None else "")
        rows = self._reader.execute(sql, {"q": self._text(query), "k": k, "t": node_type})
        return [(float(cosine), str(node_id)) for node_id, cosine in rows]

    def cosines(self, query: Vector, node_ids: list[str]) -> list[float | None]:
        if not node_ids:
            return []
        rows = self._reader.execute(_COSINES_OF, (self._text(query), node_ids))
        found = {str(node_id): float(cosine) for node_id, cosine in rows}
        return [found.get(node_id) for node_id in node_ids]
