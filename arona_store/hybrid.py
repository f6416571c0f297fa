"""The hybrid recall: words and meaning (sentence embeddings), blended with recency.

Each node also has a unit vector from a sentence-embedding model (``vectors``, keyed by node
id, so a move keeps it; a delete or a text change drops it; ``arona_store/RANKING.md``), and a
recall blends both signals::

    lexical   = the lexical relevance (arona_store.scoring) for a word match, 0 otherwise
    semantic  = clamp((cosine - COSINE_FLOOR) / (COSINE_FULL - COSINE_FLOOR), 0, 1)
    relevance = SEMANTIC_WEIGHT * semantic + LEXICAL_WEIGHT * lexical
    score     = relevance * (0.6 + 0.4 * recency)            # in [0, 1]

The candidates are what the lexical ranking returns for the query (same scan, same bounds) and
the HYBRID_CANDIDATES nodes of closest meaning (:class:`~arona_store.vectors.VectorIndex`);
each is scored with both signals (the BM25 of a candidate found by meaning is looked up), so a
node's score does not depend on a ``node_type`` filter. A query the model cannot read (mostly
Chinese, Japanese or Korean, or mostly unknown tokens) is ranked lexically. Nodes without a
vector yet (written by the lexical ranking or an older version;
:meth:`~arona_store.store.MemoryStore.fill_vectors` adds them) count by their words only.

Nothing here imports numpy at module level: a lexical store never loads it.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

from arona_store.cjk import cjk_share
from arona_store.lexical import LexicalRanker
from arona_store.scoring import recency_factor

if TYPE_CHECKING:
    from arona_store.embedding import Embedder
    from arona_store.vectors import Vector, VectorIndex

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


def semantic_relevance(cosine: float) -> float:
    """Map a cosine similarity into [0, 1]: nothing up to COSINE_FLOOR (unrelated texts),
    everything from COSINE_FULL (close paraphrases), linear between."""
    return min(1.0, max(0.0, (cosine - COSINE_FLOOR) / (COSINE_FULL - COSINE_FLOOR)))


def hybrid_relevance(lexical: float, cosine: float | None) -> float:
    """The hybrid relevance in [0, 1]: the lexical relevance (0 without a match) and the
    semantic one (0 without a vector), weighted."""
    semantic = 0.0 if cosine is None else semantic_relevance(cosine)
    return SEMANTIC_WEIGHT * semantic + LEXICAL_WEIGHT * lexical


def query_vector(embedder: Embedder, text: str) -> Vector | None:
    """The query's vector for a hybrid recall; None when the model knows too few of the
    query's tokens for its vector to mean anything (module docstring)."""
    if cjk_share(text) > MAX_CJK_SHARE or embedder.known_share(text) < MIN_KNOWN_TOKENS:
        return None
    vector: Vector = embedder.embed([text])[0]
    return vector


def hybrid_ranked(
    reader: sqlite3.Connection,
    lexical_ranker: LexicalRanker,
    index: VectorIndex,
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
    if query_vector is None:
        # Nothing the model can read (module docstring): the lexical ranking alone.
        return lexical_ranker.ranked(terms, grams, limit, now_key, node_type)[0]
    # The lexical candidates are what the lexical ranking would return (its scan stops
    # as early); the semantic ones reach further.
    lexical, expression = lexical_ranker.ranked(terms, grams, limit, now_key, node_type)
    wanted = max(limit, HYBRID_CANDIDATES)
    # seq -> lexical relevance (the lexical score without its recency factor).
    relevance = {seq: min(1.0, score / recency_factor(seq, now_key)) for score, seq in lexical}
    cosines: dict[int, float] = {}
    index.sync(reader)
    similar = {
        vid: cosine
        for cosine, vid in index.top(query_vector, wanted, node_type)
        if cosine > COSINE_FLOOR
    }
    if similar:
        # Only nodes still in this snapshot (the index may hold deleted ones).
        marks = ", ".join("?" * len(similar))
        for vid, seq in reader.execute(
            "SELECT v.vid, n.seq FROM vectors v JOIN nodes n ON n.id = v.node_id"
            f" WHERE v.vid IN ({marks})",
            list(similar),
        ):
            cosines[seq] = similar[vid]
    # The lexical candidates' similarity, and the similar nodes' lexical relevance.
    unseen = [seq for seq in relevance if seq not in cosines]
    if unseen:
        marks = ", ".join("?" * len(unseen))
        rows = reader.execute(
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
        relevance.update(lexical_ranker.relevances(expression, others))
    scored: list[tuple[float, int]] = []
    for seq in relevance.keys() | cosines.keys():
        fused = hybrid_relevance(relevance.get(seq, 0.0), cosines.get(seq))
        if fused > 0.0:
            scored.append((fused * recency_factor(seq, now_key), seq))
    scored.sort(reverse=True)
    return scored[:limit]
