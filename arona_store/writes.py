"""The write path: nodes checked and turned into rows, keys chosen, identical nodes refreshed.

Repeated memories. A write with ``refresh=True`` (what the wire server does for every
``Sync.MemoryStoreRequest``) that is identical to a stored node (same text, type, source,
related ids and properties) does not add a copy: that node moves to the new time, keeping its
id. Saying the same thing twice is then one memory, recent again, instead of copies that all
rank alike and crowd every other memory out of a recall (and that each recall would have to
read). Identical nodes are found through a 16-byte digest of those fields, indexed.

A node's key is its time (:mod:`arona_store.nodes`); a collision takes the next free integer.
Everything here runs on the store's writer connection, behind its lock.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterable

from arona_common.database import LogInUse, sqlite_erase
from arona_store import context
from arona_store.cjk import INSERT_CJK, cjk_index_text
from arona_store.nodes import NewNode, Row, StoreError, Timestamp, digest, epoch, key_of
from arona_store.schema import BUSY_TIMEOUT_MS, FULL_TEXT_INDEXES, INSERT

_PUT_VECTOR = "INSERT OR IGNORE INTO vectors (node_id, vec) VALUES (?, ?)"
# The same for a node read earlier, which may have been deleted since.
FILL_VECTOR = "INSERT OR IGNORE INTO vectors (node_id, vec) SELECT id, ? FROM nodes WHERE id = ?"
# Nodes without a vector, newest first, below a key (the background fill's cursor).
UNEMBEDDED = (
    "SELECT n.seq, n.id, n.text FROM nodes n WHERE n.seq < ?"
    " AND NOT EXISTS (SELECT 1 FROM vectors v WHERE v.node_id = n.id)"
    " ORDER BY n.seq DESC LIMIT ?"
)
UNEMBEDDED_COUNT = (
    "SELECT count(*) FROM nodes n WHERE NOT EXISTS (SELECT 1 FROM vectors v WHERE v.node_id = n.id)"
)

_MOVE = "UPDATE nodes SET seq = ?, created_at = ? WHERE seq = ?"
# A stored node identical to a new one (the digest narrows, the fields decide).
_TWIN = (
    "SELECT seq, id FROM nodes WHERE digest = ? AND node_type = ? AND text = ?"
    " AND source_episode_id IS ? AND related_node_ids = ? AND properties = ?"
    " ORDER BY seq DESC LIMIT 1"
)
# Of some nodes (by id), those still stored without a vector, with their text.
_UNEMBEDDED_OF = (
    "SELECT n.id, n.text FROM nodes n WHERE n.id IN ({marks})"
    " AND NOT EXISTS (SELECT 1 FROM vectors v WHERE v.node_id = n.id)"
)
_NODE_OF_ID = "SELECT seq, node_type FROM nodes WHERE id = ?"
# The taken keys from a candidate upwards, to find the first free one.
_KEYS_FROM = "SELECT seq FROM nodes WHERE seq >= ? ORDER BY seq"

NodeItem = NewNode | tuple[str, str] | tuple[str, str, Timestamp | None]


def rows_of(nodes: Iterable[NodeItem]) -> tuple[list[Row], list[bytes | None]]:
    """The rows to insert for ``nodes`` (checked: :class:`StoreError` for a bad one) and the
    vectors they came with."""
    rows: list[Row] = []
    vectors: list[bytes | None] = []
    for item in nodes:
        node = item if isinstance(item, NewNode) else NewNode(*item)
        if not isinstance(node.text, str) or not node.text.strip():
            raise StoreError("text must be a non-empty string")
        if not isinstance(node.node_type, str) or not node.node_type:
            raise StoreError("node_type must be a non-empty string")
        created_at = epoch(node.created_at)
        related = json.dumps(list(node.related_node_ids))
        properties = json.dumps(dict(node.properties), sort_keys=True)
        rows.append(
            (
                key_of(created_at),
                str(uuid.uuid4()),
                node.node_type,
                node.text,
                created_at,
                node.source_episode_id,
                related,
                properties,
                digest(node.node_type, node.text, node.source_episode_id, related, properties),
            )
        )
        vectors.append(node.vector)
    return rows, vectors


def write_rows(
    conn: sqlite3.Connection, rows: list[Row], vectors: list[bytes | None], refresh: bool
) -> list[str]:
    """Insert ``rows`` (write transaction open), or with ``refresh`` move their identical
    stored nodes to their time; their ids, in order."""
    ids: list[str] = []
    # Nodes whose context documents change (arona_store.context), written once at the end.
    touched: context.Touched = set()
    # Where to resume probing for each wanted key, so a batch sharing one
    # timestamp does not walk the same run of taken keys again for every node.
    resume: dict[int, int] = {}
    for row, vector in zip(rows, vectors, strict=True):
        wanted = row[0]
        node_type = row[2]
        twin = _twin(conn, row) if refresh else None
        if vector is not None:
            # A twin keeps its vector (same text) or gets this one if it had none.
            conn.execute(_PUT_VECTOR, (row[1] if twin is None else twin[1], vector))
        if twin is not None:
            twin_seq, twin_id = twin
            ids.append(twin_id)
            if twin_seq >= wanted:
                continue  # already at least that recent
            key = _free_key(conn, resume.get(wanted, wanted))
            resume[wanted] = key + 1
            # Its old neighbours lose it from their context, its new ones gain it.
            context.touch(conn, touched, node_type, twin_seq)
            # Moved, not deleted and added: no word count changes.
            conn.execute(_MOVE, (key, row[4], twin_seq))
            context.touch(conn, touched, node_type, key)
            continue
        ids.append(row[1])
        key = _free_key(conn, resume.get(wanted, wanted))
        resume[wanted] = key + 1
        conn.execute(INSERT, (key, *row[1:]))
        grams = cjk_index_text(row[3])
        if grams is not None:
            conn.execute(INSERT_CJK, (key, grams))
        context.touch(conn, touched, node_type, key)
    context.refresh(conn, touched)
    return ids


def unembedded_of(conn: sqlite3.Connection, ids: list[str]) -> list[tuple[str, str]]:
    """Of the nodes ``ids``, those stored without a vector, as (id, text)."""
    if not ids:
        return []
    sql = _UNEMBEDDED_OF.format(marks=", ".join("?" * len(ids)))
    return [(str(node_id), str(text)) for node_id, text in conn.execute(sql, ids)]


def delete_node(conn: sqlite3.Connection, node_id: str) -> bool:
    """Delete a node and write its neighbours' context documents again (write transaction
    open); True if it existed."""
    row = conn.execute(_NODE_OF_ID, (node_id,)).fetchone()
    if row is None:
        return False
    seq, node_type = int(row[0]), str(row[1])
    touched: context.Touched = set()
    context.touch(conn, touched, node_type, seq)
    conn.execute("DELETE FROM nodes WHERE seq = ?", (seq,))
    context.refresh(conn, touched)
    return True


def erase_deleted(conn: sqlite3.Connection) -> None:
    """Leave no trace of deleted nodes in the database's files (no transaction open).

    A delete takes a node's row, vector and index entries out of the database, but FTS5 only
    marks a deleted document's words as gone: the segment that holds them keeps them until it
    is merged, and the write-ahead log keeps the pages written until it is reset. So every
    full-text index is merged into one segment (``optimize``; the connection zeroes the pages
    it frees, ``PRAGMA secure_delete``), and the log is copied into the database and truncated
    (:func:`~arona_common.database.sqlite_erase`, which waits a little for a reader to finish).
    :class:`StoreError` if a reader kept the log from being reset (the next delete tries again).
    """
    for index in FULL_TEXT_INDEXES:
        conn.execute(f"INSERT INTO {index}({index}) VALUES ('optimize')")
    try:
        sqlite_erase(conn)
    except LogInUse:
        raise StoreError("deleted, but the write-ahead log is still in use: delete again") from None


def begin_write(conn: sqlite3.Connection, wait: bool) -> bool:
    """Open a write transaction (lock held); False if ``wait`` is off and another
    connection holds the database's write lock."""
    if wait:
        conn.execute("BEGIN IMMEDIATE")
        return True
    conn.execute("PRAGMA busy_timeout=0")
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as err:
        if err.sqlite_errorcode != sqlite3.SQLITE_BUSY:
            raise
        return False
    finally:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return True


def _twin(conn: sqlite3.Connection, row: Row) -> tuple[int, str] | None:
    """The newest stored node identical to ``row``, as (seq, id) (lock held)."""
    _, _, node_type, text, _, source, related, properties, row_digest = row
    found = conn.execute(
        _TWIN, (row_digest, node_type, text, source, related, properties)
    ).fetchone()
    return None if found is None else (int(found[0]), str(found[1]))


def _free_key(conn: sqlite3.Connection, key: int) -> int:
    """The first key at or after ``key`` that no node holds (lock held)."""
    cursor = conn.execute(_KEYS_FROM, (key,))
    try:
        for (taken,) in cursor:
            if taken != key:
                break
            key += 1
    finally:
        cursor.close()
    return key
