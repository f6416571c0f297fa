"""Fixtures shared by every test package: a real PostgreSQL server for the database tests."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import pytest

from tests.support.postgres import ENV_URL, PgCluster, pg_cluster


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgCluster | str]:
    """The PostgreSQL server of the whole run: ``ARONA_TEST_DATABASE_URL``, or a throwaway
    cluster started now (skipped when neither exists, a failure under ``CI=true``)."""
    url = os.environ.get(ENV_URL)
    if url:
        yield url
        return
    with pg_cluster() as cluster:
        yield cluster


@pytest.fixture
def database_url(pg_server: PgCluster | str) -> str:
    """A fresh, empty database of its own for one test."""
    if isinstance(pg_server, PgCluster):
        return pg_server.create_database()
    return asyncio.run(_create_database(pg_server))


async def _create_database(url: str) -> str:
    import asyncpg

    name = f"t_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str | None:
    """Each storage test runs on both backends: None (SQLite files) or a PostgreSQL URL."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("database_url")
    return url
