"""The store's retrieval boundary: what walks the whole store, behind two small interfaces.

A recall ranks a bounded set of candidates in Python (:mod:`arona_store.lexical`,
:mod:`arona_store.hybrid`, :mod:`arona_store.floor`); everything that reads more than those
candidates runs in an engine made for it, behind these interfaces, read in one snapshot of the
store:

- :class:`WordIndex`: which memories hold a question's words, and how strongly (BM25), in each
  of three fields: a memory's own text (``turn``), its context document (``context``:
  :mod:`arona_store.context`) and its Chinese, Japanese and Korean character pairs
  (``pairs``: :mod:`arona_store.cjk`);
- :class:`NodeTable`: the memories themselves (their ids and texts by key, and the neighbours
  of each in its node type, which make up its context);
- :class:`VectorSearch`: the memories nearest a question in meaning (the ``hybrid`` ranking).

Words are given as the question has them (:func:`arona_store.words.query_terms`); an engine
folds and stems them as its index does. Keys (``seq``) are the nodes' time-ordered keys
(:mod:`arona_store.nodes`), the same in every engine. :mod:`arona_store.retrieval.fts5` is the
word index over the store's SQLite file, :mod:`arona_store.retrieval.engine_words` the word
engine's (FTS5's until it is built), :mod:`arona_store.retrieval.resident` the node table held in
memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from arona_store.vectors import Vector

# The indexed fields of a memory.
Field = Literal["turn", "context", "pairs"]


class WordIndex(Protocol):
    """The words of the stored memories, as one recall's snapshot holds them."""

    def counters(self) -> tuple[int, int]:
        """How many memories are stored, and a count of the changes ever made (inserts and
        deletes: each moves a word's document count by at most one)."""
        ...

    def count(self, field: Field, word: str) -> int:
        """How many documents of ``field`` hold ``word`` now."""
        ...

    def top(
        self,
        field: Field,
        words: Sequence[str],
        depth: int,
        node_type: str | None,
        counts: Mapping[str, int] | None = None,
    ) -> dict[int, float]:
        """The best ``depth`` matches of any of ``words`` in ``field`` (of ``node_type`` only
        when given), key -> positive BM25. ``counts``, when known: how many memories hold
        each of the question's words in their own text; an engine that ranks only some of
        the matches uses them to propose the matches of the rare words too (BM25 -1: not
        computed), so an old memory holding one is never cut off."""
        ...

    def scores(self, field: Field, words: Sequence[str], seqs: Sequence[int]) -> dict[int, float]:
        """The positive BM25 in ``field`` of those of ``seqs`` that hold any of ``words``."""
        ...

    def held(self, words: Sequence[str], seqs: Sequence[int]) -> dict[int, int]:
        """How many of ``words`` each of ``seqs`` holds in its own text (``turn``)."""
        ...

    def holds(self, word: str, node_type: str | None) -> bool:
        """Whether any memory (of ``node_type`` when given) holds ``word`` in its own text."""
        ...


class NodeTable(Protocol):
    """The stored memories by key, as one recall's snapshot holds them."""

    def ids(self, seqs: Sequence[int]) -> dict[int, str]:
        """The node id of each of ``seqs`` still stored."""
        ...

    def texts(self, seqs: Sequence[int]) -> dict[int, str]:
        """The text of each of ``seqs`` still stored."""
        ...

    def key_of(self, node_id: str) -> int | None:
        """The key of the node ``node_id``; None when none is stored."""
        ...

    def neighbours(self, seqs: Sequence[int]) -> dict[int, list[int]]:
        """The keys of each of ``seqs``' neighbours in its node type, nearest first on each
        side (:mod:`arona_store.context`); a key no node holds has none."""
        ...


class VectorSearch(Protocol):
    """The stored vectors, as one recall's snapshot holds them (or more: a node the search
    names may have been deleted since; the caller checks it against its node table)."""

    def top_nodes(
        self, query: Vector, k: int, node_type: str | None = None
    ) -> list[tuple[float, str]]:
        """The ``k`` nodes (of ``node_type`` only, when given) whose vectors are nearest
        ``query``, as (cosine, node id), best first."""
        ...

    def cosines(self, query: Vector, node_ids: list[str]) -> list[float | None]:
        """The cosine of ``query`` with the vector of each of ``node_ids`` (None for a node
        without one)."""
        ...
