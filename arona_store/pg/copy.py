"""Copying an embedded store's memories into PostgreSQL, and back (``arona-gateway store-copy``).

One side is an embedded store's SQLite file (``memory.db``), the other a PostgreSQL database
holding the memory store's tables (:mod:`arona_store.pg.schema`). Every memory is copied as
stored: its key (``seq``, its time), id, node type (its scope), text, time, source episode,
related ids, properties and digest, and its vector as the same float16 values (the embedded
store's little-endian blob, pgvector's ``halfvec``), so nothing is embedded again. A memory
without a vector stays without one; the store embeds it later. The vector model the source's
vectors come from goes with them (``vector_model`` in SQLite, ``memory_meta`` in PostgreSQL),
and a destination whose vectors come from another model is refused: its vectors and the
copied ones would not compare.

The source is read in one snapshot, in key order, and written in batches of :data:`BATCH`,
each in one transaction: into PostgreSQL under the write path's lock (:data:`WRITE_LOCK`), so
the change log that store processes follow numbers the copied rows in order; into SQLite by
the embedded store's own write path (:func:`~arona_store.writes.write_rows`), which keeps the
character-pair and context indexes as a write does (the word indexes follow by triggers).

A copy stopped anywhere (Ctrl-C, a kill, the database going away) has committed whole batches
only, and the same command finishes it: a memory whose id the destination holds is skipped, so
nothing is copied twice and nothing is left out, whatever the destination held before. A key
the destination holds for another memory takes the next free one, as a write does.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import psycopg
from pgvector import HalfVector
from pgvector.psycopg import register_vector

from arona_common.database import DatabaseUnavailable, SchemaRefused
from arona_common.redact import redact_text, redact_url, url_password
from arona_store.nodes import Row, digest
from arona_store.pg import schema
from arona_store.pg.schema import WRITE_LOCK
from arona_store.schema import BUSY_TIMEOUT_MS, SCHEMA_VERSION, prepare_schema, prepare_vectors
from arona_store.writes import begin_write, write_rows

# Memories a transaction copies.
BATCH = 1000
# Seconds between two progress lines at most (one is printed at the end of a batch).
PROGRESS_S = 2.0
# The embedded store's file in a data directory (ARONA_DATA_DIR).
STORE_FILE = "memory.db"
# The key memory_meta keeps the vector model under.
MODEL_KEY = "vector_model"

_COLUMNS = (
    "seq, id, node_type, text, created_at, source_episode_id, related_node_ids, properties, digest"
)
_SQLITE_ROWS = (
    "SELECT n.seq, n.id, n.node_type, n.text, n.created_at, n.source_episode_id,"
    " n.related_node_ids, n.properties, n.digest, {vector} FROM nodes n {join} ORDER BY n.seq"
)
_PG_ROWS = f"SELECT {_COLUMNS}, embedding FROM memory_nodes ORDER BY seq"
_PG_INSERT = (
    f"INSERT INTO memory_nodes ({_COLUMNS}, embedding)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)

# A memory in transit: its row as the embedded store keeps it, and its vector (float16,
# little-endian) or None.
Record = tuple[Row, bytes | None]


class CopyError(Exception):
    """The copy cannot start or go on (one line, without a URL's credentials)."""


@dataclass(frozen=True)
class SqliteFile:
    """An embedded store's SQLite file."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class PostgresDatabase:
    """A PostgreSQL database with the memory store's tables (or to have them)."""

    url: str

    def __str__(self) -> str:
        return redact_url(self.url)


Place = SqliteFile | PostgresDatabase


def place_of(text: str) -> Place:
    """A command-line argument as a place to copy from or to: a ``postgresql://`` URL, an
    embedded store's file, or a directory holding one (its ``memory.db``)."""
    text = text.strip()
    if not text:
        raise CopyError("an empty name is neither a file nor a postgresql:// URL")
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme in ("postgresql", "postgres"):
        return PostgresDatabase(text)
    if scheme:
        raise CopyError(
            f"{redact_url(text)}: not a postgresql:// URL nor a file (the store on PostgreSQL "
            "is the only other place a store's memories go)"
        )
    path = Path(text)
    return SqliteFile(path / STORE_FILE if path.is_dir() else path)


@dataclass
class Tally:
    """What a copy found and did so far."""

    # In the source's snapshot.
    total: int = 0
    total_vectors: int = 0
    # Memories the destination held when the copy started.
    before: int = 0
    copied: int = 0
    with_vectors: int = 0
    # Skipped: the destination held them (same id) already.
    present: int = 0
    # Memories the destination holds once done.
    after: int = 0
    started: float = 0.0
    seconds: float = 0.0

    @property
    def done(self) -> int:
        return self.copied + self.present


class _Source(Protocol):
    model: str | None
    count: int
    vectors: int

    def batches(self, size: int) -> Iterator[list[Record]]: ...


class _Destination(Protocol):
    model: str | None

    def count(self) -> int: ...

    def take_model(self, model: str) -> None: ...

    def write(self, records: list[Record], before_commit: Callable[[], None]) -> tuple[int, int]:
        """Write the records the destination does not hold (one transaction); how many were
        written, and how many of those had a vector."""
        ...


def copy_store(
    source: Place,
    destination: Place,
    *,
    batch: int = BATCH,
    tally: Tally | None = None,
    report: Callable[[Tally], None] | None = None,
    before_commit: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Tally:
    """Copy every memory of ``source`` that ``destination`` does not hold (by id); what was
    found and done (``tally``, filled as it goes, if given). Exactly one side is PostgreSQL.

    ``report`` is called once both sides are open, then after each batch commits;
    ``before_commit`` with each batch's number (from 1), its rows written but not committed.
    :class:`CopyError` in one line when it cannot start or go on."""
    if isinstance(source, PostgresDatabase) == isinstance(destination, PostgresDatabase):
        raise CopyError(
            "one of SOURCE and DEST must be a postgresql:// URL, the other an embedded "
            "store's file (memory.db)"
        )
    tally = tally if tally is not None else Tally()
    database = source if isinstance(source, PostgresDatabase) else destination
    file = destination if isinstance(source, PostgresDatabase) else source
    assert isinstance(database, PostgresDatabase)
    try:
        with ExitStack() as stack:
            src = stack.enter_context(_reading(source))
            dest = stack.enter_context(_writing(destination))
            _agree_on_model(src, dest, destination)
            tally.total, tally.total_vectors = src.count, src.vectors
            tally.before = dest.count()
            tally.started = clock()
            if report is not None:
                report(tally)
            for number, records in enumerate(src.batches(batch), start=1):
                hook = functools.partial(before_commit, number) if before_commit else _nothing
                copied, with_vectors = dest.write(records, hook)
                tally.copied += copied
                tally.with_vectors += with_vectors
                tally.present += len(records) - copied
                if report is not None:
                    report(tally)
            tally.after = dest.count()
            tally.seconds = clock() - tally.started
    except (DatabaseUnavailable, SchemaRefused) as exc:
        raise CopyError(str(exc)) from None
    except psycopg.Error as exc:
        raise CopyError(_pg_failure(database.url, exc)) from None
    except sqlite3.Error as exc:
        raise CopyError(f"{file}: {_first_line(exc)}") from None
    return tally


def _nothing() -> None:
    pass


def _agree_on_model(source: _Source, dest: _Destination, where: Place) -> None:
    """Give the destination the source's vector model, or refuse one whose vectors come from
    another model."""
    if source.model is None:
        if source.vectors:
            raise CopyError(
                f"the source holds {source.vectors:,} vectors but names no vector model: "
                "they cannot be told apart from another model's"
            )
        return
    if dest.model is None or dest.model == source.model:
        # Also when it names that model already (a copy going on): it then keeps vectors.
        dest.take_model(source.model)
    if dest.model != source.model:  # named before, or by a store process meanwhile
        raise CopyError(
            f"{where}: its vectors come from {dest.model}, the source's from {source.model}; "
            "copy into an empty database or a new file"
        )


# -- SQLite -----------------------------------------------------------------------------------


def _open_store_file(path: Path) -> sqlite3.Connection:
    """``path`` opened as the embedded store opens it, its schema brought up to date (the
    store's own upgrade); :class:`CopyError` for a file that is not an embedded store's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        if version > SCHEMA_VERSION:
            raise CopyError(
                f"{path}: made by a newer version of the store (schema {version}, this one "
                f"knows {SCHEMA_VERSION})"
            )
        if tables and "nodes" not in tables:
            raise CopyError(f"{path}: not an embedded memory store (it has no memories table)")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        prepare_schema(conn)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise CopyError(f"{path}: not an embedded memory store ({_first_line(exc)})") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return found is not None


def _sqlite_model(conn: sqlite3.Connection) -> str | None:
    if not _has_table(conn, "vector_model"):
        return None
    row = conn.execute("SELECT model FROM vector_model WHERE id = 1").fetchone()
    return None if row is None else str(row[0])


class _SqliteSource:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        # One snapshot for the whole copy: what the store writes meanwhile is not in it.
        conn.execute("BEGIN")
        self._vectors_kept = _has_table(conn, "vectors")
        self.model = _sqlite_model(conn)
        self.count = int(conn.execute("SELECT count(*) FROM nodes").fetchone()[0])
        self.vectors = (
            int(conn.execute("SELECT count(*) FROM vectors").fetchone()[0])
            if self._vectors_kept
            else 0
        )

    def batches(self, size: int) -> Iterator[list[Record]]:
        sql = (
            _SQLITE_ROWS.format(vector="v.vec", join="LEFT JOIN vectors v ON v.node_id = n.id")
            if self._vectors_kept
            else _SQLITE_ROWS.format(vector="NULL", join="")
        )
        cursor = self._conn.execute(sql)
        try:
            while rows := cursor.fetchmany(size):
                yield [_record(row, bytes) for row in rows]
        finally:
            cursor.close()


def _record(row: Any, vector: Callable[[Any], bytes]) -> Record:
    """A row read with its vector as a :data:`Record`; ``vector`` turns a vector read into the
    embedded store's blob."""
    seq, node_id, node_type, text, created_at, source, related, properties, stored, vec = row
    # A file from before digests has them added by its upgrade; computed here all the same.
    if stored is None:
        stored = digest(node_type, text, source, related, properties)
    kept: Row = (
        int(seq),
        str(node_id),
        str(node_type),
        str(text),
        float(created_at),
        source,
        str(related),
        str(properties),
        bytes(stored),
    )
    return kept, None if vec is None else vector(vec)


class _SqliteDestination:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.model = _sqlite_model(conn)
        # Vectors are written only once the file keeps the source's model's.
        self._vectors_kept = False

    def count(self) -> int:
        return int(self._conn.execute("SELECT count(*) FROM nodes").fetchone()[0])

    def take_model(self, model: str) -> None:
        prepare_vectors(self._conn, model)
        self.model = model
        self._vectors_kept = True

    def write(self, records: list[Record], before_commit: Callable[[], None]) -> tuple[int, int]:
        begin_write(self._conn, wait=True)
        try:
            held = _held_ids(self._conn, [row[1] for row, _ in records])
            new = [(row, vec) for row, vec in records if row[1] not in held]
            vectors = [vec if self._vectors_kept else None for _, vec in new]
            write_rows(self._conn, [row for row, _ in new], vectors, refresh=False)
            before_commit()
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        return len(new), sum(vec is not None for vec in vectors)


def _held_ids(conn: sqlite3.Connection, ids: list[str]) -> set[str]:
    return {
        str(row[0])
        for row in conn.execute(
            "SELECT id FROM nodes WHERE id IN (SELECT value FROM json_each(?))", (json.dumps(ids),)
        )
    }


# -- PostgreSQL -------------------------------------------------------------------------------


def _halfvec(blob: bytes) -> HalfVector:
    """The embedded store's vector (float16, little-endian) as pgvector's, value for value."""
    # pgvector's binary form: the dimension, a reserved zero, the values big-endian.
    return HalfVector.from_binary(struct.pack(">HH", len(blob) // 2, 0) + _swapped(blob))


def _blob(vector: HalfVector) -> bytes:
    """pgvector's vector as the embedded store keeps it (float16, little-endian)."""
    return _swapped(vector.to_binary()[4:])


def _swapped(data: bytes) -> bytes:
    """``data``'s 16-bit words with their bytes swapped (little- to big-endian and back)."""
    out = bytearray(len(data))
    out[0::2] = data[1::2]
    out[1::2] = data[0::2]
    return bytes(out)


def _pg_connect(url: str) -> Any:
    conn = schema.connect(url, autocommit=True)
    try:
        register_vector(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _pg_model(conn: Any) -> str | None:
    row = conn.execute("SELECT value FROM memory_meta WHERE key = %s", (MODEL_KEY,)).fetchone()
    return None if row is None else str(row[0])


class _PostgresSource:
    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.model = _pg_model(conn)
        self.count, self.vectors = (
            int(n)
            for n in conn.execute("SELECT count(*), count(embedding) FROM memory_nodes").fetchone()
        )

    def batches(self, size: int) -> Iterator[list[Record]]:
        with self._conn.cursor("arona_store_copy", binary=True) as cursor:
            cursor.itersize = size
            cursor.execute(_PG_ROWS)
            while rows := cursor.fetchmany(size):
                yield [_record(row, _blob) for row in rows]


class _PostgresDestination:
    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.model = _pg_model(conn)

    def count(self) -> int:
        return int(self._conn.execute("SELECT count(*) FROM memory_nodes").fetchone()[0])

    def take_model(self, model: str) -> None:
        # A store process starting meanwhile may have named its own: the stored one wins.
        self._conn.execute(
            "INSERT INTO memory_meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING",
            (MODEL_KEY, model),
        )
        self.model = _pg_model(self._conn)

    def write(self, records: list[Record], before_commit: Callable[[], None]) -> tuple[int, int]:
        conn = self._conn
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
            ids = [row[1] for row, _ in records]
            held = {
                r[0] for r in conn.execute("SELECT id FROM memory_nodes WHERE id = ANY(%s)", (ids,))
            }
            new = [(row, vec) for row, vec in records if row[1] not in held]
            keys = [row[0] for row, _ in new]
            taken = {
                r[0]
                for r in conn.execute("SELECT seq FROM memory_nodes WHERE seq = ANY(%s)", (keys,))
            }
            assigned: set[int] = set()
            params = []
            for row, vec in new:
                key = row[0]
                if key in taken or key in assigned:
                    key = _free_key(conn, key, assigned)
                assigned.add(key)
                params.append((key, *row[1:], None if vec is None else _halfvec(vec)))
            if params:
                with conn.cursor() as cursor:
                    cursor.executemany(_PG_INSERT, params)
            before_commit()
        return len(new), sum(vec is not None for _, vec in new)


def _free_key(conn: Any, key: int, assigned: set[int]) -> int:
    """The first key after ``key`` that no memory holds and this batch has not given (lock
    held): another memory of the destination was stored at the same microsecond."""
    while True:
        key += 1
        if key in assigned:
            continue
        if conn.execute("SELECT 1 FROM memory_nodes WHERE seq = %s", (key,)).fetchone() is None:
            return key


@contextmanager
def _reading(place: Place) -> Iterator[_Source]:
    if isinstance(place, SqliteFile):
        if not place.path.is_file():
            raise CopyError(f"{place.path}: no embedded memory store there (no such file)")
        conn = _open_store_file(place.path)
        try:
            conn.execute("PRAGMA query_only=1")
            yield _SqliteSource(conn)
        finally:
            conn.close()
        return
    conn = _pg_connect_source(place.url)
    try:
        # One snapshot for the whole copy, as on SQLite.
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            yield _PostgresSource(conn)
    finally:
        conn.close()


def _pg_connect_source(url: str) -> Any:
    conn = schema.connect(url, autocommit=True)
    try:
        found = conn.execute("SELECT to_regclass('memory_nodes')").fetchone()
        if found is None or found[0] is None:
            raise CopyError(
                f"{redact_url(url)}: no memory store in this database (no memory_nodes table)"
            )
        register_vector(conn)
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def _writing(place: Place) -> Iterator[_Destination]:
    if isinstance(place, SqliteFile):
        conn = _open_store_file(place.path)
        try:
            yield _SqliteDestination(conn)
        finally:
            conn.close()
        return
    schema.migrate(place.url)
    conn = _pg_connect(place.url)
    try:
        yield _PostgresDestination(conn)
    finally:
        conn.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _pg_failure(url: str, exc: BaseException) -> str:
    detail = redact_text(_first_line(exc), (url_password(url),))
    return f"the database at {redact_url(url)} failed ({type(exc).__name__}: {detail})"


# -- the command ------------------------------------------------------------------------------


def _many(count: int, one: str, more: str) -> str:
    return f"{count:,} {one if count == 1 else more}"


class _Shown:
    """The command's lines: the start, progress (standard error, at most every
    :data:`PROGRESS_S`), the end."""

    def __init__(
        self,
        source: Place,
        destination: Place,
        out: TextIO,
        err: TextIO,
        clock: Callable[[], float],
    ) -> None:
        self._where = f"from {source} to {destination}"
        self._out, self._err, self._clock = out, err, clock
        self._shown_at: float | None = None

    def __call__(self, tally: Tally) -> None:
        now = self._clock()
        if self._shown_at is None:
            self._shown_at = now
            print(
                f"store-copy: {_many(tally.total, 'memory', 'memories')} "
                f"({tally.total_vectors:,} with vectors) {self._where}",
                file=self._out,
                flush=True,
            )
            return
        if now - self._shown_at < PROGRESS_S or tally.done >= tally.total:
            return
        self._shown_at = now
        elapsed = max(now - tally.started, 1e-9)
        share = tally.done * 100 // max(tally.total, 1)
        print(
            f"store-copy: {tally.done:,} of {tally.total:,} memories ({share}%), "
            f"{tally.copied / elapsed:,.0f} copied a second",
            file=self._err,
            flush=True,
        )


def copy_command(
    source: str,
    destination: str,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    batch: int = BATCH,
) -> int:
    """``arona-gateway store-copy SOURCE DEST``; its exit code: 0 done, 1 done but the counts
    do not add up, 2 could not start or go on, 130 interrupted."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    tally = Tally()
    try:
        src, dest = place_of(source), place_of(destination)
        copy_store(
            src,
            dest,
            batch=batch,
            tally=tally,
            report=_Shown(src, dest, out, err, clock),
            clock=clock,
        )
    except CopyError as exc:
        print(f"arona-gateway: error: {exc}", file=err, flush=True)
        if tally.copied:
            print(_stopped(tally), file=out, flush=True)
        return 2
    except KeyboardInterrupt:
        print(_stopped(tally), file=out, flush=True)
        return 130
    return _summary(tally, out)


def _stopped(tally: Tally) -> str:
    return (
        f"store-copy: stopped after copying {_many(tally.copied, 'memory', 'memories')}; "
        "run the same command again to go on"
    )


def _summary(tally: Tally, out: TextIO) -> int:
    """Print what was copied and how the counts compare; 1 if they do not add up."""
    line = (
        f"store-copy: copied {_many(tally.copied, 'memory', 'memories')} "
        f"({tally.with_vectors:,} with vectors) in {tally.seconds:.1f} s"
    )
    if tally.present:
        line += f"; {tally.present:,} the destination held already"
    print(line, file=out)
    # The destination's memories that are not the source's (it held them before).
    own = tally.before - tally.present
    if tally.after == tally.total + own:
        print(
            f"store-copy: the source and the destination both hold {tally.total:,}"
            if own == 0
            else f"store-copy: the destination holds {tally.after:,}: the source's "
            f"{tally.total:,} and {own:,} of its own",
            file=out,
        )
        return 0
    print(
        f"store-copy: the source holds {tally.total:,} memories and the destination "
        f"{tally.after:,}: they differ (written or deleted while it copied?)",
        file=out,
    )
    return 1
