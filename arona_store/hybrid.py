"""The hybrid recall: words (with their context) and meaning (sentence embeddings).

Each node also has a unit vector from a sentence-embedding model (``vectors``, keyed by node
id, so a move keeps it; a delete or a text change drops it; ``arona_store/RANKING.md``). The
candidates are the lexical ranking's best matches (:mod:`arona_store.lexical`, words and
context) and the :data:`HYBRID_CANDIDATES` nodes of closest meaning
(:class:`~arona_store.vectors.VectorIndex`); each is scored with both signals (a candidate found
by meaning has its BM25 looked up, one found by words its cosine), and the two are blended as
z-scores over the candidates::

    cosine    = its own cosine + 0.5 * the mean cosine of its neighbours (two each side)
    z(x)      = (x - mean of x over the candidates) / its standard deviation
    blend     = (1 - SEMANTIC_WEIGHT) * z(strength) + SEMANTIC_WEIGHT * z(cosine)
    score     = 1 / (1 + exp(-blend)) * (0.98 + 0.02 * recency)

When the words found cover little of the question, meaning weighs more (up to
:data:`SEMANTIC_WEIGHT_UNCOVERED`): the paraphrase "Does my kid have any food allergy?" must
find "My daughter Mia is allergic to peanuts." before "I cooked food for my kid's party". That
weight is a guess about the question, so each candidate then counts with the better of two
readings: that blend, and the blend at :data:`SEMANTIC_WEIGHT` less
:data:`WORDS_READING_MARGIN` (:func:`two_readings`). A memory the words find much better than
the others is not buried by the reading that trusts meaning, and the paraphrase still comes
first (LoCoMo R@1 / R@5 / R@10 34.7 / 66.4 / 74.5 to 35.2 / 66.7 / 75.2; ``bench.recall_quality``
unchanged; with no margin, its recall@1 fell from 0.47 to 0.38; arona_store/RANKING.md).

A z-score puts both signals on the scale of this question's candidates: BM25 values differ by
an order of magnitude from one question to the next, cosines much less, so a fixed blend of the
raw values lets one of them decide alone (the 0.8 / 0.2 blend used before found less on LoCoMo
than words alone). A query the model cannot read (mostly Chinese, Japanese or Korean, or mostly
unknown tokens) is ranked lexically. Nodes without a vector yet (written by the lexical ranking
or an older version; :meth:`~arona_store.store.MemoryStore.fill_vectors` adds them) count with
the candidates' mean cosine.

The model embeds a memory without the gateway's role labels (``User:``, ``Assistant:`` at the
start of a line): a label says nothing about the topic and pulls every episode's vector
towards every other's (LoCoMo, cosine alone: R@5 34.3 with the labels, 36.6 without).

A memory's neighbours count in its meaning as its context document counts in its words
(:mod:`arona_store.context`): "I went yesterday, it was so powerful" is close in meaning to
nothing, the turn before it to the question (LoCoMo R@5 / R@10 +0.5 / +0.4).

A memory's context is the memories around it, whatever they are: facts said one after another
lend each other their words and their meaning. So the first places get a last look by meaning
alone (:func:`paraphrase_first`): among the first :data:`PARAPHRASE_PLACES`, when the memory
closest to the question by its own cosine holds none of the question's words (a memory holding
some counting :data:`SHARED_WORD_LIFT` less: a shared word lifts the cosine by itself), it is a
paraphrase of what is asked and comes first, provided the words found it through its context or
it is clearly about the question (:data:`PARAPHRASE_ALONE_COSINE`). "I work as a nurse at St.
Mary's hospital." then comes before "My job interview went well last week." stored beside it
for "What is my job?" (``bench.recall_quality`` recall@1 0.47 to 0.75), while in a conversation,
where the memory closest in meaning nearly always holds the question's words (a name), nothing
moves (LoCoMo unchanged; arona_store/RANKING.md).

Nothing here imports numpy at module level: a lexical store never loads it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from arona_store.cjk import cjk_share
from arona_store.floor import far
from arona_store.lexical import RANK_SPAN, RETRIEVE_SPAN, TRACER, LexicalRanker, Matches
from arona_store.retrieval import NodeTable, VectorSearch
from arona_store.scoring import QUESTION_WEIGHT, recency_factor

if TYPE_CHECKING:
    from arona_store.embedding import Embedder
    from arona_store.vectors import Vector

# The weight of meaning in the blend (module docstring), the cosine a node found by meaning
# must exceed to be a candidate, how many candidates each signal proposes, and the share of a
# query's tokens the embedding model must know for its vector to count.
SEMANTIC_WEIGHT = 0.3
SEMANTIC_WEIGHT_UNCOVERED = 0.7
COVERED = 0.45
UNCOVERED = 0.35
COSINE_FLOOR = 0.2
# When meaning weighs more than SEMANTIC_WEIGHT, a candidate also counts with its blend at
# SEMANTIC_WEIGHT less this (in standard deviations; two_readings).
WORDS_READING_MARGIN = 0.42
HYBRID_CANDIDATES = 40
MIN_KNOWN_TOKENS = 0.75
# The model reads English: a query mostly in Chinese, Japanese or Korean characters (even ones
# its vocabulary holds, as kana) gets vectors that all look alike, so it is ranked by words.
MAX_CJK_SHARE = 0.3
# The cosine a memory that holds none of the question's words itself must reach.
MIN_OWN_COSINE = 0.25
# The mean cosine of a memory's neighbours (two each side, arona_store.context) counts this
# much in its own: its context in meaning, as the context document is in words.
NEIGHBOUR_COSINE_WEIGHT = 0.5
# What the stored vectors are of (arona_store.schema.prepare_vectors drops those of another).
VECTOR_TEXT = "unlabelled"
# The paraphrase check (paraphrase_first): the first places it looks at, how much less a memory
# holding some of the question's words counts in it, and the cosine a memory found by meaning
# alone (its context holding none of the words either) must reach to come first.
PARAPHRASE_PLACES = 3
SHARED_WORD_LIFT = 0.02
PARAPHRASE_ALONE_COSINE = 0.4

_ROLE_LABEL = re.compile(r"^(?:User|Assistant):[ \t]*", re.MULTILINE)


def embedding_text(text: str) -> str:
    """What the model embeds for a memory: its text without the role labels."""
    return _ROLE_LABEL.sub("", text)


def vector_model_id(embedder: Embedder) -> str:
    """The name the stored vectors are kept under: the model and what it embeds."""
    return f"{embedder.model_id}/{VECTOR_TEXT}"


def query_vector(embedder: Embedder, text: str) -> Vector | None:
    """The query's vector for a hybrid recall; None when the model knows too few of the
    query's tokens for its vector to mean anything (module docstring)."""
    if cjk_share(text) > MAX_CJK_SHARE or embedder.known_share(text) < MIN_KNOWN_TOKENS:
        return None
    vector: Vector = embedder.embed([text])[0]
    return vector


def semantic_weight(coverage: float) -> float:
    """The weight of meaning for a question whose best word match covers ``coverage`` of it:
    :data:`SEMANTIC_WEIGHT` when it covers most of it, up to :data:`SEMANTIC_WEIGHT_UNCOVERED`
    when the words found are only a small part of the question (module docstring)."""
    share = (COVERED - coverage) / (COVERED - UNCOVERED)
    share = min(1.0, max(0.0, share))
    return SEMANTIC_WEIGHT + (SEMANTIC_WEIGHT_UNCOVERED - SEMANTIC_WEIGHT) * share


def standardised(
    strengths: dict[int, float], cosines: dict[int, float]
) -> dict[int, tuple[float, float]]:
    """Each candidate's z-scores of its strength and of its cosine, over the candidates
    (module docstring); a candidate without a cosine counts with the mean."""
    seqs = list(strengths.keys() | cosines.keys())
    lexical = _z([strengths.get(s, 0.0) for s in seqs])
    known = [cosines[s] for s in seqs if s in cosines]
    mean = sum(known) / len(known) if known else 0.0
    semantic = _z([cosines.get(s, mean) for s in seqs])
    return {s: (lx, sm) for s, lx, sm in zip(seqs, lexical, semantic, strict=True)}


def _mix(lexical: float, semantic: float, weight: float) -> float:
    """The blend of two z-scores, meaning weighing ``weight``."""
    return (1.0 - weight) * lexical + weight * semantic


def two_readings(
    strengths: dict[int, float], cosines: dict[int, float], weight: float
) -> dict[int, float]:
    """Each candidate's blend of its z-scores (:func:`standardised`), meaning weighing
    ``weight`` (:func:`semantic_weight`); when that is more than :data:`SEMANTIC_WEIGHT` (the
    words found cover little of the question), each candidate counts with the better of it
    and the blend at :data:`SEMANTIC_WEIGHT` less :data:`WORDS_READING_MARGIN` (module
    docstring)."""
    scores = standardised(strengths, cosines)
    if weight <= SEMANTIC_WEIGHT:
        return {s: _mix(lx, sm, weight) for s, (lx, sm) in scores.items()}
    return {
        s: max(_mix(lx, sm, weight), _mix(lx, sm, SEMANTIC_WEIGHT) - WORDS_READING_MARGIN)
        for s, (lx, sm) in scores.items()
    }


def paraphrase_first(
    scored: list[tuple[float, int]],
    closeness: dict[int, float],
    holding: AbstractSet[int],
    by_context: AbstractSet[int],
) -> list[tuple[float, int]]:
    """``scored`` (score, seq), best first, with a paraphrase of the question moved to the
    first place (module docstring): among the first :data:`PARAPHRASE_PLACES`, the memory of
    highest ``closeness`` (its own cosine; one in ``holding``, holding some of the question's
    words itself, counting :data:`SHARED_WORD_LIFT` less), when it holds none of the words and
    is in ``by_context`` (its context holds some) or has a cosine of at least
    :data:`PARAPHRASE_ALONE_COSINE`. The first places' scores are handed out again in the new
    order, so the scores stay in order."""
    first = scored[:PARAPHRASE_PLACES]
    known = [seq for _, seq in first if seq in closeness]
    if not known:
        return scored

    def near(seq: int) -> float:
        return closeness[seq] - (SHARED_WORD_LIFT if seq in holding else 0.0)

    pick = max(known, key=near)  # the first in order of the equally close
    if pick == first[0][1] or pick in holding:
        return scored
    if pick not in by_context and closeness[pick] < PARAPHRASE_ALONE_COSINE:
        return scored
    order = [pick] + [seq for _, seq in first if seq != pick]
    return [(score, seq) for (score, _), seq in zip(first, order, strict=True)] + scored[
        PARAPHRASE_PLACES:
    ]


def _cosines_of_keys(
    nodes: NodeTable, index: VectorSearch, query_vector: Vector, seqs: list[int]
) -> dict[int, float]:
    """The cosine of the query with the vector of each of ``seqs`` that has one, from the
    index (synced in this read transaction: it holds every vector the snapshot has)."""
    if not seqs:
        return {}
    rows = list(nodes.ids(seqs).items())
    found = index.cosines(query_vector, [node_id for _, node_id in rows])
    return {seq: cosine for (seq, _), cosine in zip(rows, found, strict=True) if cosine is not None}


def _with_neighbours(
    nodes: NodeTable,
    lexical_ranker: LexicalRanker,
    index: VectorSearch,
    query_vector: Vector,
    cosines: dict[int, float],
) -> dict[int, float]:
    """Each candidate's cosine plus :data:`NEIGHBOUR_COSINE_WEIGHT` times the mean cosine of
    its neighbours that have a vector (read transaction open)."""
    if not cosines:
        return cosines
    near = lexical_ranker.neighbours_of(list(cosines))
    known = dict(cosines)
    unseen = sorted({j for js in near.values() for j in js if j not in known})
    known.update(_cosines_of_keys(nodes, index, query_vector, unseen))
    out = {}
    for seq, cosine in cosines.items():
        around = [known[j] for j in near.get(seq, []) if j in known]
        mean = sum(around) / len(around) if around else 0.0
        out[seq] = cosine + NEIGHBOUR_COSINE_WEIGHT * mean
    return out


def _z(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    if spread <= 1e-12:
        return [0.0] * len(values)
    return [(v - mean) / spread for v in values]


def squash(value: float) -> float:
    """A blend as a score in (0, 1), in the same order."""
    return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, value))))


def hybrid_ranked(
    nodes: NodeTable,
    lexical_ranker: LexicalRanker,
    index: VectorSearch,
    terms: list[str],
    grams: list[str],
    vector_of: Callable[[], Vector | None],
    limit: int,
    now_key: int,
    node_type: str | None,
    personal: bool = True,
) -> list[tuple[float, int]]:
    """The hybrid recall as (score, seq), best first (read lock held, read transaction
    open, ``index`` caught up with it; module docstring). ``vector_of`` gives the query's
    vector (:func:`query_vector`), waiting for it if need be: it is asked once the words'
    candidates are found, so the model can embed the query on another thread meanwhile.
    ``personal``: whether the question speaks of its writer or names someone this memory
    knows (:func:`~arona_store.floor.far`)."""
    depth = max(limit, HYBRID_CANDIDATES)
    with TRACER.span(RETRIEVE_SPAN, attributes={"arona.store.ranking": "hybrid"}) as span:
        candidates = lexical_ranker.candidates(terms, grams, depth, node_type)
        query_vector = vector_of()
        cosines: dict[int, float] = {}
        if query_vector is None:
            found = lexical_ranker.matches(candidates)
        else:
            # Only nodes still in this snapshot (the index may hold deleted ones).
            for cosine, node_id in index.top_nodes(query_vector, depth, node_type):
                seq = nodes.key_of(node_id)
                if cosine > COSINE_FLOOR and seq is not None:
                    cosines[seq] = cosine
            # The similar nodes' strength, in the same walks of the indexes as the words'
            # candidates'.
            found = lexical_ranker.matches(candidates, also=list(cosines))
            # The lexical candidates' similarity.
            unseen = [seq for seq in found.strengths if seq not in cosines]
            cosines.update(_cosines_of_keys(nodes, index, query_vector, unseen))
        span.set_attribute("arona.store.candidates", len(found.strengths))
    with TRACER.span(RANK_SPAN):
        if query_vector is None:
            # Nothing the model can read (module docstring): the lexical ranking alone.
            return lexical_ranker.ranked_matches(found, limit, now_key)
        return _ranked(
            nodes, lexical_ranker, index, query_vector, found, cosines, limit, now_key, personal
        )


def _ranked(
    nodes: NodeTable,
    lexical_ranker: LexicalRanker,
    index: VectorSearch,
    query_vector: Vector,
    found: Matches,
    cosines: dict[int, float],
    limit: int,
    now_key: int,
    personal: bool,
) -> list[tuple[float, int]]:
    """The hybrid ranking of the candidates ``found`` and their ``cosines`` (module
    docstring), best first."""
    strengths = dict(found.strengths)
    # No candidate has its vector yet (memories just stored: they are embedded after their
    # store is answered): those holding the question's words are found by them meanwhile.
    unembedded = not cosines and bool(found.own)
    if not unembedded and far(max(cosines.values(), default=0.0), found.coverage, personal):
        return []  # nothing close in meaning, few of its words (arona_store.floor)
    # A memory holding none of the question's words itself (found through its context, or by
    # meaning alone) must be close enough in meaning itself.
    for seq in [s for s in strengths if s not in found.own]:
        if cosines.get(seq, 0.0) < MIN_OWN_COSINE:
            del strengths[seq]
            cosines.pop(seq, None)
    closeness = dict(cosines)  # each memory's own cosine (paraphrase_first)
    cosines = _with_neighbours(nodes, lexical_ranker, index, query_vector, cosines)
    # A memory that only asks (or echoes) a question shares its words and its meaning: both
    # signals count QUESTION_WEIGHT of theirs (arona_store.scoring.is_question).
    asking = lexical_ranker.questions(list(strengths))
    for seq in asking:
        strengths[seq] *= QUESTION_WEIGHT
        if seq in cosines:
            cosines[seq] *= QUESTION_WEIGHT
            closeness[seq] *= QUESTION_WEIGHT
    blended = two_readings(strengths, cosines, semantic_weight(found.coverage))
    scored = [
        (
            squash(b) * recency_factor(seq, now_key) * (QUESTION_WEIGHT if seq in asking else 1.0),
            seq,
        )
        for seq, b in blended.items()
    ]
    scored.sort(reverse=True)
    return paraphrase_first(scored, closeness, found.holding, found.by_context)[:limit]
