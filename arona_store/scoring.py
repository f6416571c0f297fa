"""The lexical score of a memory: BM25 relevance blended with recency.

The formula (SQLite evaluates it per row in :mod:`arona_store.lexical`)::

    r         = max(0, -bm25(nodes_fts))              # FTS5 BM25, bigger is better
    relevance = 0.2 + 0.8 * r / (r + 4)               # in [0.2, 1): any match counts a bit
    age_days  = max(0, now - created_at) / 86400
    recency   = 0.5 ** (age_days / 14)                # 14-day half-life, in (0, 1]
    score     = relevance * (0.6 + 0.4 * recency)     # in (0, 1)

The floor on ``relevance`` exists because FTS5 clamps the IDF of a term present in half the
documents or more to almost zero, which on a small store would report every match as worthless.
"""

from __future__ import annotations

import math

from arona_store.nodes import KEY_SCALE

HALF_LIFE_DAYS = 14.0
RELEVANCE_FLOOR = 0.2
BM25_SATURATION = 4.0
RECENCY_WEIGHT = 0.4
# FTS5's bm25() constant k1: one word adds at most (k1 + 1) * idf to BM25, whatever its
# frequency in the node and the node's length.
BM25_K1 = 1.2
SECONDS_PER_DAY = 86400.0
# recency = exp((seq - now_key) * DECAY_PER_KEY) for a node older than now.
DECAY_PER_KEY = math.log(2.0) / (HALF_LIFE_DAYS * SECONDS_PER_DAY * KEY_SCALE)


def relevance_of(bm25: float) -> float:
    """Map an FTS5 bm25() value (negative, smaller is better) into [RELEVANCE_FLOOR, 1)."""
    r = max(0.0, -bm25)
    return RELEVANCE_FLOOR + (1.0 - RELEVANCE_FLOOR) * r / (r + BM25_SATURATION)


def recency_of(created_at: float, now: float) -> float:
    """The 14-day half-life decay; a timestamp in the future counts as brand new."""
    age_days = max(0.0, now - created_at) / SECONDS_PER_DAY
    return float(0.5 ** (age_days / HALF_LIFE_DAYS))


def score_of(bm25: float, created_at: float, now: float) -> float:
    """The blended score in (0, 1): relevance scaled by a recency factor in (0.6, 1]."""
    recency = recency_of(created_at, now)
    return relevance_of(bm25) * ((1.0 - RECENCY_WEIGHT) + RECENCY_WEIGHT * recency)


def recency_factor(seq: int, now_key: int) -> float:
    """``0.6 + 0.4 * recency`` of the node at key ``seq``."""
    return (1.0 - RECENCY_WEIGHT) + RECENCY_WEIGHT * math.exp(min(0, seq - now_key) * DECAY_PER_KEY)


def idf_bound(total: int, docs: int) -> float:
    """An upper bound of FTS5's IDF for a word in at least ``docs`` of ``total`` nodes.

    FTS5 computes ``log((N - n + 0.5) / (n + 0.5))`` and lifts anything not positive to 1e-6;
    the value only grows as ``n`` shrinks, so a lower bound of ``n`` gives an upper bound.
    """
    n = max(0, docs)
    idf = math.log((max(total, n) - n + 0.5) / (n + 0.5))
    return idf if idf > 1e-6 else 1e-6
