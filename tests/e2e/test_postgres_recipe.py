"""The PostgreSQL recipe of docs/deploying.md, run exactly as written.

The ```` ```sh ```` blocks between ``<!-- recipe:postgres -->`` and ``<!-- /recipe -->`` are
joined into one bash script (what pasting them into one shell does) and run against a
throwaway PostgreSQL cluster on 127.0.0.1, whose password checks are real: TCP logins other
than the ``postgres`` superuser's need their password (scram-sha-256), so the role, the
password and the URL the recipe writes must agree. The only inputs are the variables the
recipe's step 0 reads with a default (``PGHOST``, ``PGPORT`` and the gateway's ports, all free
ports on 127.0.0.1).

The recipe reaches PostgreSQL as its superuser with the ``psql.env`` that ``make postgres``
writes (``POSTGRES_ENV``): here one written for the throwaway cluster (its socket directory, its
port, its own ``psql``). It assumes no ``sudo``: a ``sudo`` of the test's own, first on
``PATH``, fails the recipe if it is ever called.

The script runs in a process group of its own; whatever it left running is killed with the
group at the end, whether it passed or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support.postgres import PgCluster
from tests.support.readme import VARIABLE, fenced_blocks, gateway_variables, region

pytestmark = pytest.mark.timeout(480)

# The whole recipe: a model to load for the store, three gateway processes to start, two of
# them with PostgreSQL pools. About 30 s on an idle 2-core machine.
RECIPE_TIMEOUT_S = 300
# Local socket logins are trusted (the recipe's psql as postgres, as peer authentication
# would let it on a stock install); over TCP, only the superuser the test itself uses is.
PG_HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""
SUDO = """\
#!/bin/sh
# The recipe assumes no sudo: a call to it fails the recipe.
echo "the recipe called sudo $*, which it must not need" >&2
exit 97
"""
LOGS = ("store.log", "replica-a.log", "replica-b.log")


def recipe() -> str:
    blocks = fenced_blocks(region("recipe", "postgres"), "sh")
    assert len(blocks) >= 10, "the recipe's steps are its ```sh blocks"
    return "\n".join(blocks)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@contextlib.contextmanager
def password_cluster(binaries: Path | None = None) -> Iterator[PgCluster]:
    """A throwaway cluster (Debian's, or of the server binaries in ``binaries``) whose TCP
    logins need their password (:data:`PG_HBA`)."""
    cluster = PgCluster(binaries)
    try:
        (cluster.data / "pg_hba.conf").write_text(PG_HBA)
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def cluster() -> Iterator[PgCluster]:
    with password_cluster() as cluster:
        yield cluster


def recipe_workdir(tmp_path: Path, text: str) -> tuple[Path, Path, Path]:
    """The test's ``sudo`` that refuses (a directory for ``PATH``), the recipe's working
    directory, and the recipe ``text`` as a script: made under ``tmp_path``."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "sudo").write_text(SUDO)
    (tools / "sudo").chmod(0o755)
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = tmp_path / "recipe.sh"
    script.write_text(text)
    return tools, workdir, script


def recipe_environment(
    cluster: PgCluster, tools: Path, ports: Sequence[str], path: Sequence[Path] = ()
) -> dict[str, str]:
    """The test runner's environment without its ARONA_* and PG* settings, and step 0's
    variables pointing at the throwaway cluster (``POSTGRES_ENV``, a ``psql.env`` written in
    ``tools``) and (each of ``ports``) at a free port;
    ``path``: more directories for ``PATH``, after the project's own."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ARONA_", "PG", "PROMETHEUS_"))
    }
    # `arona-gateway` and python3 as installed here, and the test's sudo first.
    env["PATH"] = os.pathsep.join(
        [str(tools), str(Path(sys.executable).parent), *map(str, path), env["PATH"]]
    )
    # What `make postgres` writes to .postgres/psql.env, for the throwaway cluster.
    psql_env = tools / "psql.env"
    psql_env.write_text(
        f"PGHOST={cluster.socket_dir}\nPGPORT={cluster.port}\nPGUSER=postgres\n"
        f"PGDATABASE=postgres\nPSQL={cluster.psql_binary}\n"
    )
    env["POSTGRES_ENV"] = str(psql_env)
    env.update((name, str(_free_port())) for name in ports)
    return env


def _report(workdir: Path, out: str, err: str, logs: Sequence[str] = LOGS) -> str:
    parts = [f"--- stdout\n{out}", f"--- stderr\n{err}"]
    for name in logs:
        log = workdir / name
        if log.exists():
            parts.append(f"--- {name} (end)\n" + "\n".join(log.read_text().splitlines()[-40:]))
    return "\n".join(parts)


def run_recipe(
    script: Path, env: dict[str, str], workdir: Path, logs: Sequence[str]
) -> tuple[str, str, str]:
    """Run ``script`` in bash (``-e -u -o pipefail``) in a process group of its own in
    ``workdir``: its output, and a report of it with the end of each of ``logs``. Fails the
    test unless it exits 0 within :data:`RECIPE_TIMEOUT_S` having stopped all it started;
    whatever it left running is killed either way."""
    process = subprocess.Popen(
        ["bash", "-e", "-u", "-o", "pipefail", str(script)],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, err = process.communicate(timeout=RECIPE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            out, err = process.communicate()
            pytest.fail(
                f"the recipe did not finish in {RECIPE_TIMEOUT_S} s\n"
                + _report(workdir, out, err, logs)
            )
        report = _report(workdir, out, err, logs)
        assert process.returncode == 0, f"the recipe failed (exit {process.returncode})\n{report}"
        # Its last step stopped everything it started.
        assert not _group_alive(process.pid), f"the recipe left processes running\n{report}"
    finally:
        _kill_group(process.pid)
    return out, err, report


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _chat_replies(out: str) -> dict[str, tuple[str, str]]:
    """The chat answers the recipe printed: each reply's content by the question's
    echo, with the HTTP head printed before it ("" when curl printed none)."""
    replies: dict[str, tuple[str, str]] = {}
    head = ""
    for line in out.splitlines():
        if line.startswith("HTTP/"):
            head = line + "\n"
        elif head and ":" in line and not line.startswith("{"):
            head += line + "\n"
        if line.startswith('{"id":"chatcmpl'):
            content = json.loads(line)["choices"][0]["message"]["content"]
            question = content.split("\n", 1)[0]
            replies[question] = (head.lower(), content)
            head = ""
    return replies


def test_the_recipe_runs_as_written_and_a_turn_on_one_replica_is_recalled_on_the_other(
    cluster: PgCluster, tmp_path: Path
) -> None:
    tools, workdir, script = recipe_workdir(tmp_path, recipe())
    env = recipe_environment(
        cluster, tools, ("STORE_PORT", "ARONA_HTTP_PORT", "ARONA_GRPC_PORT", "REPLICA_B_PORT")
    )

    out, err, report = run_recipe(script, env, workdir, LOGS)

    # migrate created the schema in the database step 1 created, with the role's password.
    assert ": applied migration 1: " in out, report
    assert "isolates users" in out, report
    replies = _chat_replies(out)
    told = replies.get("Echo: I prefer oolong tea")
    asked = replies.get("Echo: Which tea do I prefer?")
    assert told is not None and asked is not None, report
    # Replica B recalled what was said to replica A.
    assert "x-arona-memory: enabled" in asked[0], report
    assert "## Relevant Long-Term Memories" in asked[1], report
    assert "User: I prefer oolong tea" in asked[1], report
    # A password never reaches the output or the logs.
    password = env_file(workdir)["ARONA_DATABASE_URL"].split(":")[2].split("@")[0]
    assert password not in out + err
    for name in LOGS:
        assert password not in (workdir / name).read_text()

    # migrate again, as before a rolling deploy, with the recipe's own environment file.
    again = subprocess.run(
        ["bash", "-e", "-c", "set -a; . ./arona.env; set +a; arona-gateway migrate"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "the schema is up to date" in again.stdout
    assert "applied migration" not in again.stdout


def env_file(workdir: Path, name: str = "arona.env") -> dict[str, str]:
    """The variables of the recipe's environment file ``name``, which only its owner reads."""
    path = workdir / name
    assert path.stat().st_mode & 0o077 == 0, f"{name} holds secrets: only its owner reads it"
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {name: value for name, value in pairs}


def test_the_recipe_sets_only_variables_the_gateway_reads() -> None:
    """A misspelt variable in the recipe would be ignored silently by every process."""
    named = set(VARIABLE.findall(region("recipe", "postgres")))
    assert named, "the recipe configures the gateway through ARONA_* variables"
    assert named <= gateway_variables(), sorted(named - gateway_variables())
