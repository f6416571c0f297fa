"""A store process's connection to its database, which comes back after the database does.

A store on PostgreSQL holds two connections (its writer and its reader) for as long as it runs.
When the database restarts or the network drops them, :class:`Link` says so once per outage
(:func:`arona_common.database.unavailable`: one WARNING, then one INFO line when it answers again),
every call meanwhile raises :class:`~arona_common.database.DatabaseUnavailable` at once (the
gateway's memory call fails, and its turns go on without memory: nothing waits on a dead
socket), and the first call after the database is back opens a new connection. Nothing the
process holds is lost with the connection: the node table and the word engine follow the
change log from where they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from arona_common.database import DatabaseUnavailable, database_answered, unavailable

# What the store answers while its database is away (said once per outage).
EFFECT = "the memory store's calls fail, so gateways answer without memory,"


class Link:
    """One connection of a store process, opened by ``opener`` (a psycopg connect: its
    errors are psycopg's) when first needed and again after it was lost."""

    def __init__(self, url: str, opener: Callable[[str], Any]) -> None:
        self._url = url
        self._opener = opener
        self._conn: Any | None = None
        self._lost = False

    def _connection(self) -> Any:
        """The connection, opened now if need be (inside :meth:`failures`)."""
        if self._conn is None:
            self._conn = self._opener(self._url)
        return self._conn

    def execute(self, sql: str, params: Any = None) -> Any:
        """``sql`` on the connection (its cursor, to fetch from)."""
        with self.failures():
            return self._connection().execute(sql, params)

    @contextmanager
    def cursor(self, name: str) -> Iterator[Any]:
        """A server-side cursor (read transaction open), its failures as the link's."""
        with self.failures(), self._connection().cursor(name=name) as cursor:
            yield cursor

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A transaction, committed at the end of the block (rolled back on an error)."""
        with self.failures():
            conn = self._connection()
            with conn.transaction():
                yield conn

    @contextmanager
    def failures(self) -> Iterator[None]:
        """Turn the connection's loss inside the block into :class:`DatabaseUnavailable`."""
        import psycopg

        try:
            yield
        except psycopg.OperationalError as exc:
            self._drop()
            raise self._unavailable(exc) from None
        if self._lost:
            self._lost = False
            database_answered(self._url)

    def rollback(self) -> None:
        """End the open transaction, if the connection still holds one."""
        import psycopg

        if self._conn is not None:
            try:
                self._conn.rollback()
            except psycopg.Error:
                self._drop()

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a lost connection may fail to close
                conn.close()

    def _unavailable(self, exc: BaseException) -> DatabaseUnavailable:
        self._lost = True
        return unavailable(self._url, exc, effect=EFFECT)
