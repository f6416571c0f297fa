"""The lexical recall: the memories whose words, and whose context's words, match a question.

A memory matches by two fields of the store's word index (:mod:`arona_store.retrieval`): its own
text (``turn``) and its context document (``context``, :mod:`arona_store.context`);
:mod:`arona_store.scoring` turns their BM25 values into a score. Each field gives its best
:data:`CANDIDATES` matches (the lookup of the other field's BM25 completes each).

A recall first finds these candidates (:meth:`LexicalRanker.candidates`), then computes their
strengths (:meth:`LexicalRanker.matches`), with those of any other nodes the hybrid ranking
found by meaning in the same walks of the indexes.

Words in half the nodes or more weigh nothing in BM25 and are left out when rarer words remain
(:meth:`LexicalRanker._plan`). Likewise, on a large store, the context documents are matched
without the words found in a third of them or more (:data:`CONTEXT_COMMON`), which weigh little
there (an IDF of at most log 2, against 4.6 for a word in 1 % of them) but are most of what a
walk of that index reads (``arona_store/RANKING.md``).

A query with Chinese, Japanese or Korean text also matches its character pairs
(:mod:`arona_store.cjk`); a node then counts with the better of its two strengths, pairs
weighing as a word match with its context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arona_common import tracing
from arona_store.retrieval import Field, NodeTable, WordIndex
from arona_store.scoring import (
    CONTEXT_WEIGHT,
    QUESTION_WEIGHT,
    is_question,
    recency_factor,
    relevance_of,
    strength_of,
)

# Below this many nodes every query is cheap, so no word is ever pruned as too common.
PRUNE_MIN_NODES = 1000
DOC_COUNT_CACHE_SIZE = 10_000
# On a large store, a word found in at least 1 / CONTEXT_COMMON of the context documents is
# left out of the context index's query (LexicalRanker._context_plan).
CONTEXT_COMMON = 3
# Each of the question's words a memory holds itself adds this to its strength.
WORD_WEIGHT = 0.5
# A memory that matches through its context only (none of the words is its own) is recalled
# when it is at least this share of the best match's strength.
CONTEXT_ONLY_SHARE = 0.5
# The best matches each index proposes.
CANDIDATES = 40
# Node ids whose memory is known to ask (or not) a question (LexicalRanker.questions).
QUESTION_CACHE_SIZE = 50_000
# A recall's two steps as spans, whichever ranking: finding the candidates (words, context,
# and for the hybrid ranking the nearest vectors and the candidates' own), then scoring them.
TRACER = tracing.Tracer("arona_store")
RETRIEVE_SPAN = "memory.retrieve"
RANK_SPAN = "memory.rank"


@dataclass(frozen=True)
class Candidates:
    """The best matches of one question in each index, before their strengths: key ->
    positive BM25 (-1: matched by a rare word, not looked up yet)."""

    terms: list[str]
    # The counters of this snapshot (nodes, changes).
    total: int
    changes: int
    # The words matched (none: no memory holds any of them).
    words: list[str]
    # The words matched against the context documents (without their common words).
    context_words: list[str]
    turn: dict[int, float]
    context: dict[int, float]
    cjk: dict[int, float]


@dataclass(frozen=True)
class Matches:
    """The lexical candidates of one question: key -> strength, and its FTS expression."""

    strengths: dict[int, float]
    # The candidates that hold some of the question's words themselves (the others match
    # through their context only).
    own: set[int]
    # How much of the question the best match covers by its own words or its context
    # (LexicalRanker._coverage).
    coverage: float
    # Of every node scored (the candidates and the nodes ``also``): those holding some of the
    # question's words themselves, and those whose context document holds some (the hybrid
    # ranking's paraphrase check, arona_store.hybrid.paraphrase_first).
    holding: frozenset[int] = frozenset()
    by_context: frozenset[int] = frozenset()


class LexicalRanker:
    """The lexical recall over the store's word index and nodes (one snapshot a recall: the
    store's read lock held, its read transaction open), with the words' document counts it
    has learnt."""

    def __init__(self, words: WordIndex, nodes: NodeTable) -> None:
        self._words = words
        self._nodes = nodes
        # (field, term) -> (documents holding it, `changes` when counted); see _count.
        self._doc_counts: dict[tuple[Field, str], tuple[int, int]] = {}
        # key -> its neighbours' keys, as looked up during the current recall (matches()
        # starts it afresh): the hybrid ranking reads them again (neighbours_of).
        self._near: dict[int, list[int]] = {}
        # node id -> whether its memory only asks a question (questions()).
        self._asks: dict[str, bool] = {}

    def ranked(
        self,
        terms: list[str],
        grams: list[str],
        limit: int,
        now_key: int,
        node_type: str | None,
    ) -> list[tuple[float, int]]:
        """The lexical recall as (score, seq), best first (read lock held, read transaction
        open)."""
        with TRACER.span(RETRIEVE_SPAN, attributes={"arona.store.ranking": "lexical"}) as span:
            found = self.matches(self.candidates(terms, grams, max(limit, CANDIDATES), node_type))
            span.set_attribute("arona.store.candidates", len(found.strengths))
        with TRACER.span(RANK_SPAN):
            return self.ranked_matches(found, limit, now_key)

    def ranked_matches(self, found: Matches, limit: int, now_key: int) -> list[tuple[float, int]]:
        """The lexical recall of the matches ``found`` as (score, seq), best first."""
        best = max(found.strengths.values(), default=0.0)
        kept = {
            seq: strength
            for seq, strength in found.strengths.items()
            if seq in found.own or strength >= CONTEXT_ONLY_SHARE * best
        }
        asking = self.questions(list(kept))
        scored = [
            (
                relevance_of(strength)
                * recency_factor(seq, now_key)
                * (QUESTION_WEIGHT if seq in asking else 1.0),
                seq,
            )
            for seq, strength in kept.items()
        ]
        scored.sort(reverse=True)
        return scored[:limit]

    def candidates(
        self, terms: list[str], grams: list[str], depth: int, node_type: str | None
    ) -> Candidates:
        """The best ``depth`` matches of each index (read transaction open): the walks that
        rank, before any strength is computed (:meth:`matches`)."""
        self._near = {}
        total, changes = self._words.counters()
        kept, docs = self._plan(terms, total, changes)
        turn: dict[int, float] = {}
        context: dict[int, float] = {}
        context_words: list[str] = []
        if kept:
            context_words = self._context_plan(kept, total, changes)
            counts = dict(zip(kept, docs, strict=True)) if docs else None
            turn = self._words.top("turn", kept, depth, node_type, counts)
            if context_words:
                context = self._words.top("context", context_words, depth, node_type, counts)
        cjk = self._words.top("pairs", grams, depth, node_type) if grams else {}
        return Candidates(terms, total, changes, kept, context_words, turn, context, cjk)

    def matches(self, found: Candidates, also: list[int] | None = None) -> Matches:
        """The strengths of the candidates ``found``, and of the nodes ``also`` (found
        otherwise: by meaning) in the same walks of the indexes (read transaction open).
        ``also`` changes neither which nodes hold the question's words themselves
        (:attr:`Matches.own`) nor the coverage."""
        strengths: dict[int, float] = {}
        own: set[int] = set()
        holding: set[int] = set()
        by_context: set[int] = set()
        turn, context = found.turn, found.context
        coverage_turn: dict[int, float] = {}
        coverage_context: dict[int, float] = {}
        if found.words:
            seqs = sorted(turn.keys() | context.keys())
            wanted = sorted(set(seqs).union(also or ()))
            strengths, holding = self._strengths(
                found.words, found.context_words, wanted, turn, context
            )
            by_context = {seq for seq in wanted if context.get(seq, 0.0) > 0.0}
            own = {seq for seq in seqs if turn.get(seq, 0.0) > 0.0}
            coverage_turn = {seq: turn.get(seq, 0.0) for seq in seqs}
            around = set(seqs).union(*(self._near.get(seq, []) for seq in seqs))
            coverage_context = {seq: context[seq] for seq in around if seq in context}
        elif also:
            strengths = dict.fromkeys(also, 0.0)
        for seq, r in found.cjk.items():
            strength = (1.0 + CONTEXT_WEIGHT) * r
            own.add(seq)
            holding.add(seq)
            if strength > strengths.get(seq, -1.0):
                strengths[seq] = strength
        coverage = self._coverage(
            found.terms, found.total, found.changes, coverage_turn, coverage_context
        )
        return Matches(strengths, own, coverage, frozenset(holding), frozenset(by_context))

    def questions(self, seqs: list[int]) -> set[int]:
        """Those of ``seqs`` whose memory only asks or repeats a question
        (:func:`~arona_store.scoring.is_question`; remembered by node id, whose text never
        changes)."""
        if not seqs:
            return set()
        asking: set[int] = set()
        unknown: list[tuple[int, str]] = []
        for seq, node_id in self._nodes.ids(seqs).items():
            known = self._asks.get(node_id)
            if known is None:
                unknown.append((int(seq), node_id))
            elif known:
                asking.add(int(seq))
        if unknown:
            if len(self._asks) + len(unknown) > QUESTION_CACHE_SIZE:
                self._asks.clear()
            texts = self._nodes.texts([seq for seq, _ in unknown])
            for seq, node_id in unknown:
                text = texts.get(seq)
                if text is None:
                    continue
                self._asks[node_id] = asks = is_question(text)
                if asks:
                    asking.add(seq)
        return asking

    def _strengths(
        self,
        words: list[str],
        context_words: list[str],
        seqs: list[int],
        turn: dict[int, float],
        context: dict[int, float],
    ) -> tuple[dict[int, float], set[int]]:
        """The strengths of ``seqs``: their own BM25 (for ``words``), their context's and
        their neighbours' contexts' (for ``context_words``; none: every word is common there,
        :meth:`_context_plan`; :func:`~arona_store.scoring.strength_of`); and those of ``seqs``
        that hold some of ``words`` themselves. ``turn`` and ``context`` hold the BM25 values
        known already (-1: not yet looked up) and are completed."""
        unscored = [s for s in seqs if turn.get(s, -1) < 0]
        turn.update(dict.fromkeys(unscored, 0.0))
        turn.update(self._words.scores("turn", words, unscored))
        near = self.neighbours_of(seqs)
        wanted = {s for s in seqs if context.get(s, -1) < 0}
        wanted.update(j for js in near.values() for j in js if j not in context)
        context.update(dict.fromkeys(wanted, 0.0))
        if context_words:
            context.update(self._words.scores("context", context_words, sorted(wanted)))
        # BM25 gives nothing to a word in half the memories or more, so in a store of a
        # handful of memories every match weighs about zero; the count of words held still
        # tells "I prefer oolong tea" from a memory that only sits next to it.
        held = self._words.held(words, seqs)
        strengths = {
            s: strength_of(
                turn.get(s, 0.0),
                context.get(s, 0.0),
                [context.get(j, 0.0) for j in near.get(s, [])],
            )
            + WORD_WEIGHT * held.get(s, 0)
            for s in seqs
        }
        # BM25 rounds a word in half the memories to about nothing; holding it still counts.
        holding = {s for s in seqs if turn.get(s, 0.0) > 0.0 or held.get(s, 0) > 0}
        return strengths, holding

    def neighbours_of(self, seqs: list[int]) -> dict[int, list[int]]:
        """The keys of each of ``seqs``' neighbours (:func:`~arona_store.context.neighbours`;
        a key no node holds has none), looked up once a recall."""
        missing = [s for s in seqs if s not in self._near]
        if missing:
            found = self._nodes.neighbours(missing)
            for s in missing:
                self._near[s] = found.get(s, [])
        return {s: self._near[s] for s in seqs}

    def _coverage(
        self,
        terms: list[str],
        total: int,
        changes: int,
        turn: dict[int, float],
        context: dict[int, float],
    ) -> float:
        """How much of the question the best match covers, by its own words or by its
        context document (a turn of a conversation often leaves to its neighbours what the
        question names): its BM25 over the sum of the words' IDFs (the BM25 of a document of
        average length holding each word once), at most 1; 0 when no node holds any of the
        words itself. A word no node holds counts in full, so a question only half of which
        the store knows is half covered."""
        best = max(turn.values(), default=0.0)
        if best <= 0.0 or total <= 0:
            return 0.0
        best = max(best, max(context.values(), default=0.0))
        whole = 0.0
        for term in terms:
            docs, _ = self._docs_with(term, changes)
            whole += max(1e-6, math.log((total - docs + 0.5) / (docs + 0.5)))
        return min(1.0, best / whole) if whole > 0 else 0.0

    def _plan(self, terms: list[str], total: int, changes: int) -> tuple[list[str], list[int]]:
        """Choose the words worth matching on a large store (read lock held).

        Returns the kept words (none when no node holds any of them) and how many nodes held
        each when counted (none on a small store, where nothing is counted).

        A word found in at least half the nodes gets an IDF clamped to almost zero by FTS5, so
        it adds nothing to BM25, yet every node holding it would have to be scored (in an
        episode store ``user`` matches every node). Such words are dropped when rarer ones
        remain; the only loss is that nodes matching nothing but common words no longer fill up
        a short result list. When every word some node holds is common, the rarest is kept and
        its matches all have a BM25 of about zero, so the newest come first. A word no node
        holds (its count is exact when zero) matches nothing and adds nothing to any BM25: it
        is left out, and never counts as a rarer word (a question whose other words are all
        common would otherwise find nothing at all).
        """
        if total < PRUNE_MIN_NODES:
            return terms, []
        counted = [
            (docs, low, term)
            for docs, low, term in (self._docs_with(t, changes) + (t,) for t in terms)
            if docs > 0
        ]
        if not counted:
            return [], []
        if any(docs * 2 < total for docs, _, _ in counted):
            kept = [(docs, term) for docs, _, term in counted if docs * 2 < total]
            return [term for _, term in kept], [docs for docs, _ in kept]
        rarest = min(counted)
        return [rarest[2]], [rarest[0]]

    def _context_plan(self, kept: list[str], total: int, changes: int) -> list[str]:
        """The words of ``kept`` (:meth:`_plan`) worth matching against the context documents:
        on a large store, those found in under 1 / :data:`CONTEXT_COMMON` of them; none when
        every word is that common, so the context adds little to any memory's strength and
        its index is not walked (read lock held)."""
        if total < PRUNE_MIN_NODES:
            return kept
        return [term for term in kept if self._context_docs(term, changes) * CONTEXT_COMMON < total]

    def _context_docs(self, term: str, changes: int) -> int:
        """About how many context documents hold ``term`` (:meth:`_count`: each node
        inserted or deleted rewrites up to five of them)."""
        count, _ = self._count("context", term, changes, 5)
        return count

    def _docs_with(self, term: str, changes: int) -> tuple[int, int]:
        """How many nodes held ``term`` when counted, and a lower bound of how many hold it now.

        Counting a word found in most of 100,000 nodes takes milliseconds, so counts are
        cached. Each node inserted or deleted since (``changes`` counts them, in this snapshot)
        moves the true count by at most one, so the count minus those changes is a safe lower
        bound; the count is taken again once the changes since exceed a tenth of it.
        """
        docs, drift = self._count("turn", term, changes, 1)
        return docs, max(0, docs - drift)

    def _count(self, field: Field, term: str, changes: int, moves: int) -> tuple[int, int]:
        """How many documents of ``field`` held ``term`` when counted (cached), and how many
        nodes were inserted or deleted since (``changes`` counts them, in this snapshot).
        Each of those moves the count by at most ``moves``; it is taken again once they
        could have moved it by more than a tenth."""
        key = (field, term)
        cached = self._doc_counts.get(key)
        if cached is not None:
            drift = changes - cached[1]
            if 0 <= drift and drift * moves * 10 <= cached[0]:
                return cached[0], drift
        count = self._words.count(field, term)
        if len(self._doc_counts) >= DOC_COUNT_CACHE_SIZE:
            self._doc_counts.clear()
        self._doc_counts[key] = (count, changes)
        return count, 0
