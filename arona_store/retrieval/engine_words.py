"""The word index a recall reads: the word engine's BM25, FTS5's until the engine is ready.

:class:`EngineWords` answers every question of :class:`~arona_store.retrieval.WordIndex` for
a memory's own text (``turn``) and its context document (``context``) with the word engine
(:mod:`arona_store.retrieval.tantivy_index`): its best matches, the BM25 of listed memories,
the words each holds, a word's document count. Each of these is one search of the engine, in C
(block-max WAND for the best matches), whatever the store's size; FTS5's ``bm25()`` first
counted every match of every word across the whole index in each statement (about 14 ms a
recall at 100,000 memories). The character pairs of Chinese, Japanese and Korean text
(``pairs``) stay with FTS5 in the embedded store; the engine indexes them too, and the store on
PostgreSQL (which has no FTS5) scores them there, with the same formula.

The scores are tantivy's BM25 (k1 1.2, b 0.75, document lengths in tantivy's one-byte buckets)
with FTS5's IDF, ``ln((N - n + 0.5) / (n + 0.5))`` and at least 1e-6 (:func:`fts5_idf`): each
word's part of tantivy's score is scaled by FTS5's IDF over tantivy's own (a boost), so a word in
half the memories or more still weighs nothing and the ranking's weights, tuned on FTS5, hold.
The memories whose documents the engine does not hold as the database does (the **dirty**
keys: written, moved or deleted since its last commit, or neighbours of those) are read from
the recall's snapshot and scored here with the same formula (the engine's average lengths), so
a memory is recallable the moment its write is answered and a deleted one never comes back.
Among equal scores the newest matches are kept, as FTS5's walk kept them (:meth:`EngineWords.top`).

:meth:`EngineWords.begin` fixes one view of the engine for the whole recall.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tantivy

from arona_store.cjk import cjk_index_text
from arona_store.retrieval import Field, WordIndex
from arona_store.retrieval.tantivy_index import (
    K1,
    PROBE_KEYS,
    PROBE_WORD,
    PROBES,
    TIE_MARGIN,
    B,
    Documents,
    WordEngine,
    WordView,
    bucketed,
    tantivy_idf,
)


def fts5_idf(total: int, held: int) -> float:
    """A word's IDF as FTS5's ``bm25()`` has it: ``ln((N - n + 0.5) / (n + 0.5))``, at least
    1e-6, so a word in half the memories or more weighs nothing."""
    ratio = (total - held + 0.5) / (held + 0.5)
    return max(1e-6, math.log(ratio)) if ratio > 0 else 1e-6


@dataclass(frozen=True)
class _Document:
    """A dirty memory's fields as the recall's snapshot holds them."""

    node_type: str
    terms: Mapping[str, Counter[str]]
    lengths: Mapping[str, int]


class EngineWords:
    """:class:`~arona_store.retrieval.WordIndex` over the word engine, the dirty keys read from
    the snapshot of one connection (module docstring)."""

    def __init__(
        self, fts: WordIndex, documents: Documents, engine: WordEngine, *, pairs: bool = False
    ) -> None:
        """``fts``: what answers until the engine is built, and the character pairs unless
        ``pairs`` (then the engine's); ``documents``: the recall's snapshot, where dirty keys
        are read."""
        self._fts = fts
        self._fields: frozenset[Field] = frozenset(
            ("turn", "context", "pairs") if pairs else ("turn", "context")
        )
        self._snapshot = documents
        self._engine = engine
        self._analyzer = engine.analyzer
        self._schema = engine.schema
        self._view: WordView | None = None
        # How many memories the recall's snapshot holds, and how many hold each term (per
        # recall).
        self._total = 0
        self._held_counts: dict[tuple[Field, str], int] = {}
        self._averages: dict[Field, float] = {}
        # Dirty key -> (the generation read, its document; None: no memory holds the key).
        self._overlay: dict[int, tuple[int, _Document | None]] = {}
        # word -> its tokens, as the engine's analyzer gives them.
        self._tokens: dict[str, list[str]] = {}

    @property
    def engine_ready(self) -> bool:
        """Whether this recall reads the engine (else FTS5)."""
        return self._view is not None

    def begin(self) -> None:
        """Fix the engine's view for one recall, and read the dirty keys' documents that
        changed since the last one (read transaction open)."""
        view = self._engine.view()
        self._view = view
        self._total = self._fts.counters()[0]
        self._held_counts = {}
        self._averages = {}
        if view is None:
            self._overlay.clear()
            return
        for key in [k for k in self._overlay if k not in view.dirty]:
            del self._overlay[key]
        stale = [k for k, g in view.dirty.items() if self._overlay.get(k, (None,))[0] != g]
        if not stale:
            return
        # A key no memory holds any more keeps None: its engine document is left out.
        self._overlay.update((key, (view.dirty[key], None)) for key in stale)
        for key, node_type, text, context in self._snapshot.of(stale):
            analysed = {
                "turn": self._analyzer.analyze(text),
                "context": self._analyzer.analyze(context),
                "pairs": (cjk_index_text(text) or "").split(),
            }
            self._overlay[key] = (
                view.dirty[key],
                _Document(
                    node_type,
                    {f: Counter(tokens) for f, tokens in analysed.items()},
                    {f: len(tokens) for f, tokens in analysed.items()},
                ),
            )

    def counters(self) -> tuple[int, int]:
        return self._fts.counters()

    def count(self, field: Field, word: str) -> int:
        view = self._view
        if view is None or field not in self._fields:
            return self._fts.count(field, word)
        tokens = self._terms([word], field)
        if not tokens:
            return 0
        # The engine's count with the dirty memories', which it may not count yet; it counts
        # deleted memories until it merges, so at most every memory stored.
        return min(self._count_term(field, token) for token in tokens)

    def top(
        self,
        field: Field,
        words: Sequence[str],
        depth: int,
        node_type: str | None,
        counts: Mapping[str, int] | None = None,
    ) -> dict[int, float]:
        view = self._view
        if view is None or field not in self._fields:
            return self._fts.top(field, words, depth, node_type, counts)
        terms = self._terms(words, field)
        if not terms:
            return {}
        query = self._matching(view, field, terms)
        if node_type is not None:
            query = _and(query, _filter(self._schema, "node_type", node_type))
        # More than asked, so that among equal scores the newest can be kept (the engine's own
        # order among ties is not that), and past the dirty keys it still holds.
        window = TIE_MARGIN * depth + len(view.dirty)
        found = self._search(view, query, window)
        scored = [(bm25, key) for key, bm25 in found.items() if key not in view.dirty]
        if len(found) >= window and scored:
            ranked = sorted((bm25 for bm25, _ in scored), reverse=True)
            if ranked[-1] >= ranked[min(depth, len(ranked)) - 1] * (1.0 - 1e-6):
                # More matches may tie with the last one kept than the window holds (words in
                # most memories weigh about nothing, so all their matches tie; a templated
                # bulk ties too), and the engine keeps the first it holds, not the newest: the
                # newest matches are scored too.
                hits = view.searcher.search(
                    query, window, count=False, order_by_field="seq", order=tantivy.Order.Desc
                ).hits
                newest = view.searcher.fast_field_values("seq", [address for _, address in hits])
                more = [
                    int(key)
                    for key in newest
                    if key is not None
                    and int(key) not in found
                    and int(key) not in view.dirty
                    and int(key) not in PROBE_KEYS
                ]
                scored += [(bm25, key) for key, bm25 in self.scores(field, words, more).items()]
        for key, document in self._dirty_documents(node_type):
            bm25 = self._bm25(view, field, terms, document)
            if bm25 > 0.0:
                scored.append((bm25, key))
        scored.sort(key=lambda pair: (-pair[0], -pair[1]))
        return {key: bm25 for bm25, key in scored[:depth]}

    def scores(self, field: Field, words: Sequence[str], seqs: Sequence[int]) -> dict[int, float]:
        view = self._view
        if view is None or field not in self._fields:
            return self._fts.scores(field, words, seqs)
        terms = self._terms(words, field)
        if not terms or not seqs:
            return {}
        clean = [seq for seq in seqs if seq not in view.dirty]
        out: dict[int, float] = {}
        if clean:
            query = _and(self._matching(view, field, terms), self._listed(clean))
            out = self._search(view, query, len(clean))
        for seq in seqs:
            entry = self._overlay.get(seq)
            if seq in view.dirty and entry is not None and entry[1] is not None:
                bm25 = self._bm25(view, field, terms, entry[1])
                if bm25 > 0.0:
                    out[seq] = bm25
        return out

    def held(self, words: Sequence[str], seqs: Sequence[int]) -> dict[int, int]:
        view = self._view
        if view is None:
            return self._fts.held(words, seqs)
        wanted = [(word, self._tokens_of(word)) for word in words]
        wanted = [(word, tokens) for word, tokens in wanted if tokens]
        if not wanted or not seqs:
            return {}
        clean = [seq for seq in seqs if seq not in view.dirty]
        out: dict[int, int] = {}
        if clean:
            # Each word held adds 1 to the score: the score is how many are held.
            one_each = [
                (
                    tantivy.Occur.Should,
                    tantivy.Query.const_score_query(_all_of(self._schema, "turn", tokens), 1.0),
                )
                for _, tokens in wanted
            ]
            query = tantivy.Query.boolean_query(
                [
                    (tantivy.Occur.Must, self._listed(clean)),
                    *one_each,
                ]
            )
            out = {
                key: round(score)
                for key, score in self._search(view, query, len(clean)).items()
                if round(score) > 0
            }
        for seq in seqs:
            entry = self._overlay.get(seq)
            if seq in view.dirty and entry is not None and entry[1] is not None:
                terms = entry[1].terms["turn"]
                count = sum(1 for _, tokens in wanted if all(terms[t] for t in tokens))
                if count:
                    out[seq] = count
        return out

    def holds(self, word: str, node_type: str | None) -> bool:
        view = self._view
        if view is None:
            return self._fts.holds(word, node_type)
        tokens = self._tokens_of(word)
        if not tokens:
            return False
        query = _all_of(self._schema, "turn", tokens)
        if node_type is not None:
            query = _and(query, _filter(self._schema, "node_type", node_type))
        found = self._search(view, query, 1 + len(view.dirty))
        if any(key not in view.dirty for key in found):
            return True
        return any(
            all(document.terms["turn"][t] for t in tokens)
            for _, document in self._dirty_documents(node_type)
        )

    def _search(self, view: WordView, query: tantivy.Query, limit: int) -> dict[int, float]:
        """The best ``limit`` matches of ``query``: key -> score."""
        if limit <= 0:
            return {}
        hits = view.searcher.search(query, limit, count=False).hits
        keys = view.searcher.fast_field_values("seq", [address for _, address in hits])
        return {
            int(key): float(score)
            for (score, _), key in zip(hits, keys, strict=True)
            if key is not None and int(key) not in PROBE_KEYS
        }

    def _listed(self, keys: Sequence[int]) -> tantivy.Query:
        """The documents of ``keys``, adding nothing to the score (one term query each: a
        term-set query on the keys costs three times as much)."""
        schema = self._schema
        return tantivy.Query.const_score_query(
            tantivy.Query.boolean_query(
                [(tantivy.Occur.Should, tantivy.Query.term_query(schema, "seq", k)) for k in keys]
            ),
            0.0,
        )

    def _matching(self, view: WordView, field: Field, terms: list[str]) -> tantivy.Query:
        """Documents holding any of ``terms`` in ``field``, scored by BM25 with FTS5's IDF:
        each word's part of the engine's score is scaled by FTS5's IDF over the engine's
        (module docstring)."""
        searcher = view.searcher
        clauses = []
        for term in terms:
            held = searcher.doc_freq(field, term)
            query = tantivy.Query.term_query(self._schema, field, term)
            boost = self._idf(field, term) / tantivy_idf(view.total, held)
            clauses.append((tantivy.Occur.Should, tantivy.Query.boost_query(query, boost)))
        return tantivy.Query.boolean_query(clauses)

    def _bm25(self, view: WordView, field: Field, terms: list[str], document: _Document) -> float:
        """The BM25 of a dirty memory's ``field`` for ``terms``, as the engine would score it."""
        counts = document.terms[field]
        if not any(counts[term] for term in terms):
            return 0.0
        average = self._average_of(view, field)
        norm = K1 * (1.0 - B + B * bucketed(document.lengths[field]) / average)
        score = 0.0
        for term in terms:
            tf = counts[term]
            if tf:
                score += self._idf(field, term) * (K1 + 1.0) * tf / (tf + norm)
        return score

    def _idf(self, field: Field, term: str) -> float:
        """FTS5's IDF of ``term`` in ``field`` over the recall's snapshot: its memories, and
        those holding the term (the engine's count with the dirty memories', at most all)."""
        held = self._count_term(field, term)
        return fts5_idf(self._total, held)

    def _count_term(self, field: Field, term: str) -> int:
        assert self._view is not None
        key = (field, term)
        held = self._held_counts.get(key)
        if held is None:
            probes = len(PROBES) if term == PROBE_WORD else 0
            held = (
                self._view.searcher.doc_freq(field, term)
                - probes
                + sum(1 for document in self._documents() if document.terms[field][term])
            )
            held = self._held_counts[key] = min(held, self._total)
        return held

    def _average_of(self, view: WordView, field: Field) -> float:
        """The average length of ``field`` over the engine's documents and the dirty ones
        (the engine's own when few are dirty; theirs when it was built on an empty store)."""
        if field not in self._averages:
            lengths = [document.lengths[field] for document in self._documents()]
            held = view.total if field in view.average else 0
            tokens = view.average.get(field, 0.0) * held + sum(lengths)
            count = held + len(lengths)
            self._averages[field] = max(1.0, tokens / count) if count else 1.0
        return self._averages[field]

    def _documents(self) -> list[_Document]:
        return [document for _, document in self._overlay.values() if document is not None]

    def _dirty_documents(self, node_type: str | None) -> list[tuple[int, _Document]]:
        return [
            (key, document)
            for key, (_, document) in self._overlay.items()
            if document is not None and (node_type is None or document.node_type == node_type)
        ]

    def _tokens_of(self, word: str) -> list[str]:
        tokens = self._tokens.get(word)
        if tokens is None:
            if len(self._tokens) > 10_000:
                self._tokens.clear()
            tokens = self._tokens[word] = self._analyzer.analyze(word)
        return tokens

    def _terms(self, words: Sequence[str], field: Field = "turn") -> list[str]:
        """The distinct tokens of ``words`` in ``field`` (character pairs are their own)."""
        if field == "pairs":
            return list(dict.fromkeys(words))
        return list(dict.fromkeys(token for word in words for token in self._tokens_of(word)))


def _and(query: tantivy.Query, other: tantivy.Query) -> tantivy.Query:
    return tantivy.Query.boolean_query([(tantivy.Occur.Must, query), (tantivy.Occur.Must, other)])


def _filter(schema: tantivy.Schema, field: str, value: str) -> tantivy.Query:
    """Documents whose ``field`` is ``value``, adding nothing to the score."""
    return tantivy.Query.const_score_query(tantivy.Query.term_query(schema, field, value), 0.0)


def _all_of(schema: tantivy.Schema, field: str, tokens: list[str]) -> tantivy.Query:
    if len(tokens) == 1:
        return tantivy.Query.term_query(schema, field, tokens[0])
    return tantivy.Query.boolean_query(
        [(tantivy.Occur.Must, tantivy.Query.term_query(schema, field, t)) for t in tokens]
    )
