"""The memory store's PostgreSQL schema: migrations, pgvector, the change log."""

from __future__ import annotations

import socket

import pytest

from arona_common.database import DatabaseUnavailable, SchemaRefused
from arona_store.pg import schema
from tests.support.postgres import PgCluster


def test_migrations_apply_once_and_enable_pgvector(store_database_url: str) -> None:
    applied = schema.migrate(store_database_url)
    assert [m.version for m in applied] == [m.version for m in schema.STORE_MIGRATIONS]
    assert schema.migrate(store_database_url) == []  # a second start applies nothing
    with schema.connect(store_database_url) as conn:
        version = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        assert version.fetchone() is not None
        indexes = {
            row[0]
            for row in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = %s", ("memory_nodes",)
            )
        }
    assert "memory_nodes_embedding" in indexes  # HNSW over the vectors


def test_the_change_log_names_keys_never_text(store_database_url: str) -> None:
    schema.migrate(store_database_url)
    with schema.connect(store_database_url) as conn:
        conn.execute(
            "INSERT INTO memory_nodes (seq, id, node_type, text, created_at, digest)"
            " VALUES (10, 'a', 'episode', 'Caroline went to the support group', 1.0, '\\x00')"
        )
        conn.execute("UPDATE memory_nodes SET seq = 20 WHERE id = 'a'")
        conn.execute("UPDATE memory_nodes SET embedding = NULL WHERE id = 'a'")  # not a change
        conn.execute("DELETE FROM memory_nodes WHERE id = 'a'")
        rows = conn.execute("SELECT * FROM memory_changes ORDER BY change").fetchall()
    assert [(seq, node_type) for _, seq, node_type in rows] == [
        (10, "episode"),  # added
        (10, "episode"),  # moved away from 10 ...
        (20, "episode"),  # ... to 20
        (20, "episode"),  # deleted
    ]
    assert "support group" not in repr(rows)


def test_a_server_without_pgvector_stops_the_start_with_one_line(
    pg_server: PgCluster | str,
) -> None:
    if not isinstance(pg_server, PgCluster):
        pytest.skip("needs the throwaway Debian PostgreSQL (no pgvector)")
    url = pg_server.create_database()
    with pytest.raises(SchemaRefused) as refused:
        schema.migrate(url)
    message = str(refused.value)
    assert "\n" not in message
    assert "install pgvector" in message
    with schema.connect(url) as conn:  # nothing was created
        assert conn.execute("SELECT to_regclass('memory_nodes')").fetchone() == (None,)


def test_an_unreachable_database_is_said_without_its_password() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once closed
    url = f"postgresql://arona:s3cret-pw@127.0.0.1:{port}/memories"
    with pytest.raises(DatabaseUnavailable) as refused:
        schema.migrate(url)
    assert "s3cret-pw" not in str(refused.value)
    assert f"127.0.0.1:{port}" in str(refused.value)
