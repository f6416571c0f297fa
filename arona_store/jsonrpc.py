"""JSON-RPC 2.0 framing for the embedded store: envelope validation, codes and reply frames.

Pure functions over text frames, no I/O, so the validation order is testable on its own:
parse error (-32700, id null) -> not an object (-32600, id null) -> bad id (-32600, id null)
-> bad ``jsonrpc``/``method`` (-32600, id echoed) -> non-object ``params`` (-32602 for an array,
because every method takes flat named params; -32600 otherwise).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import orjson

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
AUTH_REQUIRED = -32005

JsonId = str | int | float | None


class RpcError(Exception):
    """An error reply: ``code`` and a message that is safe to send to the peer."""

    def __init__(self, code: int, message: str, request_id: JsonId = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Call:
    """One validated request or notification."""

    method: str
    params: dict[str, Any]
    request_id: JsonId
    # JSON-RPC: a request without an ``id`` member is a notification and gets no reply.
    is_notification: bool


def _valid_id(value: object) -> bool:
    # bool is an int subclass in Python but not a valid id in JSON-RPC; NaN/Infinity could
    # not be echoed as valid JSON.
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or (isinstance(value, str | int) and not isinstance(value, bool))


def parse_call(text: str) -> Call:
    """Validate one text frame as a JSON-RPC 2.0 request; raises :class:`RpcError`."""
    try:
        message = orjson.loads(text)
    except orjson.JSONDecodeError:
        # orjson is stricter than JSON as Python reads it (lone surrogate escapes, NaN):
        # the standard parser decides those rare frames, so nothing parses differently.
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):
            raise RpcError(PARSE_ERROR, "Parse error") from None
    if not isinstance(message, dict):
        raise RpcError(INVALID_REQUEST, "Invalid Request: expected a JSON object")
    request_id = message.get("id")
    if not _valid_id(request_id):
        raise RpcError(INVALID_REQUEST, "Invalid Request: id must be a string, number or null")
    if message.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'Invalid Request: jsonrpc must be "2.0"', request_id)
    method = message.get("method")
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "Invalid Request: method must be a string", request_id)
    params = message.get("params", {})
    if params is None:
        params = {}
    if isinstance(params, list):
        raise RpcError(INVALID_PARAMS, "Invalid params: expected named params", request_id)
    if not isinstance(params, dict):
        raise RpcError(INVALID_REQUEST, "Invalid Request: params must be an object", request_id)
    return Call(
        method=method,
        params=params,
        request_id=request_id,
        is_notification="id" not in message,
    )


def _dump(message: dict[str, Any]) -> str:
    try:
        return orjson.dumps(message).decode()
    except TypeError:
        # Text with a lone surrogate is not UTF-8; the standard encoder escapes it.
        return json.dumps(message, separators=(",", ":"))


def result_frame(request_id: JsonId, result: dict[str, Any]) -> str:
    """A success reply echoing ``request_id`` with its JSON type."""
    return _dump({"jsonrpc": "2.0", "id": request_id, "result": result})


def error_frame(request_id: JsonId, code: int, message: str) -> str:
    """An error reply echoing ``request_id`` (null when it could not be read)."""
    return _dump({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})


def notification_frame(method: str, params: dict[str, Any]) -> str:
    """A server-initiated notification (no id)."""
    return _dump({"jsonrpc": "2.0", "method": method, "params": params})
