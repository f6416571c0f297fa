"""The SQLite half of the embedded store: nodes, their full-text index and ranked recall.

:class:`MemoryStore` owns one SQLite database in WAL mode holding a ``nodes`` table and an
FTS5 external-content index over the node text, kept in sync by triggers. It is synchronous
and thread-safe (one lock around the connection); the WebSocket server calls it from a single
worker thread so SQLite never blocks the event loop.

Ranking (the formula :meth:`MemoryStore.query` implements)::

    r         = max(0, -bm25(nodes_fts))              # FTS5 BM25, bigger is better
    relevance = 0.2 + 0.8 * r / (r + 4)               # in [0.2, 1): any match counts a bit
    age_days  = max(0, now - created_at) / 86400
    recency   = 0.5 ** (age_days / 14)                # 14-day half-life, in (0, 1]
    score     = relevance * (0.6 + 0.4 * recency)     # in (0, 1)

Results are ordered by score, then newer ``created_at``, then later insertion. The floor on
``relevance`` exists because FTS5 clamps the IDF of a term present in half the documents or
more to almost zero, which on a small store would report every match as worthless. Because
``score <= relevance`` and ``relevance`` is monotone in BM25, candidates are read in BM25
order and the scan stops as soon as no later candidate can beat the current top ``limit``;
the result is exact, not an approximation.
"""

from __future__ import annotations

import heapq
import json
import logging
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

logger = logging.getLogger(__name__)

HALF_LIFE_DAYS = 14.0
RELEVANCE_FLOOR = 0.2
BM25_SATURATION = 4.0
RECENCY_WEIGHT = 0.4
DEFAULT_LIMIT = 10
MAX_LIMIT = 100
# Bounds the FTS expression (and so the work per query) whatever the user pastes in.
MAX_QUERY_TERMS = 32
# Below this many nodes every query is cheap, so no word is ever pruned as too common.
PRUNE_MIN_NODES = 1000
DOC_COUNT_CACHE_SIZE = 10_000
_SECONDS_PER_DAY = 86400.0

# Same notion of a token as FTS5's unicode61 tokenizer: runs of letters and digits; the
# underscore separates, as it does there.
_WORD = re.compile(r"[^\W_]+")

# Words that carry no topic on their own; a query made only of them matches nothing, so a
# question like "what do you know?" does not return the whole store.
STOP_WORDS = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its
    itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would you your yours yourself yourselves
    s t d ll m re ve don doesn didn isn aren wasn weren won wouldn shouldn couldn let lets
    """.split()
)

Timestamp = datetime | float | int

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    node_type TEXT NOT NULL,
    text TEXT NOT NULL,
    created_at REAL NOT NULL,
    source_episode_id TEXT,
    related_node_ids TEXT NOT NULL DEFAULT '[]',
    properties TEXT NOT NULL DEFAULT '{}'
);
CREATE VIRTUAL TABLE IF NOT EXISTS nodes_fts USING fts5(
    text,
    content='nodes',
    content_rowid='seq',
    tokenize='porter unicode61 remove_diacritics 2'
);
CREATE INDEX IF NOT EXISTS nodes_created ON nodes(created_at, seq);
CREATE TRIGGER IF NOT EXISTS nodes_ai AFTER INSERT ON nodes BEGIN
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
END;
CREATE TRIGGER IF NOT EXISTS nodes_ad AFTER DELETE ON nodes BEGIN
    INSERT INTO nodes_fts(nodes_fts, rowid, text) VALUES ('delete', old.seq, old.text);
END;
CREATE TRIGGER IF NOT EXISTS nodes_au AFTER UPDATE OF text ON nodes BEGIN
    INSERT INTO nodes_fts(nodes_fts, rowid, text) VALUES ('delete', old.seq, old.text);
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
END;
"""

_INSERT = (
    "INSERT INTO nodes (id, node_type, text, created_at, source_episode_id, related_node_ids,"
    " properties) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# Candidates in BM25 order (FTS5 `rank` is bm25(), ascending = best first). Only the cheap
# columns are read here; the text of the winners is fetched afterwards.
_CANDIDATES = (
    "SELECT f.rowid, f.rank, n.created_at FROM nodes_fts AS f"
    " JOIN nodes AS n ON n.seq = f.rowid"
    " WHERE nodes_fts MATCH ? ORDER BY f.rank"
)


# Matches of a word found in most nodes, newest first: walks the created_at index backwards
# and stops after `limit`, instead of scoring every node.
_NEWEST_MATCHES = (
    "SELECT seq, 0.0, created_at FROM nodes INDEXED BY nodes_created"
    " WHERE +seq IN (SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH ?)"
    " ORDER BY created_at DESC, seq DESC LIMIT ?"
)
_TERM_DOCS = "SELECT count(*) FROM nodes_fts WHERE nodes_fts MATCH ?"


class StoreError(Exception):
    """A caller error the store refuses (empty text, bad limit); the message is safe to show."""


@dataclass(frozen=True)
class MemoryHit:
    """One ranked recall result."""

    node_id: str
    node_type: str
    text: str
    score: float
    created_at: float


@dataclass(frozen=True)
class NewNode:
    """One node to insert with :meth:`MemoryStore.add_many`."""

    text: str
    node_type: str = "episode"
    created_at: Timestamp | None = None
    source_episode_id: str | None = None
    related_node_ids: Sequence[str] = ()
    properties: Mapping[str, str] = field(default_factory=dict)


def query_terms(text: str) -> list[str]:
    """The searchable words of free user text: lower-cased, stop words dropped, de-duplicated.

    Only letters and digits survive, so no FTS5 syntax (``NEAR``, ``*``, ``-``, ``:``, ``(``,
    quotes) can come through; at most :data:`MAX_QUERY_TERMS` words are kept.
    """
    terms: list[str] = []
    seen: set[str] = set()
    for match in _WORD.finditer(text.lower()):
        word = match.group()
        if word in STOP_WORDS or word in seen:
            continue
        seen.add(word)
        terms.append(word)
        if len(terms) >= MAX_QUERY_TERMS:
            break
    return terms


def fts_expression(terms: Sequence[str]) -> str | None:
    """An FTS5 MATCH expression OR-ing the quoted ``terms``; None when there are none.

    Quoting makes every word a phrase, so even ``near`` or ``and`` is never an operator; OR
    lets a partial match rank (BM25 rewards matching more of the words).
    """
    if not terms:
        return None
    return " OR ".join(f'"{term}"' for term in terms)


def build_fts_query(text: str) -> str | None:
    """Turn free user text into a safe FTS5 expression, or None when nothing is searchable."""
    return fts_expression(query_terms(text))


def relevance_of(bm25: float) -> float:
    """Map an FTS5 bm25() value (negative, smaller is better) into [RELEVANCE_FLOOR, 1)."""
    r = max(0.0, -bm25)
    return RELEVANCE_FLOOR + (1.0 - RELEVANCE_FLOOR) * r / (r + BM25_SATURATION)


def recency_of(created_at: float, now: float) -> float:
    """The 14-day half-life decay; a timestamp in the future counts as brand new."""
    age_days = max(0.0, now - created_at) / _SECONDS_PER_DAY
    return float(0.5 ** (age_days / HALF_LIFE_DAYS))


def score_of(bm25: float, created_at: float, now: float) -> float:
    """The blended score in (0, 1): relevance scaled by a recency factor in (0.6, 1]."""
    recency = recency_of(created_at, now)
    return relevance_of(bm25) * ((1.0 - RECENCY_WEIGHT) + RECENCY_WEIGHT * recency)


def _epoch(value: Timestamp | None) -> float:
    if value is None:
        return time.time()
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value)


class MemoryStore:
    """Nodes persisted in SQLite with BM25 + recency recall. Thread-safe; use :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._closed = False
        # term -> (nodes holding it, store size when counted); see _docs_with.
        self._doc_counts: dict[str, tuple[int, int]] = {}
        self.path = path

    @classmethod
    def open(cls, path: Path | str) -> MemoryStore:
        """Open (creating as needed, parent folders included) the database at ``path``."""
        db_path = Path(path)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        # The server drives the store from one worker thread that is not the opener's;
        # the lock below serialises every use, so sharing the connection is safe.
        conn = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.executescript(_SCHEMA)
        except sqlite3.Error:
            conn.close()
            raise
        logger.info("memory store opened at %s", db_path)
        return cls(conn, db_path)

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
    ) -> str:
        """Persist one node and return its new id (a UUID string)."""
        node = NewNode(
            text=text,
            node_type=node_type,
            created_at=created_at,
            source_episode_id=source_episode_id,
            related_node_ids=related_node_ids,
            properties=dict(properties or {}),
        )
        return self.add_many([node])[0]

    def add_many(
        self, nodes: Iterable[NewNode | tuple[str, str] | tuple[str, str, Timestamp | None]]
    ) -> list[str]:
        """Persist many nodes in one transaction (the bulk-load path); returns their ids.

        Items are :class:`NewNode` or ``(text, node_type[, created_at])`` tuples.
        """
        rows: list[tuple[str, str, str, float, str | None, str, str]] = []
        for item in nodes:
            node = item if isinstance(item, NewNode) else NewNode(*item)
            if not isinstance(node.text, str) or not node.text.strip():
                raise StoreError("text must be a non-empty string")
            if not isinstance(node.node_type, str) or not node.node_type:
                raise StoreError("node_type must be a non-empty string")
            rows.append(
                (
                    str(uuid.uuid4()),
                    node.node_type,
                    node.text,
                    _epoch(node.created_at),
                    node.source_episode_id,
                    json.dumps(list(node.related_node_ids)),
                    json.dumps(dict(node.properties), sort_keys=True),
                )
            )
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(_INSERT, rows)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        return [row[0] for row in rows]

    def query(
        self, text: str, limit: int = DEFAULT_LIMIT, now: Timestamp | None = None
    ) -> list[MemoryHit]:
        """The best ``limit`` nodes for ``text``, best first (see the module docstring)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise StoreError(f"limit must be an integer between 1 and {MAX_LIMIT}")
        terms = query_terms(text)
        if not terms:
            return []
        now_s = _epoch(now)
        # Min-heap of the best `limit` so far, keyed so the root is the weakest kept result.
        best: list[tuple[float, float, int]] = []
        with self._lock:
            self._check_open()
            kept, all_common = self._plan(terms)
            expression = fts_expression(kept)
            cursor = self._conn.execute(
                _NEWEST_MATCHES if all_common else _CANDIDATES,
                (expression, limit) if all_common else (expression,),
            )
            try:
                for seq, bm25, created_at in cursor:
                    if len(best) == limit and relevance_of(bm25) < best[0][0]:
                        # score <= relevance, and relevance only falls from here on.
                        break
                    key = (score_of(bm25, created_at, now_s), created_at, seq)
                    if len(best) < limit:
                        heapq.heappush(best, key)
                    elif key > best[0]:
                        heapq.heapreplace(best, key)
            finally:
                cursor.close()
            ranked = sorted(best, reverse=True)
            hits: list[MemoryHit] = []
            for score, created_at, seq in ranked:
                row = self._conn.execute(
                    "SELECT id, node_type, text FROM nodes WHERE seq = ?", (seq,)
                ).fetchone()
                if row is None:  # pragma: no cover - the lock rules out a concurrent delete
                    continue
                hits.append(
                    MemoryHit(
                        node_id=row[0],
                        node_type=row[1],
                        text=row[2],
                        score=min(1.0, max(0.0, score)),
                        created_at=created_at,
                    )
                )
        return hits

    def _plan(self, terms: list[str]) -> tuple[list[str], bool]:
        """Choose the words worth matching on a large store; True when all of them are common.

        A word found in at least half the nodes gets an IDF clamped to almost zero by FTS5, so
        it adds nothing to BM25, yet every node holding it would have to be scored (in an
        episode store ``user`` matches every node). Such words are dropped when rarer ones
        remain; the only loss is that nodes matching nothing but common words no longer fill up
        a short result list. When every word is common, the rarest is kept and the caller ranks
        its matches by recency alone, which is what the formula yields for a BM25 of ~0.
        Runs with the lock held.
        """
        total = int(self._conn.execute("SELECT count(*) FROM nodes").fetchone()[0])
        if total < PRUNE_MIN_NODES:
            return terms, False
        counted = [(self._docs_with(term, total), term) for term in terms]
        kept = [term for docs, term in counted if docs * 2 < total]
        if kept:
            return kept, False
        return [min(counted)[1]], True

    def _docs_with(self, term: str, total: int) -> int:
        """How many nodes hold ``term`` (lock held), from a cache while the store size holds.

        Counting a word found in most of 100,000 nodes takes milliseconds, and the answer only
        matters as a fraction of the store, which moves slowly; so a count is reused until the
        store has grown or shrunk by a tenth since it was taken.
        """
        cached = self._doc_counts.get(term)
        if cached is not None and abs(total - cached[1]) * 10 <= cached[1]:
            return cached[0]
        row = self._conn.execute(_TERM_DOCS, (f'"{term}"',)).fetchone()
        docs = int(row[0])
        if len(self._doc_counts) >= DOC_COUNT_CACHE_SIZE:
            self._doc_counts.clear()
        self._doc_counts[term] = (docs, total)
        return docs

    def delete(self, node_id: str) -> bool:
        """Remove a node (and its index entry); True if it existed."""
        with self._lock:
            self._check_open()
            cursor = self._conn.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
            return cursor.rowcount > 0

    def count(self) -> int:
        """How many nodes are stored."""
        with self._lock:
            self._check_open()
            row = self._conn.execute("SELECT count(*) FROM nodes").fetchone()
        return int(row[0])

    def close(self) -> None:
        """Close the database; idempotent. Later calls raise :class:`StoreError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._conn.close()
        logger.info("memory store closed")
