"""``arona-gateway mcp``: the memory tools over stdio, for agents that launch a command.

It is a bridge, not a second server: every ``tools/list`` and ``tools/call`` it reads on stdin
is sent to a running gateway's ``/mcp`` (``ARONA_MCP_URL``) with the caller's bearer
(``ARONA_MCP_TOKEN``, an API key or a JWT), and the gateway's answer is written back unchanged.
Authentication, scopes and limits stay in the gateway; the bridge holds no memory and no
secret but the bearer it forwards.

Each call is one POST of the per-request protocol revision (no handshake, no session), over one
pooled HTTP client: a gateway that restarts, or starts after the agent, is simply reached by the
next call. While it cannot be reached (or refuses the bearer), ``tools/list`` answers the tools
as this version knows them and each call is a tool error saying why; the bridge says so on
stderr in one line when it happens, and in one line when the gateway answers again. Nothing
but MCP ever goes to stdout: logs go to stderr, the bearer masked in them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import LATEST_MODERN_VERSION

from arona_common.redact import redact_url
from arona_grpc.logs import configure_logging
from gateway_http.errors import TABLE, ErrorKind
from gateway_http.mcp import tools
from gateway_http.mcp.server import SERVER_NAME

logger = logging.getLogger(__name__)

URL_ENV = "ARONA_MCP_URL"
TOKEN_ENV = "ARONA_MCP_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080/mcp"
# Connecting to a gateway that is there takes milliseconds; forgetting thousands of memories
# takes minutes (gateway_http.memory_client.FORGET_TIMEOUT_S), so a call may wait that long.
CONNECT_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 330.0
_AUTH_CODE = TABLE[ErrorKind.AUTH].jsonrpc_code

T = TypeVar("T")


class GatewayDown(Exception):
    """The gateway cannot be reached, or refused the bearer: ``reason`` says which."""

    def __init__(self, error: str, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside an exception group (the SDK's transport raises in task groups)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


class GatewayLink:
    """Calls one gateway's ``/mcp`` as the bearer's holder; says when it goes and comes back."""

    def __init__(self, url: str, http: httpx2.AsyncClient) -> None:
        self._url = url
        self._shown = redact_url(url)
        self._http = http
        # Why the last call could not reach the gateway (None: it answered).
        self._down: str | None = None

    async def _call(self, work: Callable[[Client], Awaitable[T]]) -> T:
        transport = streamable_http_client(self._url, http_client=self._http)
        try:
            async with Client(transport, mode=LATEST_MODERN_VERSION, cache=None) as client:
                answer = await work(client)
        except BaseException as exc:
            self._failed(exc)
        if self._down is not None:
            logger.warning("the gateway at %s answers again", self._shown)
            self._down = None
        return answer

    def _failed(self, exc: BaseException) -> NoReturn:
        """Raise what the agent should hear of a failed call."""
        leaves = _leaves(exc)
        for leaf in leaves:
            if isinstance(leaf, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise exc
        for leaf in leaves:
            if isinstance(leaf, MCPError) and leaf.code == _AUTH_CODE:
                self._went_down(
                    "gateway_refused",
                    f"the gateway at {self._shown} refused the bearer in {TOKEN_ENV} "
                    f"({leaf.message})",
                )
            if isinstance(leaf, MCPError):
                # The gateway's own answer (an unknown tool): passed on as it is.
                raise leaf from None
        for leaf in leaves:
            if isinstance(leaf, httpx2.TransportError | OSError):
                self._went_down(
                    "gateway_unreachable",
                    f"cannot reach the gateway at {self._shown} ({type(leaf).__name__}: "
                    f"{str(leaf) or 'no details'}); is it running, and is {URL_ENV} its /mcp?",
                )
        logger.error("the call to the gateway at %s failed", self._shown, exc_info=exc)
        raise GatewayDown("bridge_error", "the call to the gateway failed (see the bridge's log)")

    def _went_down(self, error: str, reason: str) -> NoReturn:
        if self._down != reason:
            # One line per outage, not one per call.
            logger.warning("%s", reason)
            self._down = reason
        raise GatewayDown(error, reason)

    async def list_tools(self) -> types.ListToolsResult:
        return await self._call(lambda client: client.list_tools())

    async def call_tool(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        return await self._call(lambda client: client.call_tool(name, arguments))


def build_bridge(link: GatewayLink) -> Server[Any]:
    """The stdio server: the gateway's tools and answers, or, while it is away, this version's
    tools and tool errors that say why."""

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        try:
            return await link.list_tools()
        except GatewayDown:
            return types.ListToolsResult(tools=tools.tool_list())

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            return await link.call_tool(params.name, params.arguments)
        except GatewayDown as exc:
            return tools.failure(exc.error, exc.reason)

    return Server(
        SERVER_NAME,
        title="Arona memory",
        instructions=tools.INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _serve(url: str, token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    timeout = httpx2.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with create_mcp_http_client(headers=headers, timeout=timeout) as http:
        link = GatewayLink(url, http)
        # Said at once when the gateway is not there (the agent's log shows it).
        try:
            await link.list_tools()
        except (GatewayDown, MCPError):
            pass
        server = build_bridge(link)
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())


def bridge_command(env: Mapping[str, str]) -> int:
    """Run the bridge until stdin closes; 2 for a configuration it cannot use."""
    url = env.get(URL_ENV) or DEFAULT_URL
    token = env.get(TOKEN_ENV) or None
    configure_logging(env.get("ARONA_LOG_LEVEL") or "info", "text", (token,))
    # A line per call to the gateway says nothing the agent's own log does not.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        logger.error(
            "%s must be the http(s) URL of a gateway's /mcp, not %s", URL_ENV, redact_url(url)
        )
        return 2
    try:
        asyncio.run(_serve(url, token))
    except KeyboardInterrupt:
        return 130
    return 0
