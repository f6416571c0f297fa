"""The direct path of ``/mcp``: a lone ``tools/call`` of the handshake-era protocol, answered
without the SDK's per-request transport.

Stateless Streamable HTTP with JSON answers makes every POST a transport of its own in the
SDK: memory streams, a dispatcher, a task for the exchange, a connection, for one request that
needs none of them. Measured on two loaded cores, that machinery cost more than the gRPC
``Recall`` behind ``search_memories`` (bench/results/mcp.md). So the one message agents send
all the time, ``tools/call`` on its own in a POST of a handshake-era revision (or of none:
the spec's default), whose answer is one JSON object, is answered here with the SDK's own
types and the same tool runner (:class:`~gateway_http.mcp.server.ToolCalls`); the answer is
the JSON-RPC response the SDK writes for it. Everything else (``initialize``, ``tools/list``,
notifications, batches, the per-request revision, anything malformed) goes to the SDK,
the body replayed as it came.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_REQUEST
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.responses import Response
from starlette.types import Message, Receive

from gateway_http.mcp.server import ToolCalls

_VERSION = b"mcp-protocol-version"
_ACCEPT = b"accept"
_CONTENT_TYPE = b"content-type"
_SESSION = b"mcp-session-id"
_HANDSHAKE = frozenset(version.encode() for version in HANDSHAKE_PROTOCOL_VERSIONS)


@dataclass(frozen=True)
class ToolCall:
    id: str | int
    name: str
    arguments: dict[str, Any] | None


def eligible(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a POST's headers allow the direct path: a handshake-era revision (or none), a
    JSON body, a JSON answer accepted, and no session named (the SDK says what to do with
    one)."""
    accept = content_type = b""
    for key, value in headers:
        if key == _VERSION and value not in _HANDSHAKE:
            return False
        if key == _SESSION:
            return False
        if key == _ACCEPT:
            accept = value
        elif key == _CONTENT_TYPE:
            content_type = value
    return b"application/json" in accept and content_type.startswith(b"application/json")


def tool_call(body: bytes) -> ToolCall | None:
    """The ``tools/call`` request ``body`` is, alone and well formed; None for anything else."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(message, dict) or set(message) != {"jsonrpc", "id", "method", "params"}:
        return None
    request_id, params = message["id"], message["params"]
    if (
        message["jsonrpc"] != "2.0"
        or message["method"] != "tools/call"
        or isinstance(request_id, bool)
        or not isinstance(request_id, str | int)
        or not isinstance(params, dict)
        or not set(params) <= {"name", "arguments"}
    ):
        return None
    name, arguments = params.get("name"), params.get("arguments")
    if not isinstance(name, str) or not (arguments is None or isinstance(arguments, dict)):
        return None
    return ToolCall(request_id, name, arguments)


def _json(payload: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def answer(calls: ToolCalls, scope: Mapping[str, Any], call: ToolCall) -> Response:
    """The JSON-RPC response to ``call``: the tool's result, or the protocol's error."""
    try:
        result = await calls.call(scope, call.name, call.arguments)
    except MCPError as exc:
        error = exc.error.model_dump(by_alias=True, mode="json", exclude_none=True)
        return _json({"jsonrpc": "2.0", "id": call.id, "error": error})
    dumped = result.model_dump(
        by_alias=True, mode="json", exclude_none=True, exclude={"result_type"}
    )
    return _json({"jsonrpc": "2.0", "id": call.id, "result": dumped})


def too_large(limit: int) -> Response:
    """What the SDK answers to a body over its limit."""
    error = {"code": INVALID_REQUEST, "message": f"Request body exceeds {limit} bytes"}
    return _json({"jsonrpc": "2.0", "id": None, "error": error}, status=413)


def replayed(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives ``body`` (already read) first."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
