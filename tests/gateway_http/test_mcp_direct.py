"""Which POSTs to ``/mcp`` the direct path answers, and which go to the MCP SDK: only a lone,
well-formed ``tools/call`` of the handshake-era protocol is taken; anything the SDK has more to
say about (sessions, the per-request revision, batches, notifications, ``_meta``) is not."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway_http.mcp.direct import ToolCall, eligible, tool_call

JSON = (b"content-type", b"application/json")
ACCEPT = (b"accept", b"application/json, text/event-stream")


@pytest.mark.parametrize(
    ("headers", "taken"),
    [
        ([JSON, ACCEPT], True),
        ([JSON, ACCEPT, (b"mcp-protocol-version", b"2025-11-25")], True),
        ([JSON, ACCEPT, (b"mcp-protocol-version", b"2025-03-26")], True),
        ([(b"content-type", b"application/json; charset=utf-8"), ACCEPT], True),
        ([JSON, ACCEPT, (b"mcp-protocol-version", b"2026-07-28")], False),
        ([JSON, ACCEPT, (b"mcp-protocol-version", b"1999-01-01")], False),
        ([JSON, ACCEPT, (b"mcp-session-id", b"abc")], False),
        ([JSON, (b"accept", b"text/event-stream")], False),
        ([JSON], False),
        ([(b"content-type", b"text/plain"), ACCEPT], False),
    ],
)
def test_only_handshake_era_json_posts_without_a_session_are_eligible(
    headers: list[tuple[bytes, bytes]], taken: bool
) -> None:
    assert eligible(headers) is taken


def _call(**changes: Any) -> bytes:
    message: dict[str, Any] = {
        "jsonrpc": "2.0",
        "id": 3,
        "method": "tools/call",
        "params": {"name": "search_memories", "arguments": {"query": "tea"}},
    }
    message.update(changes)
    return orjson.dumps({k: v for k, v in message.items() if v is not None})


def test_a_lone_tool_call_is_taken() -> None:
    assert tool_call(_call()) == ToolCall(3, "search_memories", {"query": "tea"})
    assert tool_call(_call(id="a")) == ToolCall("a", "search_memories", {"query": "tea"})
    no_arguments = _call(params={"name": "forget_memories"})
    assert tool_call(no_arguments) == ToolCall(3, "forget_memories", None)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[" + _call() + b"]",
        _call(id=True),
        _call(id=None),
        _call(id=1.5),
        _call(jsonrpc="1.0"),
        _call(method="tools/list"),
        _call(method="initialize"),
        _call(params=None),
        _call(params=["search_memories"]),
        _call(params={"name": 7, "arguments": {}}),
        _call(params={"name": "search_memories", "arguments": ["tea"]}),
        _call(params={"name": "search_memories", "arguments": {}, "_meta": {"progressToken": 1}}),
        orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        orjson.dumps({"jsonrpc": "2.0", "id": 3, "result": {}}),
    ],
)
def test_anything_else_is_left_to_the_sdk(body: bytes) -> None:
    assert tool_call(body) is None
