"""The word index over the store's SQLite file: its FTS5 indexes.

Three FTS5 indexes hold the fields (:mod:`arona_store.schema`): ``nodes_fts`` a memory's own
text (``turn``), ``nodes_ctx`` its context document (``context``), ``nodes_cjk`` its character
pairs (``pairs``), each keyed by the node's key, porter-stemmed where words are. The best
matches of a field are ranked by SQLite in C over the newest :data:`MAX_SCAN_ROWS` matches
(:data:`CONTEXT_SCAN_ROWS` context documents): the most any recall ranks, whatever the store's
size. On a large store the words held by at most :data:`RARE_DOCS` nodes are also looked up on
their own when the question's words hold more nodes than that, so a memory sharing a rare word
with the question is never missed because it is old.

Every method runs in the caller's read transaction (the store's reader, under its read lock).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence

from arona_store.retrieval import Field
from arona_store.schema import COUNTERS
from arona_store.words import fts_expression

# Most matches of one index one query reads (the newest). Each costs FTS5 about 1.3 µs of
# bm25(), so 4,000 cost 5 ms; LoCoMo's conversations written before 100,000 benchmark episodes
# (python -m bench.recall_locomo --buried) lose nothing from 4,000 to 2,000 (R@10 71.7 -> 72.2
# hybrid, 68.8 -> 69.4 lexical: fewer of the newer memories compete) and lose at 1,000 (71.1).
MAX_SCAN_ROWS = 2000
# The same for the context documents, each of which holds 1 + BEFORE + AFTER memories: a word
# matches that many times more documents there, each longer.
CONTEXT_SCAN_ROWS = 1000
# A word held by at most this many nodes is also matched on its own on a large store.
RARE_DOCS = 1000

INDEX_OF: dict[Field, str] = {"turn": "nodes_fts", "context": "nodes_ctx", "pairs": "nodes_cjk"}
_HELD = "SELECT 1 FROM nodes_fts WHERE nodes_fts MATCH ? LIMIT 1"
_HELD_OF_TYPE = (
    "SELECT 1 FROM nodes_fts JOIN nodes ON nodes.seq = nodes_fts.rowid"
    " WHERE nodes_fts MATCH ? AND nodes.node_type = ? LIMIT 1"
)


def _top_sql(index: str, of_type: bool) -> str:
    """The best matches (rowid, bm25) among the newest ``:cap``, best first."""
    join = f" JOIN nodes ON nodes.seq = {index}.rowid" if of_type else ""
    where = " AND nodes.node_type = :node_type" if of_type else ""
    return (
        f"SELECT rowid, b FROM (SELECT {index}.rowid AS rowid, bm25({index}) AS b FROM {index}"
        f"{join} WHERE {index} MATCH :expr{where} ORDER BY {index}.rowid DESC LIMIT :cap)"
        " ORDER BY b, rowid DESC LIMIT :n"
    )


# The BM25 of listed rows: the range lets FTS5 skip the matches outside it.
_BM25S = {
    index: f"SELECT rowid, bm25({index}) FROM {index} WHERE {index} MATCH ?"
    " AND rowid BETWEEN ? AND ? AND +rowid IN (SELECT value FROM json_each(?))"
    for index in INDEX_OF.values()
}
_TOP = {
    (index, of_type): _top_sql(index, of_type)
    for index in INDEX_OF.values()
    for of_type in (False, True)
}
_COUNT = {
    index: f"SELECT count(*) FROM {index} WHERE {index} MATCH ?" for index in INDEX_OF.values()
}


class Fts5Words:
    """:class:`~arona_store.retrieval.WordIndex` over the FTS5 indexes of one connection."""

    def __init__(self, reader: sqlite3.Connection) -> None:
        self._reader = reader

    def counters(self) -> tuple[int, int]:
        total, changes, _, _ = self._reader.execute(COUNTERS).fetchone()
        return int(total), int(changes)

    def count(self, field: Field, word: str) -> int:
        return int(self._reader.execute(_COUNT[INDEX_OF[field]], (f'"{word}"',)).fetchone()[0])

    def top(
        self,
        field: Field,
        words: Sequence[str],
        depth: int,
        node_type: str | None,
        counts: Mapping[str, int] | None = None,
    ) -> dict[int, float]:
        expression = fts_expression(words)
        if expression is None:
            return {}
        found = self._top(INDEX_OF[field], expression, depth, node_type)
        extra = fts_expression(_rare(counts or {}))
        if extra is not None:
            # The newest matches may not reach an old memory holding a rare word.
            for seq in self._top(INDEX_OF[field], extra, depth, node_type):
                found.setdefault(seq, -1.0)
        return found

    def scores(self, field: Field, words: Sequence[str], seqs: Sequence[int]) -> dict[int, float]:
        """``+rowid`` keeps the list away from FTS5: given ``rowid IN (...)``, SQLite runs the
        full-text query once per listed row, and ``bm25()`` counts every match of every word
        again each time (40 rows: 3-6 ms at 10,000 nodes, 15-36 ms at 100,000). So FTS5 walks
        the matches once and SQLite keeps the listed ones: the same scores, 0.2-0.5 and
        2-3.5 ms. The walk is bounded by the lowest and highest key listed (FTS5 seeks to
        them), so a list of recent memories does not read the old matches."""
        expression = fts_expression(words)
        if not seqs or expression is None:
            return {}
        return {
            int(seq): max(0.0, -float(bm25))
            for seq, bm25 in self._reader.execute(
                _BM25S[INDEX_OF[field]], (expression, min(seqs), max(seqs), json.dumps(seqs))
            )
        }

    def held(self, words: Sequence[str], seqs: Sequence[int]) -> dict[int, int]:
        """One walk of each word's matches (``+rowid``: see :meth:`scores`), no BM25."""
        held: dict[int, int] = {}
        marks = ", ".join("?" * len(seqs))
        for word in words:
            for (seq,) in self._reader.execute(
                f"SELECT rowid FROM nodes_fts WHERE nodes_fts MATCH ? AND +rowid IN ({marks})",
                [f'"{word}"', *seqs],
            ):
                held[int(seq)] = held.get(int(seq), 0) + 1
        return held

    def holds(self, word: str, node_type: str | None) -> bool:
        phrase = f'"{word}"'
        if node_type is None:
            row = self._reader.execute(_HELD, (phrase,)).fetchone()
        else:
            row = self._reader.execute(_HELD_OF_TYPE, (phrase, node_type)).fetchone()
        return row is not None

    def _top(
        self, index: str, expression: str, depth: int, node_type: str | None
    ) -> dict[int, float]:
        """The best ``depth`` matches of ``index`` among its newest, key -> positive BM25."""
        cap = CONTEXT_SCAN_ROWS if index == "nodes_ctx" else MAX_SCAN_ROWS
        params: dict[str, object] = {"expr": expression, "cap": cap, "n": depth}
        if node_type is not None:
            params["node_type"] = node_type
        sql = _TOP[(index, node_type is not None)]
        return {int(seq): max(0.0, -float(b)) for seq, b in self._reader.execute(sql, params)}


def _rare(words: Mapping[str, int]) -> list[str]:
    """Of ``words`` (word -> the memories holding it), those :meth:`Fts5Words.top` also
    matches on their own: on a store where the words together hold more memories than one
    walk reads, the rare ones, if some are not."""
    rare = [word for word, docs in words.items() if docs <= RARE_DOCS]
    if sum(words.values()) > MAX_SCAN_ROWS and rare and len(rare) < len(words):
        return rare
    return []
