"""A memory's context: the memories stored around it, indexed with it.

A turn of a conversation rarely says everything a question about it asks: "I went yesterday,
it was so powerful" answers "When did Caroline go to the support group?" because the turn
before named the group. So each node also has a **context document**: its own text and the
texts of the :data:`BEFORE` nodes before it and the :data:`AFTER` nodes after it **of the same
node type** (a scope's episodes are one node type, ``episode:<scope id>``, so one user's
context never holds another's), in key order, which is time order. The documents live in a
third FTS5 index, ``nodes_ctx`` (rowid = the node's key), and a recall scores a node by the BM25
of its own text **and** of its context (:mod:`arona_store.lexical`).

The documents are kept exact by the write path: a node written, moved (an identical node
stored again) or deleted changes the documents of its neighbours, which are written again in
the same transaction (:func:`refresh`), so a deleted memory's words leave every document too.
A node's document is written once its neighbours are known, so a turn written after it updates
the documents of the :data:`AFTER` turns before it.

Measured on LoCoMo (``bench/recall_locomo.py``, ``arona_store/RANKING.md``): two turns on
each side, weighted :data:`~arona_store.scoring.CONTEXT_WEIGHT` times the turn's own BM25,
lifts words-only recall R@5 from 52.5 to about 64.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable

# Neighbours of the same node type in a node's context document, on each side.
BEFORE = 2
AFTER = 2

_BEFORE = "SELECT seq, text FROM nodes WHERE node_type = ? AND seq < ? ORDER BY seq DESC LIMIT ?"
_AFTER = "SELECT seq, text FROM nodes WHERE node_type = ? AND seq > ? ORDER BY seq LIMIT ?"
_NODE = "SELECT node_type, text FROM nodes WHERE seq = ?"
_DROP = "DELETE FROM nodes_ctx WHERE rowid = ?"
_PUT = "INSERT INTO nodes_ctx (rowid, text) VALUES (?, ?)"

# The neighbours of several nodes in one statement (a JSON list of keys; prepared once): each
# node's key and its neighbours' keys, nearest first on each side.
_NEIGHBOURS_OF = (
    "SELECT n.seq,"
    " (SELECT group_concat(b.seq) FROM (SELECT seq FROM nodes WHERE node_type = n.node_type"
    " AND seq < n.seq ORDER BY seq DESC LIMIT ?) b),"
    " (SELECT group_concat(a.seq) FROM (SELECT seq FROM nodes WHERE node_type = n.node_type"
    " AND seq > n.seq ORDER BY seq LIMIT ?) a)"
    " FROM nodes n WHERE n.seq IN (SELECT value FROM json_each(?))"
)

Touched = set[tuple[str, int]]


def neighbours(conn: sqlite3.Connection, node_type: str, seq: int) -> list[int]:
    """The keys of the nodes whose context holds the node at ``seq`` (its neighbours)."""
    before = conn.execute(_BEFORE, (node_type, seq, AFTER)).fetchall()
    after = conn.execute(_AFTER, (node_type, seq, BEFORE)).fetchall()
    return [s for s, _ in before] + [s for s, _ in after]


def neighbours_many(conn: sqlite3.Connection, seqs: list[int]) -> dict[int, list[int]]:
    """:func:`neighbours` of each of ``seqs`` that a node holds, in one statement."""
    out: dict[int, list[int]] = {}
    for seq, before, after in conn.execute(_NEIGHBOURS_OF, (AFTER, BEFORE, json.dumps(seqs))):
        keys = [int(k) for k in before.split(",")] if before else []
        keys += [int(k) for k in after.split(",")] if after else []
        out[int(seq)] = keys
    return out


def touch(conn: sqlite3.Connection, touched: Touched, node_type: str, seq: int) -> None:
    """Note that the node at ``seq`` and its neighbours need their documents written again."""
    touched.add((node_type, seq))
    touched.update((node_type, s) for s in neighbours(conn, node_type, seq))


def document(conn: sqlite3.Connection, node_type: str, seq: int, text: str) -> str:
    """The context document of the node at ``seq`` as the database holds it now."""
    before = conn.execute(_BEFORE, (node_type, seq, BEFORE)).fetchall()
    after = conn.execute(_AFTER, (node_type, seq, AFTER)).fetchall()
    return "\n".join([t for _, t in reversed(before)] + [text] + [t for _, t in after])


def refresh(conn: sqlite3.Connection, touched: Iterable[tuple[str, int]]) -> None:
    """Write the documents of the ``touched`` nodes again (write transaction open); a key no
    node holds any more (moved or deleted meanwhile) is only dropped."""
    for node_type, seq in sorted(set(touched)):
        conn.execute(_DROP, (seq,))
        row = conn.execute(_NODE, (seq,)).fetchone()
        if row is None or row[0] != node_type:
            continue
        conn.execute(_PUT, (seq, document(conn, node_type, seq, row[1])))


def index_all(conn: sqlite3.Connection) -> int:
    """Write every node's document (transaction open; an upgrade or a repair); how many."""
    conn.execute("DELETE FROM nodes_ctx")
    rows = conn.execute("SELECT node_type, seq, text FROM nodes ORDER BY node_type, seq").fetchall()
    count = 0
    start = 0
    while start < len(rows):
        end = start
        while end < len(rows) and rows[end][0] == rows[start][0]:
            end += 1
        texts = [text for _, _, text in rows[start:end]]
        for i in range(end - start):
            window = texts[max(0, i - BEFORE) : i + AFTER + 1]
            conn.execute(_PUT, (rows[start + i][1], "\n".join(window)))
            count += 1
        start = end
    return count
