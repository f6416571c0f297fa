"""The SQLite half of the embedded store: nodes, their full-text index and ranked recall.

:class:`MemoryStore` owns one SQLite database in WAL mode holding a ``nodes`` table and an
FTS5 external-content index over the node text, kept in sync by triggers. It is synchronous
and thread-safe. Writes go through one connection and recalls through another, each behind
its own lock: in WAL mode a recall reads a consistent snapshot while a write is under way, so
it never waits for one. The node count and a count of changes live in the database
(``counters``, kept by triggers), so a recall reads them in the same snapshot as the nodes,
and writes by any other process are counted too.

Ranking (the formula :meth:`MemoryStore.query` implements, evaluated by SQLite per row)::

    r         = max(0, -bm25(nodes_fts))              # FTS5 BM25, bigger is better
    relevance = 0.2 + 0.8 * r / (r + 4)               # in [0.2, 1): any match counts a bit
    age_days  = max(0, now - created_at) / 86400
    recency   = 0.5 ** (age_days / 14)                # 14-day half-life, in (0, 1]
    score     = relevance * (0.6 + 0.4 * recency)     # in (0, 1)

Results are ordered by score, then newer ``created_at``, then later insertion. The floor on
``relevance`` exists because FTS5 clamps the IDF of a term present in half the documents or
more to almost zero, which on a small store would report every match as worthless.

Time-ordered keys. A node's ``seq`` (the rowid of both ``nodes`` and the FTS index) is its
``created_at`` in whole microseconds, bumped to the next free integer on a collision; so the
``created_at`` the formula uses is ``seq / 1e6`` (exact to the microsecond; a bulk load of
nodes sharing one timestamp spreads them by a microsecond each, nothing a 14-day half-life
can see). FTS5 walks a match list in rowid order for free, so matches arrive newest first
and SQLite computes BM25 and the blended score in C for only the rows actually read.

Why the scan may stop early and stay exact: BM25 is a sum over the query's words of
``idf * f`` where the term factor ``f = tf * (k1 + 1) / (tf + k1 * (1 - b + b * D / avgdl))``
(k1 = 1.2, b = 0.75, ``tf`` the word's count in the node, ``D`` the node's length) is below
``k1 + 1``; with IDFs bounded from the words' document counts, that bounds ``relevance`` by
some ``R``. A node of age ``a`` can score at most ``R * (0.6 + 0.4 * recency(a))``, and older
nodes only less; once the ``limit``-th best score so far reaches that bound, no node still
unread can enter the top ``limit``, so the scan stops. Recent, relevant matches end it after
a few hundred rows whatever the store size; a store that only holds weak matches is read to
its end, which is exactly the full ranking, except that at most :data:`MAX_SCAN_ROWS`
matches are read: a query made only of weak words on a huge store then
ranks the newest that many matches, which caps the worst case (about a microsecond per row).

A tighter bound: each word's largest ``f`` over the nodes holding it is measured (one pass
over its matches) and remembered with the store's ``avgdl``, its highest key ``hi`` and a
count of writes below ``hi``. Later, ``f`` of those same nodes can only have grown with
``avgdl`` (by at most the ratio), deleted nodes do not matter, and nodes written since sit
above ``hi`` (a write below ``hi``, or a text change, forgets the measure); so nodes up to the
oldest ``hi`` of the query's words are held to the measured factors, and only newer ones to
``k1 + 1``. The real best ``f`` is often half of ``k1 + 1``: on the benchmark's corpus a
recall then reads about a third of the rows. Each word also counts only from its oldest node's
key upwards (remembered with the measure; deletions and moves only raise the true oldest key,
and a write below ``hi`` forgets it): below it no node holds the word, so a rare word met only
in a recent node (often the previous turn asking the same question) stops weighing on the
bound once the scan is past that node. Where the bound changes (the horizon, each oldest key)
the scan's possible stops are worked out once per recall (:func:`_stop_plan`).

Repeated memories. A write with ``refresh=True`` (what the wire server does for every
``Sync.MemoryStoreRequest``) that is identical to a stored node (same text, type, source,
related ids and properties) does not add a copy: that node moves to the new time, keeping its
id. Saying the same thing twice is then one memory, recent again, instead of copies that all
rank alike and crowd every other memory out of a recall (and that each recall would have to
read). Identical nodes are found through a 16-byte digest of those fields, indexed.

Chinese, Japanese and Korean. FTS5's unicode61 tokenizer makes a run of such characters one
token, so a second FTS5 index (``nodes_cjk``) holds their overlapping character pairs (a run of
one character as itself), written with the node and kept by triggers on delete and move. A query
holding such characters also matches its pairs there, scored by the same formula over that
index (its scan stops by recency alone, with a relevance bound of 1), and a node counts with the
better of its two scores. Queries without them run exactly as before.

Hybrid ranking (a store opened with ``ranking="hybrid"``; ``arona_store/RANKING.md``). Each node
also has a unit vector from a sentence-embedding model (``vectors``, keyed by node id, so a move
keeps it; a delete or a text change drops it), and a recall blends both signals::

    lexical   = the relevance above for a word match, 0 otherwise
    semantic  = clamp((cosine - COSINE_FLOOR) / (COSINE_FULL - COSINE_FLOOR), 0, 1)
    relevance = SEMANTIC_WEIGHT * semantic + LEXICAL_WEIGHT * lexical
    score     = relevance * (0.6 + 0.4 * recency)            # in [0, 1]

The candidates are what the lexical ranking returns for the query (same scan, same bounds) and
the HYBRID_CANDIDATES nodes of closest meaning (:class:`~arona_store.vectors.VectorIndex`);
each is scored with both signals (the BM25 of a candidate found by meaning is looked up), so a
node's score does not depend on a ``node_type`` filter. A query the model cannot read (mostly
Chinese, Japanese or Korean, or mostly unknown tokens) is ranked lexically. Nodes without a
vector yet (written by the lexical ranking or an older version; :meth:`MemoryStore.fill_vectors`
adds them) count by their words only.

Opening a store merges its full-text index into one segment (FTS5 ``optimize``, a no-op when
already merged): a bulk-loaded index otherwise costs every query a probe per segment.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from arona_store.ranking import Ranking, check_ranking

if TYPE_CHECKING:
    from arona_store.embedding import Embedder
    from arona_store.vectors import Vector, VectorIndex

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
# A node's seq is its created_at in these units (microseconds).
KEY_SCALE = 1_000_000
# Timestamps further than this from 1970 (about year 5138) are refused: their keys would not
# fit a 64-bit rowid with room to spare.
MAX_ABS_EPOCH_S = 1e11
# FTS5's bm25() constant k1: one word adds at most (k1 + 1) * idf to BM25, whatever its
# frequency in the node and the node's length.
BM25_K1 = 1.2
SCHEMA_VERSION = 4
BUSY_TIMEOUT_MS = 5000
# Most matches one query reads (see the module docstring).
MAX_SCAN_ROWS = 4000
# A word in more nodes than this is not measured (its pass would cost milliseconds); its
# term factor is bounded by k1 + 1.
MAX_MEASURED_DOCS = 4000
# The words limiting a recall's horizon are measured again once it read more matches than
# this above the horizon (held to the loose bound there), or once `avgdl` has grown by
# REMEASURE_AVGDL.
REMEASURE_ROWS = 64
REMEASURE_AVGDL = 1.1
_SECONDS_PER_DAY = 86400.0
# recency = exp((seq - now_key) * _DECAY_PER_KEY) for a node older than now.
_DECAY_PER_KEY = math.log(2.0) / (HALF_LIFE_DAYS * _SECONDS_PER_DAY * KEY_SCALE)

# Hybrid ranking (module docstring): how much each signal weighs in relevance, the cosines
# mapped to no and to full semantic relevance, how many candidates the embeddings propose, and
# the share of a query's tokens the embedding model must know for its vector to count.
SEMANTIC_WEIGHT = 0.8
LEXICAL_WEIGHT = 1.0 - SEMANTIC_WEIGHT
COSINE_FLOOR = 0.25
COSINE_FULL = 0.6
HYBRID_CANDIDATES = 40
MIN_KNOWN_TOKENS = 0.75
# The model reads English: a query mostly in Chinese, Japanese or Korean characters (even ones
# its vocabulary holds, as kana) gets vectors that all look alike, so it is ranked by words.
MAX_CJK_SHARE = 0.3
# Nodes embedded per step of the background fill.
FILL_BATCH = 32

# Same notion of a token as FTS5's unicode61 tokenizer: runs of letters and digits; the
# underscore separates, as it does there.
_WORD = re.compile(r"[^\W_]+")

# Scripts written without spaces between words (Han, kana, Hangul): unicode61 makes a whole run
# of them one token, so they are also indexed as overlapping character pairs (module docstring).
_CJK_RUN = re.compile(
    "[\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f\U00020000-\U0002ffff]+"
)

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

_TABLES = """
CREATE TABLE IF NOT EXISTS nodes (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    node_type TEXT NOT NULL,
    text TEXT NOT NULL,
    created_at REAL NOT NULL,
    source_episode_id TEXT,
    related_node_ids TEXT NOT NULL DEFAULT '[]',
    properties TEXT NOT NULL DEFAULT '{}',
    digest BLOB
);
CREATE INDEX IF NOT EXISTS nodes_digest ON nodes(digest);
CREATE VIRTUAL TABLE IF NOT EXISTS nodes_fts USING fts5(
    text,
    content='nodes',
    content_rowid='seq',
    tokenize='porter unicode61 remove_diacritics 2'
);
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
CREATE TABLE IF NOT EXISTS counters (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    nodes INTEGER NOT NULL,
    changes INTEGER NOT NULL,
    hi INTEGER NOT NULL,
    backdated INTEGER NOT NULL
);
INSERT OR IGNORE INTO counters (id, nodes, changes, hi, backdated)
    SELECT 1, count(*), 0, coalesce(max(seq), -9223372036854775808), 0 FROM nodes;
CREATE TRIGGER IF NOT EXISTS counters_ai AFTER INSERT ON nodes BEGIN
    UPDATE counters SET nodes = nodes + 1, changes = changes + 1,
        backdated = backdated + (new.seq < hi), hi = max(hi, new.seq) WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS counters_ad AFTER DELETE ON nodes BEGIN
    UPDATE counters SET nodes = nodes - 1, changes = changes + 1 WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS counters_au AFTER UPDATE OF text ON nodes BEGIN
    UPDATE counters SET changes = changes + 2, backdated = backdated + 1 WHERE id = 1;
END;
CREATE VIRTUAL TABLE IF NOT EXISTS nodes_cjk USING fts5(grams, tokenize='unicode61');
CREATE TRIGGER IF NOT EXISTS nodes_cjk_ad AFTER DELETE ON nodes BEGIN
    DELETE FROM nodes_cjk WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_cjk_au AFTER UPDATE OF text ON nodes BEGIN
    DELETE FROM nodes_cjk WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_cjk_moved AFTER UPDATE OF seq ON nodes BEGIN
    UPDATE nodes_cjk SET rowid = new.seq WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_moved AFTER UPDATE OF seq ON nodes
WHEN new.text = old.text BEGIN
    INSERT INTO nodes_fts(nodes_fts, rowid, text) VALUES ('delete', old.seq, old.text);
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
    UPDATE counters SET backdated = backdated + (new.seq < hi), hi = max(hi, new.seq)
        WHERE id = 1;
END;
"""

# The node vectors of the hybrid ranking (created by a hybrid store; harmless to a lexical
# one). AUTOINCREMENT: a vid is never reused, so the in-memory index can follow the table by
# vid alone (arona_store.vectors).
_VECTOR_TABLES = """
CREATE TABLE IF NOT EXISTS vectors (
    vid INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL UNIQUE,
    vec BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS vector_model (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    model TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS vectors_node_deleted AFTER DELETE ON nodes BEGIN
    DELETE FROM vectors WHERE node_id = old.id;
END;
CREATE TRIGGER IF NOT EXISTS vectors_text_changed AFTER UPDATE OF text ON nodes BEGIN
    DELETE FROM vectors WHERE node_id = old.id;
END;
"""
_PUT_VECTOR = "INSERT OR IGNORE INTO vectors (node_id, vec) VALUES (?, ?)"
# The same for a node read earlier, which may have been deleted since.
_FILL_VECTOR = "INSERT OR IGNORE INTO vectors (node_id, vec) SELECT id, ? FROM nodes WHERE id = ?"
# Nodes without a vector, newest first, below a key (the background fill's cursor).
_UNEMBEDDED = (
    "SELECT n.seq, n.id, n.text FROM nodes n WHERE n.seq < ?"
    " AND NOT EXISTS (SELECT 1 FROM vectors v WHERE v.node_id = n.id)"
    " ORDER BY n.seq DESC LIMIT ?"
)
_UNEMBEDDED_COUNT = (
    "SELECT count(*) FROM nodes n WHERE NOT EXISTS (SELECT 1 FROM vectors v WHERE v.node_id = n.id)"
)

_COLUMNS = "id, node_type, text, created_at, source_episode_id, related_node_ids, properties"
_INSERT = f"INSERT INTO nodes (seq, {_COLUMNS}, digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
_MOVE = "UPDATE nodes SET seq = ?, created_at = ? WHERE seq = ?"
# A stored node identical to a new one (the digest narrows, the fields decide).
_TWIN = (
    "SELECT seq, id FROM nodes WHERE digest = ? AND node_type = ? AND text = ?"
    " AND source_episode_id IS ? AND related_node_ids = ? AND properties = ?"
    " ORDER BY seq DESC LIMIT 1"
)
# Every match, newest first, with its blended score computed by SQLite (see the module
# docstring; 1 - 3.2 / (r + 4) is 0.2 + 0.8 * r / (r + 4) with bm25() called once). Rows are
# produced one at a time as the caller reads, so stopping early saves the BM25 of the rest.
_RANKED_MATCHES = (
    "SELECT rowid,"
    f" (1.0 - {(1.0 - RELEVANCE_FLOOR) * BM25_SATURATION!r}"
    f" / ({BM25_SATURATION!r} + max(0.0, -bm25(nodes_fts))))"
    f" * ({1.0 - RECENCY_WEIGHT!r} + {RECENCY_WEIGHT!r}"
    " * exp(min(0, rowid - :now) * :decay))"
    " FROM nodes_fts WHERE nodes_fts MATCH :expr ORDER BY rowid DESC LIMIT :cap"
)
# The same restricted to one node type (`node_type_filter`): the type is checked on each match
# before its score is computed, and the cap counts matches of that type only.
_RANKED_MATCHES_OF_TYPE = (
    "SELECT nodes_fts.rowid,"
    f" (1.0 - {(1.0 - RELEVANCE_FLOOR) * BM25_SATURATION!r}"
    f" / ({BM25_SATURATION!r} + max(0.0, -bm25(nodes_fts))))"
    f" * ({1.0 - RECENCY_WEIGHT!r} + {RECENCY_WEIGHT!r}"
    " * exp(min(0, nodes_fts.rowid - :now) * :decay))"
    " FROM nodes_fts JOIN nodes ON nodes.seq = nodes_fts.rowid"
    " WHERE nodes_fts MATCH :expr AND nodes.node_type = :node_type"
    " ORDER BY nodes_fts.rowid DESC LIMIT :cap"
)
# The same over the character pairs of Chinese, Japanese and Korean text (no bounds are kept
# for them: the scan stops by recency alone, which is exact with a relevance bound of 1).
_RANKED_CJK = (
    "SELECT rowid,"
    f" (1.0 - {(1.0 - RELEVANCE_FLOOR) * BM25_SATURATION!r}"
    f" / ({BM25_SATURATION!r} + max(0.0, -bm25(nodes_cjk))))"
    f" * ({1.0 - RECENCY_WEIGHT!r} + {RECENCY_WEIGHT!r}"
    " * exp(min(0, rowid - :now) * :decay))"
    " FROM nodes_cjk WHERE nodes_cjk MATCH :expr ORDER BY rowid DESC LIMIT :cap"
)
_RANKED_CJK_OF_TYPE = (
    "SELECT nodes_cjk.rowid,"
    f" (1.0 - {(1.0 - RELEVANCE_FLOOR) * BM25_SATURATION!r}"
    f" / ({BM25_SATURATION!r} + max(0.0, -bm25(nodes_cjk))))"
    f" * ({1.0 - RECENCY_WEIGHT!r} + {RECENCY_WEIGHT!r}"
    " * exp(min(0, nodes_cjk.rowid - :now) * :decay))"
    " FROM nodes_cjk JOIN nodes ON nodes.seq = nodes_cjk.rowid"
    " WHERE nodes_cjk MATCH :expr AND nodes.node_type = :node_type"
    " ORDER BY nodes_cjk.rowid DESC LIMIT :cap"
)
_INSERT_CJK = "INSERT INTO nodes_cjk (rowid, grams) VALUES (?, ?)"
# Matches of a word found in most nodes: the newest `limit`, read straight off the index.
_NEWEST_MATCHES = "SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH ? ORDER BY rowid DESC LIMIT ?"
_NEWEST_MATCHES_OF_TYPE = (
    "SELECT nodes_fts.rowid FROM nodes_fts JOIN nodes ON nodes.seq = nodes_fts.rowid"
    " WHERE nodes_fts MATCH ? AND nodes.node_type = ? ORDER BY nodes_fts.rowid DESC LIMIT ?"
)
_TERM_DOCS = "SELECT count(*) FROM nodes_fts WHERE nodes_fts MATCH ?"
_COUNTERS = "SELECT nodes, changes, hi, backdated FROM counters WHERE id = 1"
# FTS5's "averages" record: varints holding its row count and total token count.
_AVERAGES = "SELECT block FROM nodes_fts_data WHERE id = 1"
# Every BM25 of one word's matches (oldest first), to find its best term factor.
_TERM_BM25 = "SELECT rowid, bm25(nodes_fts) FROM nodes_fts WHERE nodes_fts MATCH ? ORDER BY rowid"
_OLDEST_MATCH = "SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH ? ORDER BY rowid LIMIT 1"
# The taken keys from a candidate upwards, to find the first free one.
_KEYS_FROM = "SELECT seq FROM nodes WHERE seq >= ? ORDER BY seq"


# A node row as inserted: seq, id, node_type, text, created_at, source_episode_id,
# related_node_ids (JSON), properties (JSON), digest.
_Row = tuple[int, str, str, str, float, str | None, str, str, bytes]


@dataclass(frozen=True)
class _TermFactor:
    """A word's largest BM25 term factor over the nodes holding it, and when it was measured
    (see the module docstring)."""

    factor: float
    avgdl: float
    hi: int
    backdated: int
    oldest: int  # the smallest key among the nodes holding the word


@dataclass(frozen=True)
class _Bounds:
    """What a match's relevance can be, by key: words held to their measured factors up to
    ``horizon`` and to ``k1 + 1`` above it, each only from its oldest node's key upwards
    (below that no node holds it)."""

    horizon: int
    # Per word: (oldest key, idf * measured factor, idf * (k1 + 1)).
    words: tuple[tuple[int, float, float], ...]


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
    # Its embedding as stored (arona_store.vectors.to_blob), for a hybrid store; None: the
    # store embeds it itself.
    vector: bytes | None = None


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


def cjk_grams(text: str) -> list[str]:
    """The character pairs of ``text``'s runs of Chinese, Japanese or Korean characters (a
    run of one character is kept whole), lower-cased, de-duplicated, in order."""
    grams: list[str] = []
    seen: set[str] = set()
    for match in _CJK_RUN.finditer(text.lower()):
        run = match.group()
        pieces = [run] if len(run) == 1 else [run[i : i + 2] for i in range(len(run) - 1)]
        for gram in pieces:
            if gram not in seen:
                seen.add(gram)
                grams.append(gram)
    return grams


def cjk_share(text: str) -> float:
    """The share of ``text``'s letters and digits that are Chinese, Japanese or Korean."""
    letters = sum(len(m.group()) for m in _WORD.finditer(text))
    if not letters:
        return 0.0
    return sum(len(m.group()) for m in _CJK_RUN.finditer(text)) / letters


def cjk_index_text(text: str) -> str | None:
    """What the character-pair index holds for ``text``; None when it has no such run."""
    grams = cjk_grams(text)
    return " ".join(grams) if grams else None


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


def semantic_relevance(cosine: float) -> float:
    """Map a cosine similarity into [0, 1]: nothing up to COSINE_FLOOR (unrelated texts),
    everything from COSINE_FULL (close paraphrases), linear between."""
    return min(1.0, max(0.0, (cosine - COSINE_FLOOR) / (COSINE_FULL - COSINE_FLOOR)))


def hybrid_relevance(lexical: float, cosine: float | None) -> float:
    """The hybrid relevance in [0, 1]: the lexical relevance (0 without a match) and the
    semantic one (0 without a vector), weighted."""
    semantic = 0.0 if cosine is None else semantic_relevance(cosine)
    return SEMANTIC_WEIGHT * semantic + LEXICAL_WEIGHT * lexical


def _recency_factor(seq: int, now_key: int) -> float:
    """``0.6 + 0.4 * recency`` of the node at key ``seq``."""
    return (1.0 - RECENCY_WEIGHT) + RECENCY_WEIGHT * math.exp(
        min(0, seq - now_key) * _DECAY_PER_KEY
    )


def idf_bound(total: int, docs: int) -> float:
    """An upper bound of FTS5's IDF for a word in at least ``docs`` of ``total`` nodes.

    FTS5 computes ``log((N - n + 0.5) / (n + 0.5))`` and lifts anything not positive to 1e-6;
    the value only grows as ``n`` shrinks, so a lower bound of ``n`` gives an upper bound.
    """
    n = max(0, docs)
    idf = math.log((max(total, n) - n + 0.5) / (n + 0.5))
    return idf if idf > 1e-6 else 1e-6


def _epoch(value: Timestamp | None) -> float:
    if value is None:
        return time.time()
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value)


def _key_of(created_at: float) -> int:
    """The time-ordered key of a node created at ``created_at`` (before collisions)."""
    if not math.isfinite(created_at) or abs(created_at) > MAX_ABS_EPOCH_S:
        raise StoreError("created_at must be a finite time within a few thousand years")
    return math.floor(created_at * KEY_SCALE)


def _now_key(now: float) -> int:
    # Clamped like a stored key so a far-off `now` cannot overflow SQLite's integers.
    return math.floor(max(-MAX_ABS_EPOCH_S, min(MAX_ABS_EPOCH_S, now)) * KEY_SCALE)


def _digest(
    node_type: str, text: str, source_episode_id: str | None, related: str, properties: str
) -> bytes:
    """The 16-byte digest that finds identical nodes (fields as stored, JSON-encoded)."""
    canonical = json.dumps([node_type, text, source_episode_id, related, properties])
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()


class MemoryStore:
    """Nodes persisted in SQLite with BM25 + recency recall. Thread-safe; use :meth:`open`."""

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
        # term -> (nodes holding it, `changes` when counted); see _docs_with. Reader only.
        self._doc_counts: dict[str, tuple[int, int]] = {}
        # term -> its measured term factor; see _tight_bound. Reader only.
        self._factors: dict[str, _TermFactor] = {}
        self.path = path
        # Hybrid ranking only: the model and the vectors' in-memory copy (reader only).
        self._embedder = embedder
        self._index: VectorIndex | None = None
        if embedder is not None:
            from arona_store.vectors import VectorIndex

            self._index = VectorIndex(embedder.dimension)
        # The background fill's cursor: nodes below this key may still lack a vector.
        self._fill_below = 2**63 - 1

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
            if not checkpoint_on_commit:
                conn.execute("PRAGMA wal_autocheckpoint=0")
            _prepare_schema(conn)
            if embedder is not None:
                _prepare_vectors(conn, embedder.model_id)
            conn.execute("INSERT INTO nodes_fts(nodes_fts) VALUES ('optimize')")
            reader = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error:
            conn.close()
            raise
        try:
            reader.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            reader.execute("PRAGMA query_only=1")
            _ensure_exp(reader)
        except sqlite3.Error:
            reader.close()
            conn.close()
            raise
        store = cls(conn, reader, db_path, embedder)
        if store._index is not None:
            with store._read_lock:
                store._reader.execute("BEGIN")
                try:
                    store._index.sync(store._reader)
                finally:
                    store._reader.execute("COMMIT")
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
        instead (never back in time) and returns its id (module docstring).
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
        nodes: Iterable[NewNode | tuple[str, str] | tuple[str, str, Timestamp | None]],
        *,
        refresh: bool = False,
        embed: bool = True,
    ) -> list[str]:
        """Persist many nodes in one transaction (the bulk-load path); returns their ids.

        Items are :class:`NewNode` or ``(text, node_type[, created_at])`` tuples. ``refresh``
        as for :meth:`add`. A hybrid store embeds the nodes given without a vector first
        (milliseconds each), unless ``embed`` is off: they then wait for :meth:`fill_vectors`.
        """
        rows, vectors = self._rows(nodes)
        if embed:
            vectors = self._with_vectors(rows, vectors)
        ids = self._add_rows(rows, vectors, refresh, wait=True)
        assert ids is not None  # a waiting call always gets to write
        return ids

    def try_add_many(
        self,
        nodes: Iterable[NewNode | tuple[str, str] | tuple[str, str, Timestamp | None]],
        *,
        refresh: bool = False,
        embed: bool = True,
    ) -> list[str] | None:
        """Like :meth:`add_many`, but None at once, having written nothing, if another caller
        (a thread here, or another process) is writing; for callers that must not wait."""
        rows, vectors = self._rows(nodes)
        if embed:
            vectors = self._with_vectors(rows, vectors)
        return self._add_rows(rows, vectors, refresh, wait=False)

    def _with_vectors(self, rows: list[_Row], vectors: list[bytes | None]) -> list[bytes | None]:
        """Every node's vector for a hybrid store (embedding those without), none for a
        lexical one."""
        if self._embedder is None:
            return vectors
        missing = [i for i, vector in enumerate(vectors) if vector is None]
        if missing:
            from arona_store.vectors import to_blob

            embedded = self._embedder.embed([rows[i][3] for i in missing])
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

        return [to_blob(vector) for vector in self._embedder.embed(list(texts))]

    @staticmethod
    def _rows(
        nodes: Iterable[NewNode | tuple[str, str] | tuple[str, str, Timestamp | None]],
    ) -> tuple[list[_Row], list[bytes | None]]:
        rows: list[_Row] = []
        vectors: list[bytes | None] = []
        for item in nodes:
            node = item if isinstance(item, NewNode) else NewNode(*item)
            if not isinstance(node.text, str) or not node.text.strip():
                raise StoreError("text must be a non-empty string")
            if not isinstance(node.node_type, str) or not node.node_type:
                raise StoreError("node_type must be a non-empty string")
            created_at = _epoch(node.created_at)
            related = json.dumps(list(node.related_node_ids))
            properties = json.dumps(dict(node.properties), sort_keys=True)
            rows.append(
                (
                    _key_of(created_at),
                    str(uuid.uuid4()),
                    node.node_type,
                    node.text,
                    created_at,
                    node.source_episode_id,
                    related,
                    properties,
                    _digest(node.node_type, node.text, node.source_episode_id, related, properties),
                )
            )
            vectors.append(node.vector)
        return rows, vectors

    def _add_rows(
        self, rows: list[_Row], vectors: list[bytes | None], refresh: bool, *, wait: bool
    ) -> list[str] | None:
        if self._embedder is None:
            # A lexical store keeps no vectors (it may not have their table).
            vectors = [None] * len(rows)
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            self._check_open()
            if not self._begin_write(wait):
                return None
            ids: list[str] = []
            try:
                # Where to resume probing for each wanted key, so a batch sharing one
                # timestamp does not walk the same run of taken keys again for every node.
                resume: dict[int, int] = {}
                for row, vector in zip(rows, vectors, strict=True):
                    wanted = row[0]
                    twin = self._twin(row) if refresh else None
                    if vector is not None:
                        # A twin keeps its vector (same text) or gets this one if it had none.
                        self._conn.execute(
                            _PUT_VECTOR, (row[1] if twin is None else twin[1], vector)
                        )
                    if twin is not None:
                        twin_seq, twin_id = twin
                        ids.append(twin_id)
                        if twin_seq >= wanted:
                            continue  # already at least that recent
                        key = self._free_key(resume.get(wanted, wanted))
                        resume[wanted] = key + 1
                        # Moved, not deleted and added: no word count changes.
                        self._conn.execute(_MOVE, (key, row[4], twin_seq))
                        continue
                    ids.append(row[1])
                    key = self._free_key(resume.get(wanted, wanted))
                    resume[wanted] = key + 1
                    self._conn.execute(_INSERT, (key, *row[1:]))
                    grams = cjk_index_text(row[3])
                    if grams is not None:
                        self._conn.execute(_INSERT_CJK, (key, grams))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return ids
        finally:
            self._lock.release()

    def _begin_write(self, wait: bool) -> bool:
        """Open a write transaction (lock held); False if ``wait`` is off and another
        connection holds the database's write lock."""
        if wait:
            self._conn.execute("BEGIN IMMEDIATE")
            return True
        self._conn.execute("PRAGMA busy_timeout=0")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode != sqlite3.SQLITE_BUSY:
                raise
            return False
        finally:
            self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        return True

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the database file (PASSIVE: waits for nobody).

        Stores opened with ``checkpoint_on_commit=False`` leave this to their owner, so that
        no write pays for it (a checkpoint syncs the database file)."""
        with self._lock:
            self._check_open()
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def _twin(self, row: _Row) -> tuple[int, str] | None:
        """The newest stored node identical to ``row``, as (seq, id) (lock held)."""
        _, _, node_type, text, _, source, related, properties, digest = row
        found = self._conn.execute(
            _TWIN, (digest, node_type, text, source, related, properties)
        ).fetchone()
        return None if found is None else (int(found[0]), str(found[1]))

    def _free_key(self, key: int) -> int:
        """The first key at or after ``key`` that no node holds (lock held)."""
        cursor = self._conn.execute(_KEYS_FROM, (key,))
        try:
            for (taken,) in cursor:
                if taken != key:
                    break
                key += 1
        finally:
            cursor.close()
        return key

    def query(
        self,
        text: str,
        limit: int = DEFAULT_LIMIT,
        now: Timestamp | None = None,
        node_type: str | None = None,
    ) -> list[MemoryHit]:
        """The best ``limit`` nodes for ``text``, best first (see the module docstring).

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
        now_key = _now_key(_epoch(now))
        query_vector = self._query_vector(text)
        if not self._read_lock.acquire(blocking=wait):
            return None
        try:
            self._check_open()
            # One read transaction: counts, matches and nodes all come from one snapshot,
            # whatever is committed meanwhile.
            self._reader.execute("BEGIN")
            try:
                if self._embedder is None:
                    ranked, _ = self._ranked(terms, grams, limit, now_key, node_type)
                else:
                    ranked = self._hybrid_ranked(
                        terms, grams, query_vector, limit, now_key, node_type
                    )
                return self._hits(ranked)
            finally:
                self._reader.execute("COMMIT")
        finally:
            self._read_lock.release()

    def _query_vector(self, text: str) -> Vector | None:
        """The query's vector for a hybrid recall; None for a lexical store, or when the model
        knows too few of the query's tokens for its vector to mean anything (module
        docstring)."""
        if self._embedder is None:
            return None
        if cjk_share(text) > MAX_CJK_SHARE or self._embedder.known_share(text) < MIN_KNOWN_TOKENS:
            return None
        vector: Vector = self._embedder.embed([text])[0]
        return vector

    def _ranked(
        self,
        terms: list[str],
        grams: list[str],
        limit: int,
        now_key: int,
        node_type: str | None,
    ) -> tuple[list[tuple[float, int]], str | None]:
        """The lexical recall itself as (score, seq), best first, and the FTS expression of
        its words (read lock held, read transaction open). A query with Chinese, Japanese or
        Korean text also matches their character pairs; a node then counts with the better
        of its two scores."""
        ranked, expression = self._ranked_words(terms, limit, now_key, node_type)
        if not grams:
            return ranked, expression
        found, _ = self._best(
            fts_expression(grams), limit, now_key, 1.0, node_type=node_type, cjk=True
        )
        best = dict((seq, score) for score, seq in ranked)
        for score, seq in found:
            if score > best.get(seq, -1.0):
                best[seq] = score
        merged = sorted(((score, seq) for seq, score in best.items()), reverse=True)
        return merged[:limit], expression

    def _ranked_words(
        self, terms: list[str], limit: int, now_key: int, node_type: str | None
    ) -> tuple[list[tuple[float, int]], str | None]:
        """The recall over the word index (read lock held, read transaction open).

        The bounds come from the whole store: a node type holds a subset of its matches, so
        they bound that subset's scores too.
        """
        total, changes, hi, backdated = self._reader.execute(_COUNTERS).fetchone()
        kept, counts, all_common = self._plan(terms, total, changes)
        if not kept:
            return [], None
        expression = fts_expression(kept)
        if all_common:
            ranked = self._newest(expression, limit, now_key, node_type)
        else:
            bound = 1.0
            tight: _Bounds | None = None
            if counts is not None:
                idfs = [idf_bound(total, n) for n in counts]
                bound = relevance_of(-(BM25_K1 + 1.0) * sum(idfs))
                tight = self._tight_bound(kept, idfs, changes, hi, backdated)
            ranked, above = self._best(expression, limit, now_key, bound, tight, node_type)
            if tight is not None and above > REMEASURE_ROWS:
                # Too much was read under the loose bound: measure the words that hold the
                # horizon back again, on the next recall that needs them.
                for term in kept:
                    measured = self._factors.get(term)
                    if measured is not None and measured.hi <= tight.horizon:
                        del self._factors[term]
        return ranked, expression

    def _hybrid_ranked(
        self,
        terms: list[str],
        grams: list[str],
        query_vector: Vector | None,
        limit: int,
        now_key: int,
        node_type: str | None,
    ) -> list[tuple[float, int]]:
        """The hybrid recall as (score, seq), best first (read lock held, read transaction
        open; module docstring): the best lexical and the most similar nodes are the
        candidates, each scored with both signals."""
        assert self._index is not None
        if query_vector is None:
            # Nothing the model can read (module docstring): the lexical ranking alone.
            return self._ranked(terms, grams, limit, now_key, node_type)[0]
        # The lexical candidates are what the lexical ranking would return (its scan stops
        # as early); the semantic ones reach further.
        lexical, expression = self._ranked(terms, grams, limit, now_key, node_type)
        wanted = max(limit, HYBRID_CANDIDATES)
        # seq -> lexical relevance (the lexical score without its recency factor).
        relevance = {seq: min(1.0, score / _recency_factor(seq, now_key)) for score, seq in lexical}
        cosines: dict[int, float] = {}
        self._index.sync(self._reader)
        similar = {
            vid: cosine
            for cosine, vid in self._index.top(query_vector, wanted, node_type)
            if cosine > COSINE_FLOOR
        }
        if similar:
            # Only nodes still in this snapshot (the index may hold deleted ones).
            marks = ", ".join("?" * len(similar))
            for vid, seq in self._reader.execute(
                "SELECT v.vid, n.seq FROM vectors v JOIN nodes n ON n.id = v.node_id"
                f" WHERE v.vid IN ({marks})",
                list(similar),
            ):
                cosines[seq] = similar[vid]
        # The lexical candidates' similarity, and the similar nodes' lexical relevance.
        unseen = [seq for seq in relevance if seq not in cosines]
        if unseen:
            marks = ", ".join("?" * len(unseen))
            rows = self._reader.execute(
                "SELECT n.seq, v.vec FROM nodes n JOIN vectors v ON v.node_id = n.id"
                f" WHERE n.seq IN ({marks})",
                unseen,
            ).fetchall()
            if rows:
                from arona_store.vectors import cosines_of

                found = cosines_of(query_vector, [vec for _, vec in rows])
                cosines.update(zip((seq for seq, _ in rows), found, strict=True))
        others = [seq for seq in cosines if seq not in relevance]
        # With fewer than `limit` lexical results every match was returned: the others match
        # no word, and their BM25 need not be looked up.
        if others and expression is not None and len(lexical) >= limit:
            marks = ", ".join("?" * len(others))
            for seq, bm25 in self._reader.execute(
                "SELECT rowid, bm25(nodes_fts) FROM nodes_fts WHERE nodes_fts MATCH ?"
                f" AND rowid IN ({marks})",
                [expression, *others],
            ):
                relevance[seq] = relevance_of(bm25)
        scored: list[tuple[float, int]] = []
        for seq in relevance.keys() | cosines.keys():
            fused = hybrid_relevance(relevance.get(seq, 0.0), cosines.get(seq))
            if fused > 0.0:
                scored.append((fused * _recency_factor(seq, now_key), seq))
        scored.sort(reverse=True)
        return scored[:limit]

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

    def _tight_bound(
        self, terms: list[str], idfs: list[float], changes: int, hi: int, backdated: int
    ) -> _Bounds | None:
        """The bounds on a match's relevance from the words' measured term factors; None
        when the store's averages cannot be read (read lock held, read transaction open; see
        the module docstring)."""
        rows, tokens = self._averages()
        if rows <= 0 or tokens < 0:
            return None
        avgdl = tokens / rows
        horizon = hi
        words: list[tuple[int, float, float]] = []
        for term, idf in zip(terms, idfs, strict=True):
            measured = self._factors.get(term)
            if (
                measured is None
                or measured.backdated != backdated
                or avgdl > measured.avgdl * REMEASURE_AVGDL
            ):
                measured = self._measure(term, rows, avgdl, changes, hi, backdated)
            scale = max(1.0, avgdl / measured.avgdl) if measured.avgdl > 0 else math.inf
            loose = idf * (BM25_K1 + 1.0)
            words.append((measured.oldest, min(loose, idf * measured.factor * scale), loose))
            horizon = min(horizon, measured.hi)
        return _Bounds(horizon, tuple(words))

    def _measure(
        self, term: str, rows: int, avgdl: float, changes: int, hi: int, backdated: int
    ) -> _TermFactor:
        """One pass over ``term``'s matches for its largest term factor and oldest key (read
        transaction open); a word in too many nodes keeps the general bound. ``rows`` and
        ``avgdl`` are FTS5's row count and average length in this snapshot."""
        docs, _ = self._docs_with(term, changes)
        phrase = f'"{term}"'
        factor = BM25_K1 + 1.0
        oldest: int | None = None
        if docs <= MAX_MEASURED_DOCS:
            best = 0.0
            docs = 0
            for seq, bm25 in self._reader.execute(_TERM_BM25, (phrase,)):
                if oldest is None:
                    oldest = seq
                docs += 1
                best = min(best, bm25)
            # The IDF FTS5 used for this single-word match, to divide it back out; a word
            # it clamped (in half the nodes or more) keeps the general bound.
            idf = math.log((rows - docs + 0.5) / (docs + 0.5)) if docs else 0.0
            if idf > 1e-6:
                # Rounding can only raise the factor, never lower it below the truth.
                factor = min(factor, -best / idf * (1.0 + 1e-9))
        else:
            row = self._reader.execute(_OLDEST_MATCH, (phrase,)).fetchone()
            oldest = None if row is None else int(row[0])
        # A word no node holds any more (deleted since counted) bounds nothing from the top.
        measured = _TermFactor(factor, avgdl, hi, backdated, hi if oldest is None else oldest)
        if len(self._factors) >= DOC_COUNT_CACHE_SIZE:
            self._factors.clear()
        self._factors[term] = measured
        return measured

    def _averages(self) -> tuple[int, int]:
        """FTS5's row count and total token count (read transaction open); (0, 0) if its
        averages record is missing or not as expected."""
        row = self._reader.execute(_AVERAGES).fetchone()
        if row is None or not isinstance(row[0], bytes):
            return 0, 0
        values = _varints(row[0], 2)
        return (values[0], values[1]) if len(values) == 2 else (0, 0)

    def _best(
        self,
        expression: str | None,
        limit: int,
        now_key: int,
        bound: float,
        tight: _Bounds | None = None,
        node_type: str | None = None,
        cjk: bool = False,
    ) -> tuple[list[tuple[float, int]], int]:
        """The top ``limit`` (score, seq) of a match, best first, and how many rows were read
        above the horizon (read lock held).

        Rows arrive newest first with their score; ``bound`` is the most relevance any match
        can have, ``tight`` (when known) finer bounds by key. The scan stops at the first key
        no older node can beat (module docstring).
        """
        horizon = tight.horizon if tight is not None else None
        plan = _stop_plan(tight) if tight is not None else None
        above = 0
        # Min-heap of the best `limit` so far: the root is the weakest kept result. Equal
        # scores keep the larger (newer) seq, which is the one read first.
        best: list[tuple[float, int]] = []
        stop_at: int | None = None  # scanning ends at keys <= this
        params = {"expr": expression, "now": now_key, "decay": _DECAY_PER_KEY, "cap": MAX_SCAN_ROWS}
        sql, sql_of_type = (
            (_RANKED_CJK, _RANKED_CJK_OF_TYPE)
            if cjk
            else (_RANKED_MATCHES, _RANKED_MATCHES_OF_TYPE)
        )
        if node_type is None:
            cursor = self._reader.execute(sql, params)
        else:
            cursor = self._reader.execute(sql_of_type, {**params, "node_type": node_type})
        try:
            for seq, score in cursor:
                if stop_at is not None and seq <= stop_at:
                    break
                if horizon is not None and seq > horizon:
                    above += 1
                item = (score, seq)
                if len(best) < limit:
                    heapq.heappush(best, item)
                    if len(best) < limit:
                        continue
                elif item > best[0]:
                    heapq.heapreplace(best, item)
                else:
                    continue
                stop_at = _stop_point(best[0][0], bound, plan, now_key)
        finally:
            cursor.close()
        return sorted(best, reverse=True), above

    def _newest(
        self, expression: str | None, limit: int, now_key: int, node_type: str | None = None
    ) -> list[tuple[float, int]]:
        """The newest ``limit`` matches scored with a BM25 of 0 (lock held): words in most
        nodes get an IDF of about zero, so recency alone orders them."""
        floor = relevance_of(0.0)
        if node_type is None:
            rows = self._reader.execute(_NEWEST_MATCHES, (expression, limit)).fetchall()
        else:
            rows = self._reader.execute(
                _NEWEST_MATCHES_OF_TYPE, (expression, node_type, limit)
            ).fetchall()
        return [
            (
                floor
                * (
                    (1.0 - RECENCY_WEIGHT)
                    + RECENCY_WEIGHT * math.exp(min(0, seq - now_key) * _DECAY_PER_KEY)
                ),
                seq,
            )
            for (seq,) in rows
        ]

    def _plan(
        self, terms: list[str], total: int, changes: int
    ) -> tuple[list[str], list[int] | None, bool]:
        """Choose the words worth matching on a large store (read lock held).

        Returns the kept words (none when the only rare ones are held by no node), a lower
        bound of how many nodes hold each (None on a small store, where nothing is counted) and
        whether all of the words are common.

        A word found in at least half the nodes gets an IDF clamped to almost zero by FTS5, so
        it adds nothing to BM25, yet every node holding it would have to be scored (in an
        episode store ``user`` matches every node). Such words are dropped when rarer ones
        remain; the only loss is that nodes matching nothing but common words no longer fill up
        a short result list. When every word is common, the rarest is kept and the caller ranks
        its matches by recency alone, which is what the formula yields for a BM25 of ~0.
        """
        if total < PRUNE_MIN_NODES:
            return terms, None, False
        counted = [(*self._docs_with(term, changes), term) for term in terms]
        if any(docs * 2 < total for docs, _, _ in counted):
            # A word no node holds (its count is exact when zero) matches nothing and adds
            # nothing to any BM25: leaving it out keeps the bound on relevance tight.
            kept = [(low, term) for docs, low, term in counted if 0 < docs and docs * 2 < total]
            return [term for _, term in kept], [low for low, _ in kept], False
        rarest = min(counted)
        return [rarest[2]], [rarest[1]], True

    def _docs_with(self, term: str, changes: int) -> tuple[int, int]:
        """How many nodes held ``term`` when counted, and a lower bound of how many hold it now.

        Counting a word found in most of 100,000 nodes takes milliseconds, so counts are
        cached. Each node inserted or deleted since (``changes`` counts them, in this snapshot)
        moves the true count by at most one, so the count minus those changes is a safe lower
        bound; the count is taken again once the changes since exceed a tenth of it. Runs with
        the read lock held, in the recall's read transaction.
        """
        cached = self._doc_counts.get(term)
        if cached is not None:
            drift = changes - cached[1]
            if 0 <= drift and drift * 10 <= cached[0]:
                return cached[0], max(0, cached[0] - drift)
        row = self._reader.execute(_TERM_DOCS, (f'"{term}"',)).fetchone()
        docs = int(row[0])
        if len(self._doc_counts) >= DOC_COUNT_CACHE_SIZE:
            self._doc_counts.clear()
        self._doc_counts[term] = (docs, changes)
        return docs, docs

    def unembedded(self) -> int:
        """How many nodes have no vector yet (0 for a lexical store)."""
        if self._embedder is None:
            return 0
        with self._read_lock:
            self._check_open()
            return int(self._reader.execute(_UNEMBEDDED_COUNT).fetchone()[0])

    def fill_vectors(self, batch: int = FILL_BATCH) -> int:
        """Embed up to ``batch`` nodes that have no vector, newest first, and store their
        vectors; how many (0 once every node older than the first call has one, and always
        for a lexical store). Blocks for the embedding (milliseconds a node): call it from a
        worker thread, again until it returns 0."""
        if self._embedder is None:
            return 0
        with self._read_lock:
            self._check_open()
            rows = self._reader.execute(_UNEMBEDDED, (self._fill_below, batch)).fetchall()
        if not rows:
            return 0
        vectors = self.embed([text for _, _, text in rows])
        with self._lock:
            self._check_open()
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                pairs = zip(rows, vectors, strict=True)
                self._conn.executemany(_FILL_VECTOR, [(vec, row[1]) for row, vec in pairs])
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        self._fill_below = min(seq for seq, _, _ in rows)
        return len(rows)

    def delete(self, node_id: str) -> bool:
        """Remove a node (and its index entry); True if it existed."""
        with self._lock:
            self._check_open()
            cursor = self._conn.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
            return cursor.rowcount > 0

    def count(self) -> int:
        """How many nodes are stored."""
        with self._read_lock:
            self._check_open()
            return int(self._reader.execute(_COUNTERS).fetchone()[0])

    def close(self) -> None:
        """Close the database; idempotent. Later calls raise :class:`StoreError`."""
        with self._lock, self._read_lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            self._conn.close()
        logger.info("memory store closed")


def _stop_plan(tight: _Bounds) -> tuple[list[tuple[int, int | None, float | None]], int]:
    """The key ranges where the bound on relevance is constant, newest first, each as
    (lowest key, highest key or None, most relevance or None when no word reaches it), and
    the key below every word's oldest node (where nothing is left to read).

    The most relevance a match at key ``k`` can have grows with ``k``: more words hold nodes
    that new, and above the horizon they are held to the loose factors.
    """
    starts = sorted({oldest for oldest, _, _ in tight.words} | {tight.horizon + 1})
    pieces: list[tuple[int, int | None, float | None]] = []
    for i, lower in enumerate(starts):
        upper = starts[i + 1] - 1 if i + 1 < len(starts) else None
        loose = lower > tight.horizon
        r_max = sum(
            loose_r if loose else tight_r
            for oldest, tight_r, loose_r in tight.words
            if oldest <= lower
        )
        pieces.append((lower, upper, relevance_of(-r_max) if r_max > 0.0 else None))
    pieces.reverse()
    return pieces, starts[0] - 1


def _stop_point(
    weakest: float,
    bound: float,
    plan: tuple[list[tuple[int, int | None, float | None]], int] | None,
    now_key: int,
) -> int | None:
    """The newest key from which no match can beat ``weakest``; None if none is.

    Without a plan (:func:`_stop_plan`), every key is held to ``bound``. With one, both the
    bound and recency grow with the key, so the keys where a stop is allowed are all those up
    to some key: the best stop is in the newest range that allows one.
    """
    if plan is None:
        return _stop_key(weakest, bound, now_key)
    pieces, floor = plan
    for lower, upper, relevance in pieces:
        if relevance is None:
            candidate: int | None = upper if upper is not None else now_key
        else:
            candidate = _stop_key(weakest, relevance, now_key)
            if candidate is not None and upper is not None:
                candidate = min(candidate, upper)
        if candidate is not None and candidate >= lower:
            return candidate
    return floor


def _varints(data: bytes, count: int) -> list[int]:
    """The first ``count`` SQLite varints of ``data`` (big-endian, 7 bits a byte, the ninth
    byte whole); fewer if ``data`` ends first."""
    values: list[int] = []
    i = 0
    while len(values) < count and i < len(data):
        value = 0
        for n in range(9):
            if i >= len(data):
                return values
            byte = data[i]
            i += 1
            if n == 8:
                value = (value << 8) | byte
                break
            value = (value << 7) | (byte & 0x7F)
            if not byte & 0x80:
                break
        values.append(value)
    return values


def _stop_key(weakest: float, bound: float, now_key: int) -> int | None:
    """The newest key at which no match can beat ``weakest`` any more; None if none is.

    A match at key ``k <= now_key`` scores at most ``bound * (0.6 + 0.4 * recency(k))``; this
    solves ``bound * (0.6 + 0.4 * recency) <= weakest`` for the key, erring towards older.
    """
    floor = 1.0 - RECENCY_WEIGHT
    # Slightly under, so float rounding can only make the scan go on, never stop too soon.
    recency = (weakest / bound - floor) / RECENCY_WEIGHT * (1.0 - 1e-9)
    if recency <= 0.0:
        return None
    if recency >= 1.0:
        # Even a brand-new match could not beat it: only keys in the future still can.
        return now_key
    return math.floor(now_key + math.log(recency) / _DECAY_PER_KEY) - 1


def _prepare_schema(conn: sqlite3.Connection) -> None:
    """Create the tables, or bring an older database up to date (once, in one transaction):
    version 1 had insertion-ordered keys, version 2 no digests, version 3 no character-pair
    index."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version >= SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'nodes'"
        ).fetchone()
        if exists is not None and version < 2:
            _rekey(conn)
        elif exists is not None and version < 3:
            _add_digests(conn)
        for statement in _split_script(_TABLES):
            conn.execute(statement)
        if exists is not None:
            _index_cjk(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _prepare_vectors(conn: sqlite3.Connection, model_id: str) -> None:
    """Create the vector tables of a hybrid store if missing; vectors made by another model
    are dropped (the background fill makes them again)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in _split_script(_VECTOR_TABLES):
            conn.execute(statement)
        row = conn.execute("SELECT model FROM vector_model WHERE id = 1").fetchone()
        if row is None or row[0] != model_id:
            if row is not None:
                logger.info("memory store: vectors of model %s dropped for %s", row[0], model_id)
            conn.execute("DELETE FROM vectors")
            conn.execute(
                "INSERT OR REPLACE INTO vector_model (id, model) VALUES (1, ?)", (model_id,)
            )
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _rekey(conn: sqlite3.Connection) -> None:
    """Renumber every node by time (transaction open) and rebuild the index to match."""
    count = int(conn.execute("SELECT count(*) FROM nodes").fetchone()[0])
    logger.info("memory store: re-keying %d nodes by creation time (one-time upgrade)", count)
    for name in ("nodes_ai", "nodes_ad", "nodes_au"):
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    conn.execute("DROP TABLE IF EXISTS nodes_fts")
    conn.execute("DROP INDEX IF EXISTS nodes_created")
    conn.execute("ALTER TABLE nodes RENAME TO nodes_old")
    for statement in _split_script(_TABLES):
        conn.execute(statement)
    previous: int | None = None
    for row in conn.execute(f"SELECT {_COLUMNS} FROM nodes_old ORDER BY created_at, seq"):
        created_at = float(row[3])
        key = math.floor(max(-MAX_ABS_EPOCH_S, min(MAX_ABS_EPOCH_S, created_at)) * KEY_SCALE)
        if previous is not None and key <= previous:
            key = previous + 1
        previous = key
        conn.execute(_INSERT, (key, *row, _digest(row[1], row[2], row[4], row[5], row[6])))
    conn.execute("DROP TABLE nodes_old")


def _index_cjk(conn: sqlite3.Connection) -> None:
    """Index the character pairs of every stored node that has Chinese, Japanese or Korean
    text (transaction open; a version-3 database has none indexed)."""
    conn.execute("DELETE FROM nodes_cjk")
    rows = conn.execute("SELECT seq, text FROM nodes").fetchall()
    pairs = [(seq, grams) for seq, text in rows if (grams := cjk_index_text(text)) is not None]
    conn.executemany(_INSERT_CJK, pairs)
    if pairs:
        logger.info(
            "memory store: indexed %d nodes by character pairs (one-time upgrade)", len(pairs)
        )


def _add_digests(conn: sqlite3.Connection) -> None:
    """Give every node of a version-2 database its digest (transaction open)."""
    conn.execute("ALTER TABLE nodes ADD COLUMN digest BLOB")
    rows = conn.execute(
        "SELECT seq, node_type, text, source_episode_id, related_node_ids, properties FROM nodes"
    ).fetchall()
    conn.executemany(
        "UPDATE nodes SET digest = ? WHERE seq = ?",
        ((_digest(*row[1:]), row[0]) for row in rows),
    )


def _split_script(script: str) -> list[str]:
    """The statements of :data:`_TABLES` (triggers hold inner semicolons), for execute()."""
    statements: list[str] = []
    current: list[str] = []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current)
        if line.rstrip().endswith(";") and sqlite3.complete_statement(text):
            statements.append(text)
            current = []
    return statements


def _ensure_exp(conn: sqlite3.Connection) -> None:
    """Make sure SQL ``exp()`` exists: builds of SQLite without its math functions get a
    deterministic Python one (slower per row, same results)."""
    try:
        conn.execute("SELECT exp(0)").fetchone()
    except sqlite3.OperationalError:
        conn.create_function("exp", 1, _sql_exp, deterministic=True)


def _sql_exp(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
