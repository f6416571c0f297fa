"""Shared state on PostgreSQL end to end: whole messages, a database lost and back, start-up."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.e2e.stack import running_stack
from tests.support.fake_upstream import Complete, Stream
from tests.support.postgres import PgCluster, pg_cluster

COMMAND = str(Path(sys.executable).parent / "arona-gateway")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = {"role": "user", "content": [{"type": "text", "text": "Weather in Lyon?"}], "name": "mia"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Lyon"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_7", "content": '{"temp": 21.5}'}
STREAMED_CALL = [
    {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_7",
                "type": "function",
                "function": {"name": "weather", "arguments": ""},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Lyon"}'}}]},
]


@pytest.fixture
def own_cluster() -> Iterator[PgCluster]:
    with pg_cluster() as cluster:
        yield cluster


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_round_trip_replays_what_was_said(
    tmp_path: Path, backend: str | None, stream: bool
) -> None:
    async with running_stack(tmp_path, database_url=backend) as stack:
        conversation = await stack.create_conversation("rest")
        if stream:
            stack.upstream.script(Stream(deltas=STREAMED_CALL), Complete(content="21.5 °C"))
        else:
            stack.upstream.script(Complete(message=CALL, finish_reason="tool_calls"))
            stack.upstream.script(Complete(content="21.5 °C"))
        first: dict[str, Any] = {
            "model": "fake-model",
            "messages": [ASK],
            "tools": TOOLS,
            "memory": False,
            "conversation_id": conversation,
            "stream": stream,
        }
        if stream:
            async with stack.http.stream("POST", "/v1/chat/completions", json=first) as response:
                assert response.status_code == 200
                await response.aread()
        else:
            response = await stack.http.post("/v1/chat/completions", json=first)
            assert response.status_code == 200
            assert response.json()["choices"][0]["message"] == CALL
        second = await stack.http.post(
            "/v1/chat/completions",
            json={
                "model": "fake-model",
                "messages": [RESULT],
                "tools": TOOLS,
                "memory": False,
                "conversation_id": conversation,
            },
        )
        assert second.status_code == 200, second.text
        # The upstream got the history exactly as it was said: the tool call and its id.
        assert stack.upstream.last_body["messages"] == [ASK, CALL, RESULT]
        stored = await stack.http.get(f"/v1/conversations/{conversation}")
        assert stored.json()["messages"] == [
            ASK,
            CALL,
            RESULT,
            {"role": "assistant", "content": "21.5 °C"},
        ]


@pytest.mark.asyncio
async def test_the_database_lost_and_back_under_a_running_gateway(
    tmp_path: Path, own_cluster: PgCluster
) -> None:
    url = own_cluster.create_database()
    async with running_stack(tmp_path, database_url=url) as stack:
        conversation = await stack.create_conversation("rest")
        turn = {"role": "user", "content": "hello"}
        ok = await stack.turn("rest", [turn], conversation_id=conversation)
        assert ok.status == 200

        await asyncio.to_thread(own_cluster.stop, "fast")
        for surface in ("rest", "sse", "rpc"):
            lost = await stack.turn(surface, [turn], conversation_id=conversation)
            if surface == "rpc":
                error = lost.body["error"]
                assert (error["code"], error["data"]) == (-32000, {"code": "database_unavailable"})
            else:
                assert lost.status == 503
                assert lost.body["error"]["code"] == "database_unavailable"
                assert lost.body["error"]["type"] == "service_unavailable"
            assert "postgres" not in str(lost.body)
        # A turn that needs no database goes on unchanged.
        plain = await stack.turn("rest", [turn])
        assert plain.status == 200
        # The episode index is in the same database.
        listed = await stack.rpc("memory.list")
        assert (listed["error"]["code"], listed["error"]["data"]) == (
            -32000,
            {"code": "database_unavailable"},
        )

        await asyncio.to_thread(own_cluster.start)
        back = await stack.turn("rest", [turn], conversation_id=conversation)
        assert back.status == 200
        history = await stack.http.get(f"/v1/conversations/{conversation}")
        assert [m["content"] for m in history.json()["messages"]].count("hello") == 2


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(data_dir), ARONA_HTTP_PORT="0", ARONA_GRPC_PORT="0", **extra)
    return env


def test_an_unreachable_database_at_start_is_one_line(tmp_path: Path) -> None:
    from tests.support.raw_philia import closed_port

    url = f"postgresql://arona:s3cret-pw@127.0.0.1:{closed_port()}/arona"
    done = subprocess.run(
        [COMMAND, "serve"],
        env=_env(tmp_path, ARONA_DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("arona-gateway: error: the database at postgresql://***@127.0.0.1")
    assert "Traceback" not in done.stderr
    assert "s3cret-pw" not in done.stderr + done.stdout


def test_migrate_applies_the_schema_once(tmp_path: Path, database_url: str) -> None:
    env = _env(tmp_path, ARONA_DATABASE_URL=database_url)
    first = subprocess.run(
        [COMMAND, "migrate"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert first.returncode == 0, first.stderr
    assert "applied migration 1:" in first.stdout
    again = subprocess.run(
        [COMMAND, "migrate"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert again.returncode == 0
    assert "the schema is up to date" in again.stdout


async def _execute(url: str, *statements: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_a_role_that_may_not_create_tables_is_told_how_to_fix_it(
    tmp_path: Path, database_url: str
) -> None:
    """The newcomer's slip: a database created without OWNER (PostgreSQL 15 and later let
    only its owner create tables in it)."""
    role, password = f"r_{uuid.uuid4().hex[:12]}", "n0-create-pw"
    asyncio.run(
        _execute(
            database_url,
            f"CREATE ROLE {role} LOGIN PASSWORD '{password}'",
            "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        )
    )
    parts = urlsplit(database_url)
    url = urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port}"))
    try:
        for command in ("migrate", "serve"):
            done = subprocess.run(
                [COMMAND, command],
                env=_env(tmp_path, ARONA_DATABASE_URL=url),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            line = _one_line_error(done)
            assert line.startswith("arona-gateway: error: postgresql://***@"), line
            assert "permission denied for schema public" in line
            assert "must own the database (CREATE DATABASE ... OWNER <role>)" in line
            assert password not in done.stderr + done.stdout
    finally:
        asyncio.run(_execute(database_url, f"DROP ROLE {role}"))


def test_a_schema_newer_than_this_version_is_one_line(tmp_path: Path, database_url: str) -> None:
    env = _env(tmp_path, ARONA_DATABASE_URL=database_url)
    first = subprocess.run(
        [COMMAND, "migrate"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert first.returncode == 0, first.stderr
    asyncio.run(
        _execute(database_url, "INSERT INTO arona_schema (version, name) VALUES (999, 'later')")
    )
    for command in ("migrate", "serve"):
        done = subprocess.run(
            [COMMAND, command], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        line = _one_line_error(done)
        assert "the database schema (version 999) is newer than this version knows" in line
