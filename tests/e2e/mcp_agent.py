"""An agent on the official MCP client: over Streamable HTTP to a gateway's ``/mcp`` with a
bearer, or over stdio to ``arona-gateway mcp`` launched as a command, as agents do."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any

import httpx2
import mcp_types as types
import orjson
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from tests.support.served import COMMAND


@dataclass
class Agent:
    session: ClientSession

    async def call(
        self, tool: str, arguments: dict[str, Any] | None = None
    ) -> types.CallToolResult:
        return await self.session.call_tool(tool, arguments or {})

    async def ok(self, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """A call that must succeed: its structured content, which its text says too."""
        result = await self.call(tool, arguments)
        assert not result.is_error, result.content
        payload: dict[str, Any] = result.structured_content
        text = result.content[0]
        assert isinstance(text, types.TextContent)
        assert orjson.loads(text.text) == payload
        return payload

    async def refused(self, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """A call that must be a tool error: ``{"error", "reason"}``, the reason as its text."""
        result = await self.call(tool, arguments)
        assert result.is_error, result.structured_content
        payload: dict[str, Any] = result.structured_content
        assert set(payload) == {"error", "reason"}
        text = result.content[0]
        assert isinstance(text, types.TextContent) and text.text == payload["reason"]
        return payload

    async def tools(self) -> dict[str, types.Tool]:
        return {tool.name: tool for tool in (await self.session.list_tools()).tools}


def bearer_headers(bearer: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}


@contextlib.asynccontextmanager
async def http_agent(base_url: str, bearer: str | None) -> AsyncIterator[Agent]:
    """An agent with a session over Streamable HTTP to ``base_url``'s ``/mcp``."""
    async with (
        httpx2.AsyncClient(headers=bearer_headers(bearer), timeout=30.0) as http,
        streamable_http_client(base_url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield Agent(session)


@contextlib.asynccontextmanager
async def stdio_agent(env: dict[str, str], errlog: IO[str]) -> AsyncIterator[Agent]:
    """An agent that launched ``arona-gateway mcp`` with ``env`` (its stderr into ``errlog``)."""
    params = StdioServerParameters(
        command=COMMAND,
        args=["mcp"],
        # This checkout's code in the launched command, as the rest of the tests run it.
        env={"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env},
    )
    async with (
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield Agent(session)
