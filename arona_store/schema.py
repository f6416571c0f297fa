"""The store's SQLite schema and its migrations.

``nodes`` holds the memories; ``nodes_fts`` is an FTS5 external-content index over their text
(porter stemming), ``nodes_cjk`` the character pairs of their Chinese, Japanese and Korean
text (:mod:`arona_store.cjk`), both kept in sync by triggers. ``counters`` holds the node
count, a count of changes, the highest key and a count of writes below it, kept by triggers,
so a recall reads them in the same snapshot as the nodes and writes by any other process are
counted too. A hybrid store adds ``vectors`` and ``vector_model``.

``nodes_ctx`` holds each node's context document (:mod:`arona_store.context`), written by the
write path; triggers drop a node's own document when it is deleted, moved or changed.

``PRAGMA user_version`` is the schema's version: 1 had insertion-ordered keys, 2 no digests, 3
no character-pair index, 4 no context index; an older database is brought up to date once, in
one transaction, when opened.
"""

from __future__ import annotations

import logging
import math
import sqlite3

from arona_store import context
from arona_store.cjk import INSERT_CJK, cjk_index_text
from arona_store.nodes import KEY_SCALE, MAX_ABS_EPOCH_S, digest

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 5
# How long a connection waits for another one's write lock before giving up.
BUSY_TIMEOUT_MS = 5000

_TABLES = """
CREATE TABLE IF NOT EXISTS nodes (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    node_type TEXT NOT NULL,
    text TEXT NOT NULL,
    created_at REAL NOT NULL,
    source_episode_id TEXT,
    related_node_ids TEXT NOT NULL DEFAULT '[]',
    properties TEXT NOT NULL DEFAULT '{}',
    digest BLOB
);
CREATE INDEX IF NOT EXISTS nodes_digest ON nodes(digest);
CREATE VIRTUAL TABLE IF NOT EXISTS nodes_fts USING fts5(
    text,
    content='nodes',
    content_rowid='seq',
    tokenize='porter unicode61 remove_diacritics 2'
);
CREATE TRIGGER IF NOT EXISTS nodes_ai AFTER INSERT ON nodes BEGIN
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
END;
CREATE TRIGGER IF NOT EXISTS nodes_ad AFTER DELETE ON nodes BEGIN
    INSERT INTO nodes_fts(nodes_fts, rowid, text) VALUES ('delete', old.seq, old.text);
END;
CREATE TRIGGER IF NOT EXISTS nodes_au AFTER UPDATE OF text ON nodes BEGIN
    INSERT INTO nodes_fts(nodes_fts, rowid, text) VALUES ('delete', old.seq, old.text);
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
END;
CREATE TABLE IF NOT EXISTS counters (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    nodes INTEGER NOT NULL,
    changes INTEGER NOT NULL,
    hi INTEGER NOT NULL,
    backdated INTEGER NOT NULL
);
INSERT OR IGNORE INTO counters (id, nodes, changes, hi, backdated)
    SELECT 1, count(*), 0, coalesce(max(seq), -9223372036854775808), 0 FROM nodes;
CREATE TRIGGER IF NOT EXISTS counters_ai AFTER INSERT ON nodes BEGIN
    UPDATE counters SET nodes = nodes + 1, changes = changes + 1,
        backdated = backdated + (new.seq < hi), hi = max(hi, new.seq) WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS counters_ad AFTER DELETE ON nodes BEGIN
    UPDATE counters SET nodes = nodes - 1, changes = changes + 1 WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS counters_au AFTER UPDATE OF text ON nodes BEGIN
    UPDATE counters SET changes = changes + 2, backdated = backdated + 1 WHERE id = 1;
END;
CREATE VIRTUAL TABLE IF NOT EXISTS nodes_cjk USING fts5(grams, tokenize='unicode61');
CREATE TRIGGER IF NOT EXISTS nodes_cjk_ad AFTER DELETE ON nodes BEGIN
    DELETE FROM nodes_cjk WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_cjk_au AFTER UPDATE OF text ON nodes BEGIN
    DELETE FROM nodes_cjk WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_cjk_moved AFTER UPDATE OF seq ON nodes BEGIN
    UPDATE nodes_cjk SET rowid = new.seq WHERE rowid = old.seq;
END;
CREATE INDEX IF NOT EXISTS nodes_type_seq ON nodes(node_type, seq);
CREATE VIRTUAL TABLE IF NOT EXISTS nodes_ctx USING fts5(
    text,
    tokenize='porter unicode61 remove_diacritics 2'
);
CREATE TRIGGER IF NOT EXISTS nodes_ctx_ad AFTER DELETE ON nodes BEGIN
    DELETE FROM nodes_ctx WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_ctx_au AFTER UPDATE OF text ON nodes BEGIN
    DELETE FROM nodes_ctx WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_ctx_moved AFTER UPDATE OF seq ON nodes BEGIN
    DELETE FROM nodes_ctx WHERE rowid = old.seq;
END;
CREATE TRIGGER IF NOT EXISTS nodes_moved AFTER UPDATE OF seq ON nodes
WHEN new.text = old.text BEGIN
    INSERT INTO nodes_fts(nodes_fts, rowid, text) VALUES ('delete', old.seq, old.text);
    INSERT INTO nodes_fts(rowid, text) VALUES (new.seq, new.text);
    UPDATE counters SET backdated = backdated + (new.seq < hi), hi = max(hi, new.seq)
        WHERE id = 1;
END;
"""

# The node vectors of the hybrid ranking (created by a hybrid store; harmless to a lexical
# one). AUTOINCREMENT: a vid is never reused, so the in-memory index can follow the table by
# vid alone (arona_store.vectors).
_VECTOR_TABLES = """
CREATE TABLE IF NOT EXISTS vectors (
    vid INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL UNIQUE,
    vec BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS vector_model (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    model TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS vectors_node_deleted AFTER DELETE ON nodes BEGIN
    DELETE FROM vectors WHERE node_id = old.id;
END;
CREATE TRIGGER IF NOT EXISTS vectors_text_changed AFTER UPDATE OF text ON nodes BEGIN
    DELETE FROM vectors WHERE node_id = old.id;
END;
"""

COLUMNS = "id, node_type, text, created_at, source_episode_id, related_node_ids, properties"
INSERT = f"INSERT INTO nodes (seq, {COLUMNS}, digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
# The counters, read in a recall's snapshot.
COUNTERS = "SELECT nodes, changes, hi, backdated FROM counters WHERE id = 1"
# The FTS5 indexes: each node's own words, its context document's, its CJK character pairs.
FULL_TEXT_INDEXES = ("nodes_fts", "nodes_ctx", "nodes_cjk")


def prepare_schema(conn: sqlite3.Connection) -> None:
    """Create the tables, or bring an older database up to date (once, in one transaction):
    version 1 had insertion-ordered keys, version 2 no digests, version 3 no character-pair
    index, version 4 no context index."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version >= SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'nodes'"
        ).fetchone()
        if exists is not None and version < 2:
            _rekey(conn)
        elif exists is not None and version < 3:
            _add_digests(conn)
        for statement in _split_script(_TABLES):
            conn.execute(statement)
        if exists is not None and version < 4:
            _index_cjk(conn)
        if exists is not None:
            count = context.index_all(conn)
            logger.info(
                "memory store: indexed %d nodes with their context (one-time upgrade)", count
            )
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def prepare_vectors(conn: sqlite3.Connection, model_id: str) -> None:
    """Create the vector tables of a hybrid store if missing; vectors made by another model
    are dropped (the background fill makes them again)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in _split_script(_VECTOR_TABLES):
            conn.execute(statement)
        row = conn.execute("SELECT model FROM vector_model WHERE id = 1").fetchone()
        if row is None or row[0] != model_id:
            if row is not None:
                logger.info("memory store: vectors of model %s dropped for %s", row[0], model_id)
            conn.execute("DELETE FROM vectors")
            conn.execute(
                "INSERT OR REPLACE INTO vector_model (id, model) VALUES (1, ?)", (model_id,)
            )
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _rekey(conn: sqlite3.Connection) -> None:
    """Renumber every node by time (transaction open) and rebuild the index to match."""
    count = int(conn.execute("SELECT count(*) FROM nodes").fetchone()[0])
    logger.info("memory store: re-keying %d nodes by creation time (one-time upgrade)", count)
    for name in ("nodes_ai", "nodes_ad", "nodes_au"):
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    conn.execute("DROP TABLE IF EXISTS nodes_fts")
    conn.execute("DROP INDEX IF EXISTS nodes_created")
    conn.execute("ALTER TABLE nodes RENAME TO nodes_old")
    for statement in _split_script(_TABLES):
        conn.execute(statement)
    previous: int | None = None
    for row in conn.execute(f"SELECT {COLUMNS} FROM nodes_old ORDER BY created_at, seq"):
        created_at = float(row[3])
        key = math.floor(max(-MAX_ABS_EPOCH_S, min(MAX_ABS_EPOCH_S, created_at)) * KEY_SCALE)
        if previous is not None and key <= previous:
            key = previous + 1
        previous = key
        conn.execute(INSERT, (key, *row, digest(row[1], row[2], row[4], row[5], row[6])))
    conn.execute("DROP TABLE nodes_old")


def _index_cjk(conn: sqlite3.Connection) -> None:
    """Index the character pairs of every stored node that has Chinese, Japanese or Korean
    text (transaction open; a version-3 database has none indexed)."""
    conn.execute("DELETE FROM nodes_cjk")
    rows = conn.execute("SELECT seq, text FROM nodes").fetchall()
    pairs = [(seq, grams) for seq, text in rows if (grams := cjk_index_text(text)) is not None]
    conn.executemany(INSERT_CJK, pairs)
    if pairs:
        logger.info(
            "memory store: indexed %d nodes by character pairs (one-time upgrade)", len(pairs)
        )


def _add_digests(conn: sqlite3.Connection) -> None:
    """Give every node of a version-2 database its digest (transaction open)."""
    conn.execute("ALTER TABLE nodes ADD COLUMN digest BLOB")
    rows = conn.execute(
        "SELECT seq, node_type, text, source_episode_id, related_node_ids, properties FROM nodes"
    ).fetchall()
    conn.executemany(
        "UPDATE nodes SET digest = ? WHERE seq = ?",
        ((digest(*row[1:]), row[0]) for row in rows),
    )


def _split_script(script: str) -> list[str]:
    """The statements of :data:`_TABLES` (triggers hold inner semicolons), for execute()."""
    statements: list[str] = []
    current: list[str] = []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current)
        if line.rstrip().endswith(";") and sqlite3.complete_statement(text):
            statements.append(text)
            current = []
    return statements


def ensure_exp(conn: sqlite3.Connection) -> None:
    """Make sure SQL ``exp()`` exists: builds of SQLite without its math functions get a
    deterministic Python one (slower per row, same results)."""
    try:
        conn.execute("SELECT exp(0)").fetchone()
    except sqlite3.OperationalError:
        conn.create_function("exp", 1, _sql_exp, deterministic=True)


def _sql_exp(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
