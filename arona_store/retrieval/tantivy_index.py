"""The word engine that proposes a recall's candidates: tantivy, in memory, built from the database.

A recall's first step is the best matches of the question's words in each memory's own text and
in its context document. SQLite FTS5 has no way to find the best few without scoring every
match (``bm25()`` on each, so the store only ranked the newest 2,000): about 2.3 ms of CPU a
recall at 10,000 memories. tantivy ranks every match with block-max WAND in about 0.2 ms.
So :class:`WordEngine` proposes the candidates (keys only), and FTS5 still gives each of them
its exact BM25 in the recall's own snapshot (:meth:`~arona_store.retrieval.fts5.Fts5Words.scores`):
the scores and the ranking are unchanged, and whatever tantivy holds, a recall never returns
anything its snapshot does not hold.

The index is derived data, held in memory only (nothing of a forgotten memory is ever written
to a file by it): :meth:`WordEngine.start` builds it from the database on a thread of its own
(:data:`~arona_store.retrieval.tantivy_index` build time: about 0.65 s per 10,000 memories),
and until it is ready the recall proposes its candidates with FTS5 as before.

Writes reach it through the node table (:class:`~arona_store.retrieval.resident.ResidentNodes`
says which keys' documents changed at each recall's sync): those keys are **dirty**. A recall
takes tantivy's matches minus the dirty keys, and matches the dirty keys themselves with FTS5
(they are few and mostly the newest, where FTS5's walk starts). The engine's thread brings the
dirty keys' documents into tantivy in one commit (a tantivy commit costs 10-15 ms of CPU, so
not one per write) once :data:`REFRESH_KEYS` are dirty or :data:`REFRESH_S` after the first;
then they are clean again. A change it cannot name (a memory's text rewritten in place) has
the index built again.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import tantivy

from arona_store.retrieval import Field
from arona_store.retrieval.fts5 import Fts5Words
from arona_store.retrieval.resident import ResidentNodes

logger = logging.getLogger(__name__)

# Dirty keys that have the engine's thread commit them at once, and how long a dirty key waits
# at most otherwise (seconds).
REFRESH_KEYS = 256
REFRESH_S = 1.0
# How many times as many matches as a recall asks for the engine proposes (EngineWords.top).
TIE_MARGIN = 2
# The memory tantivy's writer may use before it writes a segment (bytes; its floor is 15 MB).
WRITER_HEAP = 50_000_000

_FIELD: dict[Field, str] = {"turn": "turn", "context": "context"}
_NODES_OF = "SELECT seq, node_type, text FROM nodes WHERE seq IN (SELECT value FROM json_each(?))"
_CONTEXTS_OF = "SELECT rowid, text FROM nodes_ctx WHERE rowid IN (SELECT value FROM json_each(?))"
# Newest first: the first documents of a segment win its ties (WordEngine.top).
_ALL_NODES = "SELECT seq, node_type, text FROM nodes ORDER BY seq DESC"
_ALL_CONTEXTS = "SELECT rowid, text FROM nodes_ctx"


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_integer_field("seq", indexed=True, fast=True)
    builder.add_text_field("node_type", tokenizer_name="raw", index_option="basic")
    builder.add_text_field("turn", tokenizer_name="en_stem", index_option="freq")
    builder.add_text_field("context", tokenizer_name="en_stem", index_option="freq")
    return builder.build()


class WordEngine:
    """tantivy over every memory's own text and context document (module docstring)."""

    def __init__(self, db_path: Path) -> None:
        self._db_path = db_path
        self._schema = _schema()
        # What the index's tokenizer ("en_stem") does to a question's word.
        self._analyzer = (
            tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.stemmer("english"))
            .build()
        )
        self._lock = threading.Lock()
        # Notified each time dirty keys are brought in (wait_clean).
        self._cleaned = threading.Condition(self._lock)
        self._index: tantivy.Index | None = None
        self._searcher: tantivy.Searcher | None = None
        # key -> the generation it was last marked dirty in; every key while unknown (None).
        self._dirty: dict[int, int] = {}
        self._generation = 0
        self._rebuild = True
        self._first_dirty = 0.0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._searcher is not None

    def start(self, *, inline: bool) -> None:
        """Build the index from the database (here if ``inline``, else on the engine's thread:
        recalls propose their candidates with FTS5 meanwhile), and keep it up on a thread of
        its own."""
        if inline:
            self._build()
        self._thread = threading.Thread(target=self._run, name="arona-store-words", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def wait_clean(self, timeout: float) -> bool:
        """Wait until the index is ready and holds every document as marked so far; whether it
        does within ``timeout`` seconds."""
        with self._cleaned:
            return self._cleaned.wait_for(
                lambda: self._searcher is not None and not self._dirty, timeout
            )

    def mark(self, changed: Iterable[int] | None) -> None:
        """The documents of the keys ``changed`` differ from the index's (None: any may; the
        index is built again)."""
        with self._lock:
            self._generation += 1
            if changed is None:
                self._rebuild = True
                self._searcher = None
                self._dirty.clear()
                self._wake.set()
                return
            before = len(self._dirty)
            for key in changed:
                self._dirty[key] = self._generation
            if before == 0 and self._dirty:
                self._first_dirty = time.monotonic()
            if len(self._dirty) >= REFRESH_KEYS:
                self._wake.set()

    def top(
        self, field: Field, words: Sequence[str], depth: int, node_type: str | None
    ) -> tuple[list[int], list[int]] | None:
        """The keys of the best ``depth`` matches of ``words`` in ``field`` (of ``node_type``
        when given) that the index holds as the database does, and the dirty keys, which the
        caller matches itself; None until the index is ready."""
        terms = list(dict.fromkeys(t for word in words for t in self._analyzer.analyze(word)))
        with self._lock:
            searcher, dirty = self._searcher, list(self._dirty)
        if searcher is None:
            return None
        if not terms:
            return [], dirty
        schema = self._schema
        query = tantivy.Query.boolean_query(
            [
                (tantivy.Occur.Should, tantivy.Query.term_query(schema, _FIELD[field], term))
                for term in terms
            ]
        )
        if node_type is not None:
            query = tantivy.Query.boolean_query(
                [
                    (tantivy.Occur.Must, query),
                    (
                        tantivy.Occur.Must,
                        tantivy.Query.const_score_query(
                            tantivy.Query.term_query(schema, "node_type", node_type), 0.0
                        ),
                    ),
                ]
            )
        skip = set(dirty)
        hits = searcher.search(query, depth + len(skip), count=False).hits
        keys = searcher.fast_field_values("seq", [address for _, address in hits])
        found = [int(key) for key in keys if key is not None and int(key) not in skip]
        return found[:depth], dirty

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                rebuild = self._rebuild
                due = bool(self._dirty) and (
                    len(self._dirty) >= REFRESH_KEYS
                    or time.monotonic() - self._first_dirty >= REFRESH_S
                )
            try:
                if rebuild:
                    self._build()
                elif due:
                    self._refresh()
            except Exception:
                # The recall proposes its candidates with FTS5 meanwhile; try again later.
                logger.warning("memory store: the word index could not be updated", exc_info=True)
                with self._lock:
                    self._searcher = None
                    self._rebuild = True
                self._wake.wait(REFRESH_S)
            self._wake.wait(REFRESH_S / 4)
            self._wake.clear()

    def _build(self) -> None:
        """Index every memory of a snapshot of the database."""
        started = time.monotonic()
        with self._lock:
            generation = self._generation
            self._rebuild = False
        index = tantivy.Index(self._schema)
        writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
        with _snapshot(self._db_path) as conn:
            contexts = dict(conn.execute(_ALL_CONTEXTS).fetchall())
            count = 0
            for seq, node_type, text in conn.execute(_ALL_NODES):
                writer.add_document(self._document(seq, node_type, text, contexts.get(seq, "")))
                count += 1
                if self._stopping:
                    return
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        with self._lock:
            if self._rebuild:
                return  # a change it cannot name came in meanwhile: built again
            self._index = index
            self._searcher = index.searcher()
            logger.info(
                "memory store: word index built from the database (%d memories, %.1f s)",
                count,
                time.monotonic() - started,
            )
            self._clean(generation)

    def _refresh(self) -> None:
        """Bring the dirty keys' documents into the index, in one commit."""
        with self._lock:
            generation = self._generation
            keys = list(self._dirty)
            index = self._index
        if index is None or not keys:
            return
        import json

        with _snapshot(self._db_path) as conn:
            rows = conn.execute(_NODES_OF, (json.dumps(keys),)).fetchall()
            contexts = dict(conn.execute(_CONTEXTS_OF, (json.dumps(keys),)).fetchall())
        writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
        for key in keys:
            writer.delete_documents_by_term("seq", key)
        for seq, node_type, text in rows:
            writer.add_document(self._document(seq, node_type, text, contexts.get(seq, "")))
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        searcher = index.searcher()
        with self._lock:
            if self._index is index and not self._rebuild:
                self._searcher = searcher
                self._clean(generation)

    def _clean(self, generation: int) -> None:
        """Keys marked dirty up to ``generation`` are now as the index holds them (lock held)."""
        self._dirty = {k: g for k, g in self._dirty.items() if g > generation}
        if self._dirty:
            self._first_dirty = time.monotonic()
        self._cleaned.notify_all()

    def _document(self, seq: int, node_type: str, text: str, context: str) -> tantivy.Document:
        document = tantivy.Document()
        document.add_integer("seq", int(seq))
        document.add_text("node_type", node_type)
        document.add_text("turn", text)
        document.add_text("context", context)
        return document


class _snapshot:
    """A read-only connection to the database with a read transaction open."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)

    def __enter__(self) -> sqlite3.Connection:
        self._conn.execute("BEGIN")
        return self._conn

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.execute("COMMIT")
        finally:
            self._conn.close()


class EngineWords:
    """:class:`~arona_store.retrieval.WordIndex` whose best matches of the words come from
    the :class:`WordEngine` (FTS5's until it is ready), everything else from FTS5."""

    def __init__(self, fts: Fts5Words, nodes: ResidentNodes, engine: WordEngine) -> None:
        self._fts = fts
        self._nodes = nodes
        self._engine = engine

    def counters(self) -> tuple[int, int]:
        return self._fts.counters()

    def count(self, field: Field, word: str) -> int:
        return self._fts.count(field, word)

    def top(
        self,
        field: Field,
        words: Sequence[str],
        depth: int,
        node_type: str | None,
        counts: Mapping[str, int] | None = None,
    ) -> dict[int, float]:
        found = (
            None
            if field == "pairs"
            else self._engine.top(field, words, TIE_MARGIN * depth, node_type)
        )
        if found is None:
            return self._fts.top(field, words, depth, node_type, counts)
        keys, dirty = found
        if node_type is not None:
            dirty = [k for k in dirty if self._nodes.type_of(k) == node_type]
        else:
            dirty = [k for k in dirty if self._nodes.type_of(k) is not None]
        # Each proposed key's BM25 in this snapshot; the best ``depth``, the newest first
        # among equal scores as FTS5's walk keeps them (a bulk of templated memories ties
        # often, and the engine's own order among ties is not that).
        scored = self._fts.scores(field, words, sorted(set(keys).union(dirty)))
        best = sorted(scored.items(), key=lambda kv: (-kv[1], -kv[0]))
        return dict(best[:depth])

    def scores(self, field: Field, words: Sequence[str], seqs: Sequence[int]) -> dict[int, float]:
        return self._fts.scores(field, words, seqs)

    def held(self, words: Sequence[str], seqs: Sequence[int]) -> dict[int, int]:
        return self._fts.held(words, seqs)

    def holds(self, word: str, node_type: str | None) -> bool:
        return self._fts.holds(word, node_type)
