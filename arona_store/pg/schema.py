"""The memory store's PostgreSQL schema (``ARONA_STORE_DATABASE_URL``) and its migrations.

``memory_nodes`` holds the memories: the same columns as the embedded store's ``nodes``
(:mod:`arona_store.schema`: the time-ordered key ``seq``, the id, the node type that is a
memory's scope, the text, its time and the digest of an identical write), and each memory's
vector as pgvector's ``halfvec`` (float16, as the embedded store keeps it), NULL until it is
embedded, under an HNSW index (cosine). ``memory_changes`` is the change log that every store
process follows: the key and node type of each node added, moved, changed or deleted, never
its text; the write path appends to it under one lock (:data:`WRITE_LOCK`), so its numbers
commit in order and a process that has read up to one has seen every change before it.
``memory_meta`` holds the vector model the stored vectors come from.

The tables are prefixed (``memory_``), their migrations recorded in ``memory_schema``, so the
store may share a database with the gateway's own tables (``ARONA_DATABASE_URL``). As the
gateway's: each migration in its own transaction, under a session advisory lock, so store
processes starting together apply each once.

pgvector must be available on the server. A server without it stops the store's start with
one line saying what to install; a server with it where the role may not enable it, with one
line saying what a superuser runs once.
"""

from __future__ import annotations

import logging
from typing import Any

from arona_common.database import DatabaseUnavailable, Migration, SchemaRefused
from arona_common.redact import redact_text, redact_url, url_password

logger = logging.getLogger(__name__)

# pg_advisory_lock keys: the store's migrations ("AronaM"), and the write path's transaction
# lock ("AronaW"), which orders the change log's numbers as they commit.
MIGRATION_LOCK = 0x41726F6E614D
WRITE_LOCK = 0x41726F6E6157
CONNECT_TIMEOUT_S = 5
# The vectors' dimension (all-MiniLM-L6-v2, arona_store.embedding).
DIMENSION = 384

_NODES = f"""
CREATE TABLE memory_nodes (
    seq bigint PRIMARY KEY,
    id text NOT NULL UNIQUE,
    node_type text NOT NULL,
    text text NOT NULL,
    created_at double precision NOT NULL,
    source_episode_id text,
    related_node_ids text NOT NULL DEFAULT '[]',
    properties text NOT NULL DEFAULT '{{}}',
    digest bytea NOT NULL,
    embedding halfvec({DIMENSION})
);
CREATE INDEX memory_nodes_type_seq ON memory_nodes (node_type, seq);
CREATE INDEX memory_nodes_digest ON memory_nodes (digest);
CREATE INDEX memory_nodes_unembedded ON memory_nodes (seq) WHERE embedding IS NULL;
CREATE INDEX memory_nodes_embedding ON memory_nodes
    USING hnsw (embedding halfvec_cosine_ops);
CREATE TABLE memory_changes (
    change bigserial PRIMARY KEY,
    seq bigint NOT NULL,
    node_type text NOT NULL
);
CREATE FUNCTION memory_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO memory_changes (seq, node_type) VALUES (OLD.seq, OLD.node_type);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO memory_changes (seq, node_type) VALUES (NEW.seq, NEW.node_type);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER memory_nodes_changed AFTER INSERT OR DELETE OR UPDATE OF seq, node_type, text
    ON memory_nodes FOR EACH ROW EXECUTE FUNCTION memory_changed();
CREATE TABLE memory_meta (
    key text PRIMARY KEY,
    value text NOT NULL
);
"""

STORE_MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "memory nodes with their vectors (pgvector), the change log", _NODES),
)

NO_PGVECTOR = (
    "the database server has no pgvector extension, which the memory store on PostgreSQL "
    "needs: install pgvector on it (Debian and Ubuntu: the postgresql-<version>-pgvector "
    "package of apt.postgresql.org; containers: the pgvector/pgvector image; "
    "https://github.com/pgvector/pgvector#installation), then start the store again"
)


def open_connection(url: str, **options: Any) -> Any:
    """A psycopg connection to ``url`` (autocommit off); psycopg's error if it cannot be
    made."""
    import psycopg

    return psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, **options)


def connect(url: str, **options: Any) -> Any:
    """:func:`open_connection` at a start: :class:`DatabaseUnavailable` without the URL's
    credentials when it cannot be made."""
    import psycopg

    try:
        return open_connection(url, **options)
    except psycopg.Error as exc:
        raise _unavailable(url, exc) from None


def migrate(url: str) -> list[Migration]:
    """Bring ``url``'s memory store schema up to date (pgvector enabled first); the
    migrations applied. :class:`DatabaseUnavailable` or :class:`SchemaRefused` otherwise, in
    one line without the URL's credentials."""
    import psycopg

    conn = connect(url, autocommit=True)
    try:
        with conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
            try:
                _enable_pgvector(conn)
                return _apply(conn)
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
    except psycopg.OperationalError as exc:
        raise _unavailable(url, exc) from None
    except psycopg.Error as exc:
        raise SchemaRefused(
            f"{redact_url(url)}: the database refused the memory store's schema "
            f"({type(exc).__name__}: {_detail(url, exc)})"
        ) from None


def _enable_pgvector(conn: Any) -> None:
    import psycopg

    if conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'vector'").fetchone():
        return
    if not conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone():
        raise SchemaRefused(NO_PGVECTOR)
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    except psycopg.errors.InsufficientPrivilege:
        raise SchemaRefused(
            "pgvector is installed on the database server but not enabled in this database, "
            "and this role may not enable it: run CREATE EXTENSION vector; in it once as a "
            "superuser (or the database's owner, from PostgreSQL 13 on if pgvector is trusted)"
        ) from None


def _apply(conn: Any) -> list[Migration]:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS memory_schema ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    done = {row[0] for row in conn.execute("SELECT version FROM memory_schema")}
    newest = max(m.version for m in STORE_MIGRATIONS)
    if done and max(done) > newest:
        raise SchemaRefused(
            f"the memory store's schema (version {max(done)}) is newer than this version "
            f"knows ({newest})"
        )
    applied: list[Migration] = []
    for migration in STORE_MIGRATIONS:
        if migration.version in done:
            continue
        with conn.transaction():
            conn.execute(migration.sql)
            conn.execute(
                "INSERT INTO memory_schema (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )
        logger.info("memory store migration %d applied: %s", migration.version, migration.name)
        applied.append(migration)
    return applied


def _detail(url: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return redact_text(text, (url_password(url),))


def _unavailable(url: str, exc: BaseException) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"the memory store's database at {redact_url(url)} is unavailable "
        f"({type(exc).__name__}: {_detail(url, exc)})"
    )
