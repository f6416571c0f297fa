"""The lexical recall: the best matches of a question's words, scanned newest first.

SQLite computes BM25 and the blended score (:mod:`arona_store.scoring`) in C for only the rows
actually read: FTS5 walks a match list in rowid order, and a node's rowid is its time
(:mod:`arona_store.nodes`), so matches arrive newest first. Results are ordered by score, then
newer ``created_at``, then later insertion.

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

A query with Chinese, Japanese or Korean text also matches its character pairs
(:mod:`arona_store.cjk`); a node then counts with the better of its two scores.
"""

from __future__ import annotations

import heapq
import math
import sqlite3
from dataclasses import dataclass

from arona_store.schema import COUNTERS
from arona_store.scoring import (
    BM25_K1,
    BM25_SATURATION,
    DECAY_PER_KEY,
    RECENCY_WEIGHT,
    RELEVANCE_FLOOR,
    idf_bound,
    relevance_of,
)
from arona_store.words import fts_expression

# Below this many nodes every query is cheap, so no word is ever pruned as too common.
PRUNE_MIN_NODES = 1000
DOC_COUNT_CACHE_SIZE = 10_000
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
# Matches of a word found in most nodes: the newest `limit`, read straight off the index.
_NEWEST_MATCHES = "SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH ? ORDER BY rowid DESC LIMIT ?"
_NEWEST_MATCHES_OF_TYPE = (
    "SELECT nodes_fts.rowid FROM nodes_fts JOIN nodes ON nodes.seq = nodes_fts.rowid"
    " WHERE nodes_fts MATCH ? AND nodes.node_type = ? ORDER BY nodes_fts.rowid DESC LIMIT ?"
)
_TERM_DOCS = "SELECT count(*) FROM nodes_fts WHERE nodes_fts MATCH ?"
# FTS5's "averages" record: varints holding its row count and total token count.
_AVERAGES = "SELECT block FROM nodes_fts_data WHERE id = 1"
# Every BM25 of one word's matches (oldest first), to find its best term factor.
_TERM_BM25 = "SELECT rowid, bm25(nodes_fts) FROM nodes_fts WHERE nodes_fts MATCH ? ORDER BY rowid"
_OLDEST_MATCH = "SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH ? ORDER BY rowid LIMIT 1"


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


class LexicalRanker:
    """The lexical recall over one reader connection, with what it learns about the words
    (their document counts and measured term factors). Used under the store's read lock, in
    its read transaction."""

    def __init__(self, reader: sqlite3.Connection) -> None:
        self._reader = reader
        # term -> (nodes holding it, `changes` when counted); see _docs_with.
        self._doc_counts: dict[str, tuple[int, int]] = {}
        # term -> its measured term factor; see _tight_bound.
        self._factors: dict[str, _TermFactor] = {}

    def ranked(
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
        total, changes, hi, backdated = self._reader.execute(COUNTERS).fetchone()
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

    def relevances(self, expression: str, seqs: list[int]) -> dict[int, float]:
        """The lexical relevance (no recency) of the nodes ``seqs`` that match
        ``expression``.

        ``+rowid`` keeps the list away from FTS5: given ``rowid IN (...)``, SQLite runs the
        full-text query once per listed row, and ``bm25()`` counts every match of every word
        again each time (40 rows: 3-6 ms at 10,000 nodes, 15-36 ms at 100,000). So FTS5 walks
        the matches once and SQLite keeps the listed ones: the same scores, 0.2-0.5 and
        2-3.5 ms."""
        marks = ", ".join("?" * len(seqs))
        return {
            seq: relevance_of(bm25)
            for seq, bm25 in self._reader.execute(
                "SELECT rowid, bm25(nodes_fts) FROM nodes_fts WHERE nodes_fts MATCH ?"
                f" AND +rowid IN ({marks})",
                [expression, *seqs],
            )
        }

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
        params = {"expr": expression, "now": now_key, "decay": DECAY_PER_KEY, "cap": MAX_SCAN_ROWS}
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
                    + RECENCY_WEIGHT * math.exp(min(0, seq - now_key) * DECAY_PER_KEY)
                ),
                seq,
            )
            for (seq,) in rows
        ]

    def _plan(
        self, terms: list[str], total: int, changes: int
    ) -> tuple[list[str], list[int] | None, bool]:
        """Choose the words worth matching on a large store (read lock held).

        Returns the kept words (none when no node holds any of them), a lower bound of how many
        nodes hold each (None on a small store, where nothing is counted) and whether all of the
        words are common.

        A word found in at least half the nodes gets an IDF clamped to almost zero by FTS5, so
        it adds nothing to BM25, yet every node holding it would have to be scored (in an
        episode store ``user`` matches every node). Such words are dropped when rarer ones
        remain; the only loss is that nodes matching nothing but common words no longer fill up
        a short result list. When every word some node holds is common, the rarest is kept and
        the caller ranks its matches by recency alone, which is what the formula yields for a
        BM25 of ~0. A word no node holds (its count is exact when zero) matches nothing and adds
        nothing to any BM25: it is left out, and never counts as a rarer word (a question
        whose other words are all common would otherwise find nothing at all).
        """
        if total < PRUNE_MIN_NODES:
            return terms, None, False
        counted = [
            (docs, low, term)
            for docs, low, term in (self._docs_with(t, changes) + (t,) for t in terms)
            if docs > 0
        ]
        if not counted:
            return [], None, False
        if any(docs * 2 < total for docs, _, _ in counted):
            kept = [(low, term) for docs, low, term in counted if docs * 2 < total]
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
    return math.floor(now_key + math.log(recency) / DECAY_PER_KEY) - 1
