"""The MCP server of the gateway: the memory tools run for the caller of each HTTP request.

:func:`build_server` makes the SDK's low-level ``Server`` with a ``tools/list`` and a
``tools/call`` handler. The caller (its principal, or None for the anonymous caller of an open
shared gateway) was settled by :mod:`gateway_http.mcp.endpoint` before any MCP message was read
and rides in the request's ASGI scope; :class:`MemoryTools` then acts on exactly the memory a
chat turn of that caller uses (``memory_scope`` in :mod:`gateway_http.auth`), through the
gateway's one :class:`~gateway_http.memory_client.MemoryClient`, as the JSON-RPC memory methods
do.

Every call is one server span (``tools/call <tool>``, the child of the request's
``traceparent``), one count in ``arona_mcp_tool_calls`` and runs under the request's id. No
failure escapes as a protocol error: bad arguments, a memory offline, a refusal are tool errors
with a reason; an unexpected one is a tool error saying so, its traceback logged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from arona_common import tracing
from arona_common.database import DatabaseUnavailable
from arona_grpc.logs import REQUEST_ID
from gateway_http.auth import Principal, memory_scope
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.mcp import tools
from gateway_http.mcp.tools import ToolFailure
from gateway_http.memory_client import NOT_INDEXED, OFFLINE, OTHER_SCOPE, ForgetTarget
from gateway_http.messages import without_injected_sections
from gateway_http.metrics import GatewayMetrics
from gateway_http.state import Gateway
from gateway_http.views import database_unavailable

logger = logging.getLogger(__name__)

SERVER_NAME = "arona-memory"
TRACER = tracing.Tracer("gateway_http")
# Where the endpoint leaves the caller and the request id in the request's ASGI scope: the
# tools run in the session manager's tasks, not in the request's context.
CALLER_KEY = "arona.mcp.caller"
REQUEST_ID_KEY = "arona.request_id"
# delete_memory's reason when the id is not one of the caller's (whether it is another's or
# nobody's is not the caller's business), as memory.delete says it.
NOT_YOURS = "not_yours"
# How each tool call ended, the `outcome` label of arona_mcp_tool_calls.
OK = "ok"
CLIENT_ERROR = "client_error"
MEMORY_ERROR = "memory_error"
INTERNAL = "internal"
# Failures that are the memory's, not the caller's.
_MEMORY_KINDS = (ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, ErrorKind.NOT_CONFIGURED)


@dataclass(frozen=True)
class Caller:
    """Whose memory a tool acts on: a principal, or nobody (an open shared gateway's caller
    without a bearer, whose memory is that of REST's anonymous turns)."""

    principal: Principal | None

    @property
    def scope(self) -> str:
        """The scope a chat turn of this caller recalls from and writes to ("" for nobody)."""
        return memory_scope(self.principal, None) or ""


class MemoryTools:
    """The five tools over one running gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    async def call(self, tool: str, caller: Caller, arguments: dict[str, Any] | None) -> Any:
        """Run ``tool``; its payload, or :class:`ToolFailure` /
        :class:`~gateway_http.errors.GatewayError` for the agent to read."""
        checked = tools.checked_arguments(tool, arguments)
        run: Callable[[Any, Caller], Awaitable[dict[str, Any]]] = getattr(self, "_" + tool)
        return await run(checked, caller)

    async def _search_memories(self, args: tools.SearchArguments, caller: Caller) -> dict[str, Any]:
        recall = await self._gw.memory.recall_detail(args.query, args.limit, caller.scope)
        if recall.state == OFFLINE:
            raise ToolFailure(
                "memory_offline",
                "memory is offline: the memory service did not answer in time; nothing was "
                "searched, try again shortly",
            )
        return {
            "query": args.query,
            "state": recall.state,
            "memories": [
                {
                    "node_id": m.node_id or None,
                    "text": m.text,
                    "score": m.score,
                    "node_type": m.node_type,
                }
                for m in recall.memories
            ],
            "section": recall.section,
        }

    async def _add_memory(self, args: tools.AddArguments, caller: Caller) -> dict[str, Any]:
        text = args.text
        if not without_injected_sections(text).strip():
            raise ToolFailure(
                "nothing_to_store",
                "nothing to store: the text is only a '## Relevant Long-Term Memories' "
                "section, and recalled memories are never stored again",
            )
        scope = caller.scope
        settings = self._gw.settings
        # The same text of the same caller is the same episode: an agent that retries (after
        # a timeout, or a 'queued' answer) never stores it twice.
        digest = hashlib.sha256(f"{scope}\0{text}".encode()).hexdigest()[:32]
        kept = await self._gw.memory.keep_episode(
            text, "", scope, f"mcp-{digest}", None, settings.memory_timeout_s + 1.0
        )
        if kept.queued:
            raise ToolFailure(
                "memory_offline",
                "memory is offline: the memory is kept in the gateway's outbox and will be "
                "stored when memory answers again (adding it again is safe: it is not kept "
                "twice)",
            )
        if not kept.stored:
            raise ToolFailure(
                "memory_off",
                "nothing was stored: this gateway has no memory configured, or its writeback "
                "is off (ARONA_MEMORY_WRITEBACK=false)",
            )
        # Read-your-write: the memory service answered once the episode was in its index.
        return {"stored": True, "node_id": kept.node_id}

    async def _list_memories(self, args: tools.ListArguments, caller: Caller) -> dict[str, Any]:
        scope = caller.scope
        # The turns this process just answered are listed too (as memory.list does).
        await self._gw.pipeline.writebacks_settled(scope)
        page = await self._gw.memory.list_episodes(
            scope,
            args.limit,
            args.before or "",
            anonymous=caller.principal is None,
            contains=args.contains or "",
        )
        return {"memories": page["memories"], "next": page["next"]}

    async def _delete_memory(self, args: tools.DeleteArguments, caller: Caller) -> dict[str, Any]:
        deleted, reason = await self._gw.memory.delete(args.node_id, caller.scope, own=True)
        if deleted:
            return {"deleted": True, "node_id": args.node_id}
        if reason in (NOT_INDEXED, OTHER_SCOPE):
            reason = NOT_YOURS
        return {"deleted": False, "node_id": args.node_id, "reason": reason}

    async def _forget_memories(self, args: tools.ForgetArguments, caller: Caller) -> dict[str, Any]:
        # As memory.forget {}: the caller's scope (nobody's: the anonymous turns'), and the
        # owner's conversations with it.
        if caller.principal is None:
            target, settled = ForgetTarget(anonymous=True), ""
        else:
            target, settled = ForgetTarget(scope=caller.scope), caller.scope
        await self._gw.pipeline.writebacks_settled(settled)
        deleted = await self._gw.memory.forget(target)
        conversations = 0
        if target.owner:
            conversations = await self._gw.conversations.forget(target.owner)
        return {"deleted": deleted, "conversations": conversations}


def caller_in(scope: Mapping[str, Any]) -> Caller:
    """The caller the endpoint authenticated for the HTTP request of ASGI ``scope``."""
    principal = scope.get(CALLER_KEY)
    return Caller(principal if isinstance(principal, Principal) else None)


def _outcome_of(exc: GatewayError) -> str:
    return MEMORY_ERROR if exc.kind in _MEMORY_KINDS else CLIENT_ERROR


class ToolCalls:
    """A tool call of one HTTP request: run as its caller, under its request id, in its own
    span, counted; the SDK's ``tools/call`` handler and the endpoint's direct path
    (:mod:`gateway_http.mcp.endpoint`) both come here."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    async def call(
        self, scope: Mapping[str, Any], name: str, arguments: dict[str, Any] | None
    ) -> types.CallToolResult:
        """The tool's result (a tool error included); :class:`MCPError` for a tool that does
        not exist, the protocol's own answer to that."""
        if name not in tools.TOOL_NAMES:
            raise MCPError(INVALID_PARAMS, f"Unknown tool: {name}")
        token = REQUEST_ID.set(scope.get(REQUEST_ID_KEY))
        try:
            with _tool_span(name, scope) as span:
                answer, outcome = await self._run(scope, name, arguments)
                if outcome != OK:
                    tracing.failed(span, outcome)
            self._metrics.mcp_tool_call(name, outcome)
            return answer
        finally:
            REQUEST_ID.reset(token)

    async def _run(
        self, scope: Mapping[str, Any], name: str, arguments: dict[str, Any] | None
    ) -> tuple[types.CallToolResult, str]:
        try:
            gateway: Gateway = scope["app"].state.gateway
            payload = await MemoryTools(gateway).call(name, caller_in(scope), arguments)
        except ToolFailure as exc:
            outcome = MEMORY_ERROR if exc.error.startswith("memory_") else CLIENT_ERROR
            return tools.failure(exc.error, exc.reason), outcome
        except GatewayError as exc:
            # The memory service's word on an argument (a cursor it did not give) is the
            # caller's mistake like any other.
            error = "invalid_arguments" if exc.kind == ErrorKind.BAD_INPUT else exc.code
            return tools.failure(error, exc.message), _outcome_of(exc)
        except DatabaseUnavailable:
            # Said once per outage by arona_common.database; here only its answer.
            down = database_unavailable()
            return tools.failure(down.code, down.message), MEMORY_ERROR
        except Exception:
            # The traceback is for the operator; the agent learns only that it failed.
            logger.exception("MCP tool %s failed", name)
            return tools.failure("internal_error", "internal error"), INTERNAL
        return tools.result(payload), OK


def build_server(calls: ToolCalls, version: str) -> Server[Any]:
    """The low-level MCP server; each call finds the running gateway on its request's app."""

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools.tool_list())

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        request = ctx.request
        scope: Mapping[str, Any] = request.scope if request is not None else {}
        return await calls.call(scope, params.name, params.arguments)

    schemas = {tool.name: tool.input_schema for tool in tools.tool_list()}
    server: Server[Any] = Server(
        SERVER_NAME,
        version=version,
        title="Arona memory",
        instructions=tools.INSTRUCTIONS,
        # The per-request protocol checks a call's routing headers against its tool's schema:
        # from this table, not from a tools/list built again for every call.
        get_tool_input_schema=schemas.get,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
    # The SDK's own span per message goes to OpenTelemetry's global provider, which the
    # gateway never sets (arona_common.tracing keeps its own): a cost for nothing. Each tool
    # call is the gateway's own span instead (_tool_span).
    server.middleware = []
    return server


def _tool_span(name: str, scope: Mapping[str, Any]) -> Any:
    """A tool call's server span, continuing the HTTP request's ``traceparent``."""
    if not tracing.active():
        return tracing.NO_SPAN
    return TRACER.span(
        f"tools/call {name}",
        kind=tracing.SERVER,
        parent=tracing.extract(tracing.headers_carrier(scope.get("headers", ()))),
        attributes={
            "mcp.method.name": "tools/call",
            "gen_ai.tool.name": name,
            "arona.request_id": scope.get(REQUEST_ID_KEY) or "",
        },
    )
