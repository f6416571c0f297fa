"""The store's word engine: tantivy, in memory, built from the database.

:class:`WordEngine` holds every memory's own text (``turn``) and context document
(``context``) in a tantivy index, with each memory's key and node type; the recall reads it
through :class:`~arona_store.retrieval.engine_words.EngineWords`. SQLite FTS5 cannot find the
best few matches without scoring every one (``bm25()`` on each, so the store only ranked the
newest 2,000, and each statement calling ``bm25()`` first counts every match of every word in
the whole index); tantivy ranks every match with block-max WAND in a fraction of a millisecond,
whatever the store's size.

The index is derived data, held in memory only (nothing of a forgotten memory is ever written
to a file by it): :meth:`WordEngine.start` builds it from the database (0.65 s per 10,000
memories; before the store opens, or on the engine's thread for a large store, FTS5 answering
meanwhile) and logs one line when it is built.

Writes reach it through the node table (:class:`~arona_store.retrieval.resident.ResidentNodes`
says which keys' documents changed at each recall's sync): those keys are **dirty**
(:meth:`WordEngine.mark`), and each recall scores them from its own snapshot. The engine's
thread brings their documents into the index in one commit (a tantivy commit costs 10-15 ms of
CPU, so not one per write) once :data:`REFRESH_KEYS` are dirty or :data:`REFRESH_S` after the
first; then they are clean again. A change the keys cannot tell (a memory's text rewritten in
place) has the index built again.

tantivy's Python API says neither how many documents its BM25 counts (deleted ones count until
a merge drops them) nor the fields' average lengths; two probe documents (:data:`PROBES`) give
both from their scores (:meth:`WordEngine._calibrated`), for the dirty memories' scores.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import tantivy

from arona_store.cjk import cjk_index_text
from arona_store.retrieval import Field

logger = logging.getLogger(__name__)

# Dirty keys that have the engine's thread commit them at once, and how long a dirty key waits
# at most otherwise (seconds).
REFRESH_KEYS = 256
REFRESH_S = 1.0
# tantivy's BM25 parameters.
K1 = 1.2
B = 0.75


def _fieldnorms() -> list[int]:
    """tantivy's document-length buckets (``fieldnorm/code.rs``): exact up to 40, then eight
    buckets for each doubling of the step."""
    table = list(range(41))
    step = 2
    while len(table) < 256:
        for _ in range(8):
            table.append(table[-1] + step)
        step *= 2
    return table[:256]


FIELDNORMS = _fieldnorms()


def bucketed(length: int) -> int:
    """A document length as tantivy stores it (the bucket at or below it)."""
    return FIELDNORMS[bisect.bisect_right(FIELDNORMS, length) - 1]


def tantivy_idf(total: int, held: int) -> float:
    """A word's IDF in tantivy's BM25 (Lucene's): ``ln(1 + (N - n + 0.5) / (n + 0.5))``."""
    return math.log(1.0 + max(0.0, total - held + 0.5) / (held + 0.5)) or 1e-9


# Two documents only the engine holds (keys no memory has; never returned: EngineWords), of a
# made-up word, from whose scores the engine's document count and average lengths are worked
# out (WordEngine._calibrated).
PROBE_WORD = "qzxvkprobe"
PROBE_TYPE = "\x00probe"
PROBE_LENGTHS = (1, 4)
PROBES = ((-(2**63), PROBE_WORD), (-(2**63) + 1, f"{PROBE_WORD} qzxvka qzxvkb qzxvkc"))
PROBE_KEYS = frozenset(key for key, _ in PROBES)

# How many times as many matches as a recall asks for the engine proposes (EngineWords.top).
TIE_MARGIN = 2
# The memory tantivy's writer may use before it writes a segment (bytes; its floor is 15 MB).
WRITER_HEAP = 50_000_000

# Newest first, as _ALL_NODES.
_NODES_OF = (
    "SELECT seq, node_type, text FROM nodes WHERE seq IN (SELECT value FROM json_each(?))"
    " ORDER BY seq DESC"
)
_CONTEXTS_OF = "SELECT rowid, text FROM nodes_ctx WHERE rowid IN (SELECT value FROM json_each(?))"


# A memory as the engine indexes it: key, node type, own text, context document.
Document = tuple[int, str, str, str]


class Documents(Protocol):
    """The memories of one snapshot of the database, as the engine indexes them."""

    def all(self) -> Iterable[Document]:
        """Every memory, newest first (the first documents of a segment win its ties:
        WordEngine.top)."""
        ...

    def of(self, keys: Sequence[int]) -> list[Document]:
        """The memories at ``keys`` that the snapshot holds, newest first."""
        ...


# A new snapshot of the database each time it is entered (the engine's own connection).
Snapshots = Callable[[], AbstractContextManager[Documents]]


class SqliteDocuments:
    """:class:`Documents` of the store's SQLite file, read through ``conn``'s snapshot (read
    transaction open): each memory's text from ``nodes``, its context document from
    ``nodes_ctx``."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def all(self) -> Iterable[Document]:
        contexts = dict(self._conn.execute(_ALL_CONTEXTS).fetchall())
        for seq, node_type, text in self._conn.execute(_ALL_NODES):
            yield int(seq), str(node_type), str(text), str(contexts.get(seq, ""))

    def of(self, keys: Sequence[int]) -> list[Document]:
        listed = json.dumps(list(keys))
        contexts = {int(k): str(text) for k, text in self._conn.execute(_CONTEXTS_OF, (listed,))}
        return [
            (int(seq), str(node_type), str(text), contexts.get(int(seq), ""))
            for seq, node_type, text in self._conn.execute(_NODES_OF, (listed,))
        ]


@contextlib.contextmanager
def sqlite_snapshot(path: Path) -> Iterator[Documents]:
    """A read-only connection to the store's file with a read transaction open."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        conn.execute("BEGIN")
        try:
            yield SqliteDocuments(conn)
        finally:
            conn.execute("COMMIT")
    finally:
        conn.close()


_ALL_NODES = "SELECT seq, node_type, text FROM nodes ORDER BY seq DESC"
_ALL_CONTEXTS = "SELECT rowid, text FROM nodes_ctx"


# The words of a memory: runs of letters and digits (as FTS5's unicode61 and
# arona_store.words.WORD), lower-cased, accents folded, English-stemmed (Snowball).
TOKENIZER = "arona_words"
# The character pairs of its Chinese, Japanese and Korean text (arona_store.cjk), as they are.
PAIRS_TOKENIZER = "arona_pairs"
# The fields a document holds, each scored by BM25 (EngineWords).
FIELDS: tuple[Field, ...] = ("turn", "context", "pairs")


def analyzer() -> tantivy.TextAnalyzer:
    """The analyzer the index and the questions' words go through (:data:`TOKENIZER`)."""
    return (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(40))
        .filter(tantivy.Filter.lowercase())
        .filter(tantivy.Filter.ascii_fold())
        .filter(tantivy.Filter.stemmer("english"))
        .build()
    )


def pairs_analyzer() -> tantivy.TextAnalyzer:
    """What the ``pairs`` field goes through (:data:`PAIRS_TOKENIZER`): the pairs are written
    lower-cased and space-separated (:func:`arona_store.cjk.cjk_index_text`)."""
    return tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build()


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_integer_field("seq", indexed=True, fast=True)
    builder.add_text_field("node_type", tokenizer_name="raw", index_option="basic")
    builder.add_text_field("turn", tokenizer_name=TOKENIZER, index_option="freq")
    builder.add_text_field("context", tokenizer_name=TOKENIZER, index_option="freq")
    builder.add_text_field("pairs", tokenizer_name=PAIRS_TOKENIZER, index_option="freq")
    return builder.build()


@dataclass(frozen=True)
class WordView:
    """What one recall reads of the engine: a searcher, the dirty keys (key -> the generation
    they were marked in: their documents in the searcher are not the database's), and each
    field's average length in tokens as the searcher's BM25 has it."""

    searcher: tantivy.Searcher
    dirty: Mapping[int, int]
    # What the searcher's BM25 counts as the number of documents (WordEngine._calibrated).
    total: int
    average: Mapping[str, float]


class WordEngine:
    """tantivy over every memory's own text and context document (module docstring)."""

    def __init__(self, snapshots: Snapshots) -> None:
        """An engine over the database that ``snapshots`` reads."""
        self._snapshots = snapshots
        self._schema = _schema()
        self.schema = self._schema
        self.analyzer = analyzer()
        self._total = 0
        self._average: dict[str, float] = {}
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
        self._flush = False
        self._wake = threading.Event()
        self._stopping = False
        self._failing = False
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
            self._flush = True  # now, not when REFRESH_S is up
            self._wake.set()
            return self._cleaned.wait_for(
                lambda: self._searcher is not None and not self._dirty, timeout
            )

    def mark(self, changed: Collection[int] | None) -> None:
        """The documents of the keys ``changed`` differ from the index's (None: any may; the
        index is built again; none: nothing to do)."""
        if changed is not None and not changed:
            return
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

    def view(self) -> WordView | None:
        """The index as it is now, for one recall; None until it is ready."""
        with self._lock:
            if self._searcher is None:
                return None
            return WordView(self._searcher, dict(self._dirty), self._total, dict(self._average))

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                rebuild = self._rebuild
                due = bool(self._dirty) and (
                    self._flush
                    or len(self._dirty) >= REFRESH_KEYS
                    or time.monotonic() - self._first_dirty >= REFRESH_S
                )
                self._flush = False
            try:
                if rebuild:
                    self._build()
                elif due:
                    self._refresh()
                self._failing = False
            except Exception:
                # The recall proposes its candidates with FTS5 meanwhile; try again later (said
                # once until it works again).
                if not self._failing:
                    logger.warning(
                        "memory store: the word index could not be updated", exc_info=True
                    )
                self._failing = True
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
        index.register_tokenizer(TOKENIZER, self.analyzer)
        index.register_tokenizer(PAIRS_TOKENIZER, pairs_analyzer())
        writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
        for key, text in PROBES:
            writer.add_document(self._document(key, PROBE_TYPE, text, text, pairs=text))
        with self._snapshots() as documents:
            count = 0
            for seq, node_type, text, context in documents.all():
                writer.add_document(self._document(seq, node_type, text, context))
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
            self._total, self._average = self._calibrated(self._searcher)
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
        try:
            with self._snapshots() as snapshot:
                documents = snapshot.of(keys)
        except Exception:
            # The database is away (the store says so once): the keys stay dirty, each recall
            # reading them from its own snapshot, and come in at a later refresh.
            logger.debug("memory store: the word index waits for the database", exc_info=True)
            self._wake.wait(REFRESH_S)
            return
        writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
        for key in keys:
            writer.delete_documents_by_term("seq", key)
        for seq, node_type, text, context in documents:
            writer.add_document(self._document(seq, node_type, text, context))
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        searcher = index.searcher()
        total, average = self._calibrated(searcher)
        with self._lock:
            if self._index is index and not self._rebuild:
                self._searcher = searcher
                self._total, self._average = total, average
                self._clean(generation)

    def _calibrated(self, searcher: tantivy.Searcher) -> tuple[int, dict[str, float]]:
        """What ``searcher``'s BM25 counts as the number of documents (deleted ones included
        until a merge drops them) and each field's average length in tokens, which tantivy
        does not say: worked out from the scores of the two probe documents (:data:`PROBES`,
        lengths 1 and 4, each holding the probe word once): ``1 / score = a + b * length``."""
        average: dict[str, float] = {}
        total = searcher.num_docs
        for field in FIELDS:
            query = tantivy.Query.term_query(self.schema, field, PROBE_WORD)
            hits = searcher.search(query, 2, count=False).hits
            keys = searcher.fast_field_values("seq", [address for _, address in hits])
            scores = {
                int(k): float(score)
                for (score, _), k in zip(hits, keys, strict=True)
                if k is not None
            }
            (short, _), (long, _) = PROBES
            if len(scores) < 2 or min(scores.values()) <= 0:
                continue
            b = (1 / scores[long] - 1 / scores[short]) / (PROBE_LENGTHS[1] - PROBE_LENGTHS[0])
            a = 1 / scores[short] - b * PROBE_LENGTHS[0]
            if a <= 0 or b <= 0:
                continue
            weight = (1 + K1 * (1 - B)) / a  # idf * (K1 + 1)
            average[field] = K1 * B / (b * weight)
            # idf = ln(1 + (N - 2 + 0.5) / (2 + 0.5)), the probe word being in two documents.
            total = round(2.5 * (math.exp(weight / (K1 + 1)) - 1) + 1.5)
        return total, average

    def _clean(self, generation: int) -> None:
        """Keys marked dirty up to ``generation`` are now as the index holds them (lock held)."""
        self._dirty = {k: g for k, g in self._dirty.items() if g > generation}
        if self._dirty:
            self._first_dirty = time.monotonic()
        self._cleaned.notify_all()

    def _document(
        self, seq: int, node_type: str, text: str, context: str, pairs: str | None = None
    ) -> tantivy.Document:
        document = tantivy.Document()
        document.add_integer("seq", int(seq))
        document.add_text("node_type", node_type)
        document.add_text("turn", text)
        document.add_text("context", context)
        document.add_text("pairs", cjk_index_text(text) or "" if pairs is None else pairs)
        return document
