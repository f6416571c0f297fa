"""``mcp``: the memory tools over stdio for an agent that launches a command, bridged to a
gateway's ``/mcp`` (what the bridge needs is read from the environment, so that an agent's server
configuration carries it; :mod:`gateway_http.mcp.bridge` runs it)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

COMMAND = "mcp"


def mcp_parser(sub: Any) -> None:
    sub.add_parser(
        COMMAND,
        help="serve the memory tools over stdio (MCP), bridged to a gateway's /mcp",
        description="Serve the memory tools over stdio for an agent that launches a command. "
        "Every call goes to the gateway's /mcp at ARONA_MCP_URL (default "
        "http://127.0.0.1:8080/mcp) with ARONA_MCP_TOKEN (an API key or a JWT) as its bearer. "
        "Logs go to stderr.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def mcp_command(env: Mapping[str, str]) -> int:
    from gateway_http.mcp.bridge import bridge_command

    return bridge_command(env)
