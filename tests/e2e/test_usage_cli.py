"""``arona-gateway usage`` and ``arona-gateway budget`` as an operator runs them, on the SQLite
file and on PostgreSQL."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from arona_common.database import open_pool
from gateway_http.usage.records import Budget, UsageRecord
from gateway_http.usage.store import USAGE_FILE, open_usage_store
from tests.support.usage import usage_record

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
NOW = datetime.now(UTC)
MONTH = NOW.strftime("%Y-%m")


def env_for(data_dir: Path, database_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env["ARONA_DATA_DIR"] = str(data_dir)
    if database_url:
        env["ARONA_DATABASE_URL"] = database_url
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def record(principal: str, model: str, prompt: int, completion: int) -> UsageRecord:
    return usage_record(
        principal,
        prompt,
        completion,
        at=NOW,
        model=model,
        backend="upstream",
        memory_tokens=12,
        estimated=model == "echo",
        cost_micro=1_250_000 if model == "priced" else None,
    )


async def seed(data_dir: Path, database_url: str | None, *records: UsageRecord) -> None:
    pool = await open_pool(database_url) if database_url else None
    store = open_usage_store(data_dir, pool, database_url)
    try:
        await store.add(records)
    finally:
        await store.aclose()
        if pool is not None:
            await pool.close()


def test_usage_prints_the_table_and_csv(backend: str | None, tmp_path: Path) -> None:
    asyncio.run(
        seed(
            tmp_path,
            backend,
            record("alice", "priced", 1200, 34),
            record("alice", "echo", 10, 2),
            record("key:team", "priced", 5, 5),
        )
    )
    env = env_for(tmp_path, backend)

    done = run(env, "usage", "--group-by", "principal,model")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"usage from {MONTH}-01T00:00:00.000Z to ")
    assert lines[1].split() == [
        "principal",
        "model",
        "turns",
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "memory_tokens",
        "estimated_turns",
        "cost",
    ]
    assert lines[2].split() == ["alice", "echo", "1", "10", "2", "12", "12", "1", "-"]
    assert lines[3].split() == ["alice", "priced", "1", "1,200", "34", "1,234", "12", "0", "1.2500"]
    assert lines[4].split() == ["key:team", "priced", "1", "5", "5", "10", "12", "0", "1.2500"]
    assert lines[5].split() == ["total", "3", "1,215", "41", "1,256", "36", "1", "2.5000"]

    done = run(env, "usage", "--group-by", "model", "--principal", "alice", "--csv")
    assert done.returncode == 0, done.stderr
    table = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [(r["model"], r["total_tokens"], r["cost"]) for r in table] == [
        ("echo", "12", ""),
        ("priced", "1234", "1.25"),
    ]


def test_usage_of_a_period_still_to_come_is_an_empty_table(tmp_path: Path) -> None:
    asyncio.run(seed(tmp_path, None, record("alice", "priced", 1200, 34)))
    tomorrow = (NOW + timedelta(days=1)).strftime("%Y-%m-%d")

    done = run(env_for(tmp_path, None), "usage", "--from", tomorrow)

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    since = f"{tomorrow}T00:00:00.000Z"
    assert lines[0] == f"usage from {since} to {since}"
    assert lines[2].split() == ["0", "0", "0", "0", "0", "0", "-"]


def test_usage_refuses_a_bad_query_in_one_line(tmp_path: Path) -> None:
    env = env_for(tmp_path, None)
    for args, said in (
        (("--group-by", "colour"), "cannot group by 'colour'"),
        (("--from", "yesterday"), "'yesterday' is not a date (YYYY-MM-DD)"),
        (("--from", "2026-12-02", "--to", "2026-12-01"), "'to' must be after 'from'"),
    ):
        done = run(env, "usage", *args)
        assert done.returncode == 2
        line = done.stderr.strip().splitlines()
        assert len(line) == 1 and line[0].startswith(f"arona-gateway: error: {said}"), line


def test_budgets_are_set_listed_and_cleared(backend: str | None, tmp_path: Path) -> None:
    asyncio.run(seed(tmp_path, backend, record("key:team", "priced", 700, 300)))
    env = env_for(tmp_path, backend)

    assert run(env, "budget", "set", "key:team", "--tokens", "5000", "--cost", "20").stdout == (
        "budget of key:team: 5,000 tokens and cost 20.00 a month\n"
    )
    assert run(env, "budget", "set", "--default", "--tokens", "100").returncode == 0
    listed = run(env, "budget", "list")
    assert listed.stdout.splitlines() == [
        f"budgets for {MONTH} (UTC):",
        "  every principal without its own (default): 100 tokens",
        "  key:team: 5,000 tokens and cost 20.00; spent 1,000 tokens, cost 1.25",
    ]
    assert run(env, "budget", "clear", "key:team").stdout == "budget of key:team removed\n"
    assert run(env, "budget", "clear", "key:team").stdout == "key:team had no budget\n"

    async def stored() -> dict[str, Budget]:
        pool = await open_pool(backend) if backend else None
        store = open_usage_store(tmp_path, pool, backend)
        try:
            return await store.budgets()
        finally:
            await store.aclose()
            if pool is not None:
                await pool.close()

    assert asyncio.run(stored()) == {"": Budget(tokens=100)}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("set", "key:team"), "give --tokens, --cost or both"),
        (("set", "key:team", "--tokens", "0"), "--tokens must be a positive whole number"),
        (("set", "--tokens", "10"), "name a PRINCIPAL or give --default (one of the two)"),
        (("set", "alice", "--default", "--tokens", "10"), "name a PRINCIPAL or give --default"),
        (("set", "two words", "--tokens", "10"), "PRINCIPAL must be a principal"),
    ],
)
def test_a_bad_budget_is_one_line(tmp_path: Path, args: tuple[str, ...], said: str) -> None:
    done = run(env_for(tmp_path, None), "budget", *args)

    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert said in done.stderr.strip().splitlines()[-1]


def test_migrate_brings_the_usage_file_up_to_date(tmp_path: Path) -> None:
    done = run(env_for(tmp_path, None), "migrate")

    assert done.returncode == 0, done.stderr
    assert (tmp_path / USAGE_FILE).exists()
