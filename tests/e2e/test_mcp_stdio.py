"""``arona-gateway mcp``, the memory tools over stdio, launched by the official MCP client as an
agent launches a command, bridged to a real ``arona-gateway serve`` process over the real
embedded store."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from arona_store.server import StoreServer
from tests.e2e.mcp_agent import stdio_agent
from tests.e2e.scoped import API_KEYS, BARE_KEY, HEADER, JWT_SECRET, STORE_TOKEN, TEAM_A_KEY
from tests.support.served import Served, run, served

pytestmark = pytest.mark.asyncio

FACT = "my deploy key rotates on Fridays"
ASK = "when does my deploy key rotate?"
UNREACHABLE = "cannot reach the gateway at"


@contextlib.asynccontextmanager
async def gateway(data_dir: Path) -> AsyncIterator[tuple[Served, StoreServer]]:
    """``arona-gateway serve`` in user scope mode with two keys, on an embedded store."""
    store = await StoreServer.start(db_path=data_dir / "memory.db", token=STORE_TOKEN)
    try:
        env = {
            "ARONA_MEMORY_URL": store.url,
            "ARONA_MEMORY_TOKEN": STORE_TOKEN,
            "ARONA_MEMORY_SCOPE": "user",
            "ARONA_API_KEYS": ",".join(API_KEYS),
            "ARONA_JWT_SECRET": JWT_SECRET,
        }
        async with served(data_dir, env=env) as process:
            yield process, store
    finally:
        await store.stop()


def _bridge_env(url: str, token: str) -> dict[str, str]:
    return {"ARONA_MCP_URL": url, "ARONA_MCP_TOKEN": token}


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _read(errlog: IO[str]) -> list[str]:
    errlog.seek(0)
    return errlog.read().splitlines()


async def test_an_agent_that_launches_the_command_shares_memory_with_chat_turns(
    tmp_path: Path,
) -> None:
    async with (
        gateway(tmp_path) as (process, store),
        httpx.AsyncClient(base_url=process.url, timeout=30.0) as http,
    ):
        mcp_url = process.url + "/mcp"
        with tempfile.TemporaryFile("w+") as errlog:
            async with stdio_agent(_bridge_env(mcp_url, TEAM_A_KEY), errlog) as agent:
                assert set(await agent.tools()) == {
                    "search_memories",
                    "add_memory",
                    "list_memories",
                    "delete_memory",
                    "forget_memories",
                }
                added = await agent.ok("add_memory", {"text": FACT})
                await store.wait_embedded()

                # A chat turn of the same key recalls it (the echo model shows its section).
                turn = await http.post(
                    "/v1/chat/completions",
                    json={"model": "echo", "messages": [{"role": "user", "content": ASK}]},
                    headers={"Authorization": f"Bearer {TEAM_A_KEY}"},
                )
                assert turn.headers["x-arona-memory"] == "enabled"
                assert FACT in turn.json()["choices"][0]["message"]["content"]

                found = await agent.ok("search_memories", {"query": ASK})
                assert found["section"].startswith(HEADER)
                assert added["node_id"] in [m["node_id"] for m in found["memories"]]
                # The turn is listed too, newest first.
                listed = await agent.ok("list_memories")
                assert ASK in listed["memories"][0]["preview"]
                assert listed["memories"][1]["node_id"] == added["node_id"]

                refused = await agent.refused("search_memories", {"query": ASK, "limit": 0})
                assert refused["error"] == "invalid_arguments"

            async with stdio_agent(_bridge_env(mcp_url, BARE_KEY), errlog) as other:
                # Another key, another memory: the gateway's scopes, not the bridge's.
                assert (await other.ok("search_memories", {"query": ASK}))["memories"] == []
                refused = await other.ok("delete_memory", {"node_id": added["node_id"]})
                assert refused["reason"] == "not_yours"
            assert not [line for line in _read(errlog) if UNREACHABLE in line]


async def test_a_gateway_that_cannot_be_reached_is_said_once_and_each_call_says_why(
    tmp_path: Path,
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/mcp"
    with tempfile.TemporaryFile("w+") as errlog:
        async with stdio_agent(_bridge_env(url, TEAM_A_KEY), errlog) as agent:
            # The tools are listed all the same, so the agent knows what it will have.
            assert "search_memories" in await agent.tools()
            for _ in range(2):
                refused = await agent.refused("add_memory", {"text": FACT})
                assert refused["error"] == "gateway_unreachable"
                assert url in refused["reason"]
        lines = _read(errlog)
    said = [line for line in lines if UNREACHABLE in line]
    assert len(said) == 1, lines
    assert TEAM_A_KEY not in "\n".join(lines)


async def test_a_bearer_the_gateway_refuses_is_a_tool_error_that_says_so(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path) as (process, _):
        with tempfile.TemporaryFile("w+") as errlog:
            env = _bridge_env(process.url + "/mcp", "not-a-key-of-this-gateway")
            async with stdio_agent(env, errlog) as agent:
                refused = await agent.refused("list_memories")
                assert refused["error"] == "gateway_refused"
                assert "ARONA_MCP_TOKEN" in refused["reason"]
            lines = _read(errlog)
    assert len([line for line in lines if "refused the bearer" in line]) == 1
    assert "not-a-key-of-this-gateway" not in "\n".join(lines)


async def test_a_url_that_is_not_http_is_one_line_and_exit_2(tmp_path: Path) -> None:
    code, err = await run(tmp_path, "mcp", env={"ARONA_MCP_URL": "ws://127.0.0.1:1/mcp"})
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "ARONA_MCP_URL" in err
