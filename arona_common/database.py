"""Shared state on PostgreSQL (``ARONA_DATABASE_URL``) and versioned schemas on both backends.

With ``ARONA_DATABASE_URL`` set, conversations, the episode index, the writeback outbox and
usage (records and budgets) live in one PostgreSQL database shared by every replica; unset,
each lives in its own SQLite file under ``ARONA_DATA_DIR``. Either way the schema is versioned:

- PostgreSQL: :data:`PG_MIGRATIONS` are applied in order at start (or by
  ``arona-gateway migrate``), each in its own transaction, recorded in ``arona_schema``, under
  a session advisory lock, so replicas starting together apply each migration once.
- SQLite: each file is opened the same way (:func:`sqlite_open`: WAL, a busy timeout) and its
  steps are applied in order from its ``PRAGMA user_version``
  (:func:`sqlite_migrate`).

:class:`DatabaseUnavailable` is the one error a caller sees when PostgreSQL cannot be
reached, :class:`SchemaRefused` when it is reached but the schema cannot be brought up to date
(a role without the right to create tables, a schema from a newer version); neither message
carries the URL's credentials.

A database that goes away while the process runs is said once: the first
:class:`DatabaseUnavailable` of an outage (:func:`unavailable`) is one WARNING line, the rest of
it debug records, and the first operation that works again (:func:`database_answered`, which
every backend calls after a successful one) one INFO line. asyncpg's own pool warnings, with
their tracebacks, are left to debug level (:func:`quiet_asyncpg_pool`).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from arona_common.redact import redact_text, redact_url, url_password

logger = logging.getLogger(__name__)

T = TypeVar("T")

# pg_advisory_lock key for migrations ("Arona" in ASCII).
MIGRATION_LOCK = 0x41726F6E61
CONNECT_TIMEOUT_S = 5.0
# What answers differently while the gateway's database is away (said with the outage).
GATEWAY_EFFECT = "what needs it answers 503 database_unavailable"
# A query that takes longer than this on a live connection is given up (and the turn 503s).
COMMAND_TIMEOUT_S = 10.0
POOL_MAX = 10


class DatabaseUnavailable(Exception):
    """PostgreSQL could not be reached or dropped the connection; safe to show."""


class SchemaRefused(Exception):
    """PostgreSQL refused to bring the schema up to date; one line, safe to show."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


PG_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "conversations, messages, episode index, outbox",
        """
        CREATE TABLE conversations (
            id          text PRIMARY KEY,
            owner       text NOT NULL,
            title       text,
            created_us  bigint NOT NULL,
            updated_us  bigint NOT NULL
        );
        CREATE INDEX conversations_by_owner ON conversations (owner, updated_us DESC);
        CREATE TABLE messages (
            seq             bigserial PRIMARY KEY,
            conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            role            text NOT NULL,
            body            text NOT NULL,
            created_us      bigint NOT NULL
        );
        CREATE INDEX messages_by_conversation ON messages (conversation_id, seq);
        CREATE TABLE episodes (
            seq       bigserial PRIMARY KEY,
            node_id   text NOT NULL UNIQUE,
            scope_id  text NOT NULL,
            at_us     bigint NOT NULL,
            preview   text NOT NULL
        );
        CREATE INDEX episodes_by_scope ON episodes (scope_id, seq);
        CREATE TABLE outbox (
            seq            bigserial PRIMARY KEY,
            text           text NOT NULL,
            node_type      text NOT NULL,
            scope_id       text NOT NULL DEFAULT '',
            queued_us      bigint NOT NULL,
            claimed_by     text,
            claimed_until  timestamptz
        );
        CREATE TABLE outbox_counters (
            name   text PRIMARY KEY,
            value  bigint NOT NULL
        );
        """,
    ),
    Migration(
        2,
        "outbox episodes keep their caller's id",
        """
        ALTER TABLE outbox ADD COLUMN episode_id text NOT NULL DEFAULT '';
        CREATE INDEX outbox_by_episode ON outbox (episode_id) WHERE episode_id <> '';
        """,
    ),
    Migration(
        3,
        "outbox episodes keep when they happened (NULL: when they were queued)",
        "ALTER TABLE outbox ADD COLUMN occurred_us bigint;",
    ),
    Migration(
        4,
        "the outbox is bounded by bytes, counts kept exact, and a dead-letter list",
        """
        ALTER TABLE outbox ADD COLUMN bytes bigint NOT NULL DEFAULT 0;
        UPDATE outbox SET bytes = octet_length(text) + octet_length(node_type)
            + octet_length(scope_id) + octet_length(episode_id) + 100;
        INSERT INTO outbox_counters (name, value)
            SELECT 'bytes', coalesce(sum(bytes), 0) FROM outbox
            UNION ALL SELECT 'depth', count(*) FROM outbox
            UNION ALL SELECT 'dead_letters', 0
            UNION ALL SELECT 'dropped', 0
            ON CONFLICT (name) DO UPDATE
            SET value = CASE WHEN excluded.name IN ('bytes', 'depth') THEN excluded.value
                ELSE outbox_counters.value END;
        CREATE TABLE outbox_dead_letters (
            seq         bigserial PRIMARY KEY,
            text        text NOT NULL,
            node_type   text NOT NULL,
            scope_id    text NOT NULL DEFAULT '',
            episode_id  text NOT NULL DEFAULT '',
            queued_us   bigint NOT NULL,
            occurred_us bigint,
            dead_us     bigint NOT NULL,
            reason      text NOT NULL
        );
        """,
    ),
    Migration(
        5,
        "usage records, each month's spending per principal, budgets",
        """
        CREATE TABLE usage_records (
            turn_id            text PRIMARY KEY,
            at_us              bigint NOT NULL,
            day                text NOT NULL,
            principal          text NOT NULL,
            user_name          text NOT NULL,
            model              text NOT NULL,
            backend            text NOT NULL,
            surface            text NOT NULL,
            outcome            text NOT NULL,
            prompt_tokens      bigint NOT NULL,
            completion_tokens  bigint NOT NULL,
            memory_tokens      bigint NOT NULL,
            estimated          boolean NOT NULL,
            latency_ms         double precision NOT NULL,
            cost_micro         bigint
        );
        CREATE INDEX usage_by_time ON usage_records (at_us);
        CREATE INDEX usage_by_principal ON usage_records (principal, at_us);
        CREATE TABLE usage_months (
            principal   text NOT NULL,
            month       text NOT NULL,
            tokens      bigint NOT NULL,
            cost_micro  bigint NOT NULL,
            PRIMARY KEY (principal, month)
        );
        CREATE TABLE usage_budgets (
            principal   text PRIMARY KEY,
            tokens      bigint,
            cost_micro  bigint,
            updated_us  bigint NOT NULL
        );
        """,
    ),
    Migration(
        6,
        "the episode index says which episodes were stored for one user (NULL: unknown)",
        """
        ALTER TABLE episodes ADD COLUMN scoped boolean;
        CREATE INDEX episodes_scoped ON episodes (seq) WHERE scoped;
        """,
    ),
    Migration(
        7,
        "episodes and queued episodes say whose principal they are (forgetting a principal);"
        " a forget is noted for the other replicas",
        """
        ALTER TABLE episodes ADD COLUMN principal_id text;
        CREATE INDEX episodes_by_principal ON episodes (principal_id, seq);
        ALTER TABLE outbox ADD COLUMN principal_id text;
        ALTER TABLE outbox_dead_letters ADD COLUMN principal_id text;
        CREATE TABLE erasures (
            seq           bigserial PRIMARY KEY,
            at_us         bigint NOT NULL,
            scope_id      text,
            principal_id  text,
            node_ids      text[] NOT NULL DEFAULT '{}'
        );
        """,
    ),
)

# The errors that mean "the database is not there" (as opposed to a bug in a query).
_UNAVAILABLE_NAMES = frozenset(
    {
        "ConnectionDoesNotExistError",
        "ConnectionFailureError",
        "CannotConnectNowError",
        "InterfaceError",
        "InternalClientError",
        "PostgresConnectionError",
        "AdminShutdownError",
        "CrashShutdownError",
        "ServerNotReadyError",
        "TooManyConnectionsError",
        "QueryCanceledError",
    }
)


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be used right now."""
    if isinstance(exc, OSError | TimeoutError | ConnectionError):
        return True
    return any(kind.__name__ in _UNAVAILABLE_NAMES for kind in type(exc).__mro__)


def unavailable(
    url: str, exc: BaseException, *, outage: bool = True, effect: str = GATEWAY_EFFECT
) -> DatabaseUnavailable:
    """A :class:`DatabaseUnavailable` for ``exc``, its text free of the URL's credentials;
    ``outage``: the database went away under a running process (said once per outage, with
    ``effect``: what answers differently meanwhile), not a start that could not reach it
    (said by the start's own one line)."""
    password = url_password(url)
    detail = redact_text(str(exc) or type(exc).__name__, (password,))
    error = DatabaseUnavailable(
        f"the database at {redact_url(url)} is unavailable ({type(exc).__name__}: {detail})"
    )
    if outage:
        OUTAGES.refused(redact_url(url), str(error), effect)
    return error


async def run_on(pool: Any, url: str, work: Callable[[Any], Awaitable[T]]) -> T:
    """``work`` on a connection of ``pool``: :class:`DatabaseUnavailable` when the database
    does not answer (the outage said once), the end of an outage noted when it does."""
    try:
        async with pool.acquire() as conn:
            result = await work(conn)
    except Exception as exc:
        if is_unavailable(exc):
            raise unavailable(url, exc) from None
        raise
    database_answered(url)
    return result


def database_answered(url: str) -> None:
    """An operation on ``url`` worked: the end of its outage, if it had one."""
    if OUTAGES.any:
        OUTAGES.answered(redact_url(url))


@dataclass
class _Outage:
    since: float
    refused: int


class DatabaseOutages:
    """This process's databases that do not answer now, by (redacted) URL: one WARNING when
    an outage begins, one INFO line when it ends."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._outages: dict[str, _Outage] = {}

    @property
    def any(self) -> bool:
        return bool(self._outages)

    def refused(self, where: str, message: str, effect: str = "") -> None:
        outage = self._outages.get(where)
        if outage is not None:
            outage.refused += 1
            logger.debug("%s", message)
            return
        self._outages[where] = _Outage(self._clock(), 1)
        logger.warning(
            "%s; %s until it is back (said once per outage)", message, effect or GATEWAY_EFFECT
        )

    def answered(self, where: str) -> None:
        outage = self._outages.pop(where, None)
        if outage is not None:
            logger.info(
                "the database at %s answers again (away %.1f s, %d operation(s) refused)",
                where,
                self._clock() - outage.since,
                outage.refused,
            )


# One process, one record: every pool and backend of the process reports to it.
OUTAGES = DatabaseOutages()


class _DebugOnly(logging.Filter):
    """asyncpg's pool warnings (with their tracebacks) as debug records: the outage they are
    part of is said once by :class:`DatabaseOutages`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info, record.exc_text = None, None
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def quiet_asyncpg_pool() -> None:
    """Send asyncpg's pool records through :class:`_DebugOnly` (logging set-up calls it)."""
    pool_logger = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _DebugOnly) for f in pool_logger.filters):
        pool_logger.addFilter(_DebugOnly())


async def open_pool(url: str, *, migrate: bool = True, max_size: int = POOL_MAX) -> Any:
    """A connection pool on ``url`` with the schema migrated; :class:`DatabaseUnavailable`
    when the server cannot be reached."""
    import asyncpg

    quiet_asyncpg_pool()
    try:
        pool = await asyncpg.create_pool(
            url,
            min_size=1,
            max_size=max_size,
            timeout=CONNECT_TIMEOUT_S,
            command_timeout=COMMAND_TIMEOUT_S,
            # Statements are prepared per connection; no cache needed across a pool reset.
            max_inactive_connection_lifetime=60.0,
        )
    except Exception as exc:
        if is_unavailable(exc) or type(exc).__module__.startswith("asyncpg"):
            raise unavailable(url, exc, outage=False) from None
        raise
    if migrate:
        try:
            await _apply(pool, url)
        except BaseException:
            await pool.close()
            raise
    return pool


@asynccontextmanager
async def command_pool(url: str | None) -> AsyncIterator[Any | None]:
    """The pool of a command-line tool: one connection to ``url`` (None without one: the
    SQLite files), closed when done. Raises what :func:`open_pool` raises."""
    if not url:
        yield None
        return
    pool = await open_pool(url, max_size=1)
    try:
        yield pool
    finally:
        await pool.close()


async def migrate(url: str) -> list[Migration]:
    """``arona-gateway migrate``: bring ``url``'s schema up to date on one connection; the
    migrations applied. :class:`DatabaseUnavailable` or :class:`SchemaRefused` otherwise."""
    pool = await open_pool(url, migrate=False, max_size=1)
    try:
        return await _apply(pool, url)
    finally:
        await pool.close()


async def _apply(pool: Any, url: str) -> list[Migration]:
    try:
        async with pool.acquire() as conn:
            return await apply_migrations(conn)
    except SchemaRefused as exc:
        raise SchemaRefused(f"{redact_url(url)}: {exc}") from None
    except Exception as exc:
        if is_unavailable(exc):
            raise unavailable(url, exc, outage=False) from None
        raise


async def apply_migrations(conn: Any) -> list[Migration]:
    """Apply the migrations this database lacks, under the advisory lock; those applied.

    A statement the server refuses (say, a role that may not create tables) is
    :class:`SchemaRefused`, as is a schema newer than :data:`PG_MIGRATIONS`.
    """
    import asyncpg

    applied: list[Migration] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
    try:
        await _migrate(conn, applied)
    except asyncpg.PostgresError as exc:
        if is_unavailable(exc):
            raise
        raise SchemaRefused(_refusal(exc)) from None
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    return applied


def _refusal(exc: Exception) -> str:
    import asyncpg

    text = f"the database refused the schema ({type(exc).__name__}: {exc})"
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        # PostgreSQL 15 and later let only a database's owner create tables in it by default.
        text += (
            "; the role in ARONA_DATABASE_URL must own the database"
            " (CREATE DATABASE ... OWNER <role>) or have CREATE on its schema"
        )
    return text


async def _migrate(conn: Any, applied: list[Migration]) -> None:
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS arona_schema ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    done = {row[0] for row in await conn.fetch("SELECT version FROM arona_schema")}
    newest = max((m.version for m in PG_MIGRATIONS), default=0)
    if done and max(done) > newest:
        raise SchemaRefused(
            f"the database schema (version {max(done)}) is newer than this version knows ({newest})"
        )
    for migration in PG_MIGRATIONS:
        if migration.version in done:
            continue
        async with conn.transaction():
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO arona_schema (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
        logger.info("database migration %d applied: %s", migration.version, migration.name)
        applied.append(migration)


class SqliteThread:
    """One SQLite connection and the one thread that may use it.

    A commit may wait on the disk and must never stall the event loop, and a connection must
    stay on the thread that made it: every piece of work on the file runs here, in turn.
    """

    def __init__(
        self, path: Path, connect: Callable[[Path], sqlite3.Connection], name: str, what: str
    ) -> None:
        """Open (creating its directories) the file at ``path`` with ``connect``, on a new
        thread named after ``name``; ``what`` names the database in errors."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._what = what
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        try:
            self._db = self._executor.submit(connect, path).result()
        except BaseException:
            self._executor.shutdown(wait=True)
            raise
        self._closed = False

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise RuntimeError(f"{self._what} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, work, self._db)

    def close(self) -> None:
        """Close the database; idempotent. Work already submitted finishes first."""
        if self._closed:
            return
        self._closed = True
        try:
            self._executor.submit(self._db.close).result()
        finally:
            self._executor.shutdown(wait=True)


# One SQLite step: a script, or a function of the connection (for steps that must look first).
SqliteStep = str | Callable[[sqlite3.Connection], None]


def sqlite_wal(db: sqlite3.Connection, attempts: int = 50) -> None:
    """Put ``db``'s file in WAL mode, waiting for a process that opens it at the same moment.

    Switching a new file to WAL takes an exclusive lock for which SQLite may answer "database
    is locked" at once, without its busy handler (``serve --workers N`` opening one file in
    each worker): the switch is tried again, every 0.1 s for at most ``attempts`` tries.
    """
    for attempt in range(attempts):
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.1)


def sqlite_open(
    path: Path, steps: Sequence[SqliteStep], what: str, *, foreign_keys: bool = False
) -> sqlite3.Connection:
    """The gateway's own SQLite file at ``path``, opened as every one of them is: WAL, a commit
    that does not wait for fsync (``synchronous = NORMAL``: a power cut may lose the last
    commits, never corrupt the file), a 5 s busy timeout, ``foreign_keys`` when asked, and its
    schema brought up to date (:func:`sqlite_migrate`; ``what`` names the file in a refusal).
    Deleted rows are zeroed where they stood (``secure_delete``; :func:`sqlite_erase` clears
    the write-ahead log too).
    Autocommit is off (the default isolation level): writes commit through ``with db:``."""
    db = sqlite3.connect(path)
    try:
        sqlite_wal(db)
        db.execute("PRAGMA synchronous = NORMAL")
        # What a delete frees is zeroed, not left in the file (forget means gone).
        db.execute("PRAGMA secure_delete = ON")
        if foreign_keys:
            db.execute("PRAGMA foreign_keys = ON")
        db.execute("PRAGMA busy_timeout = 5000")
        sqlite_migrate(db, steps, what)
    except BaseException:
        db.close()
        raise
    return db


# How long an erasure waits for the other connections to a file to let its log be reset.
ERASE_WAIT_S = 5.0


class LogInUse(sqlite3.OperationalError):
    """The write-ahead log could not be reset: another connection still reads it."""


def sqlite_erase(db: sqlite3.Connection, wait_s: float = ERASE_WAIT_S) -> None:
    """Leave nothing deleted so far in ``db``'s write-ahead log: copy the log into the
    database file and truncate it (the connection must zero what it frees:
    ``PRAGMA secure_delete``). Another connection reading an older snapshot keeps the log
    in use; this waits for it (each try waits the busy timeout), at most ``wait_s``, then
    raises :class:`LogInUse`, having erased nothing it could not."""
    deadline = time.monotonic() + wait_s
    while True:
        busy = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise LogInUse("the write-ahead log is still read by another connection")
        time.sleep(0.05)


def sqlite_migrate(db: sqlite3.Connection, steps: Sequence[SqliteStep], what: str) -> int:
    """Apply ``steps[user_version:]`` in order, each with its version; the version now.

    Step ``i`` (from 0) brings the file to version ``i + 1``. Each step runs in a write
    transaction taken before the version is read, so processes opening one file together
    (``serve --workers N``) apply it once. A file from a newer version is refused.
    """
    while True:
        db.execute("BEGIN IMMEDIATE")
        try:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            if version > len(steps):
                raise RuntimeError(
                    f"{what} was written by a newer version (schema {version} > {len(steps)})"
                )
            if version == len(steps):
                db.execute("COMMIT")
                return version
            step = steps[version]
            if isinstance(step, str):
                for statement in _statements(step):
                    db.execute(statement)
            else:
                step(db)
            db.execute(f"PRAGMA user_version = {version + 1}")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise


def _statements(script: str) -> list[str]:
    """The statements of a script, split where SQLite says a statement is complete."""
    statements: list[str] = []
    current = ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            if current.strip().rstrip(";").strip():
                statements.append(current.strip())
            current = ""
    if current.strip():
        statements.append(current.strip())
    return statements
