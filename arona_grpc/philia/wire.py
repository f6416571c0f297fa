"""The Philia wire protocol as this client speaks it: the methods, frame limits and heartbeat,
the errors a call can end with, the upgrade URL, and how frames and results are encoded, decoded
and checked (protocol/philia-wire.md).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import aiohttp
import orjson

from arona_common import tracing

logger = logging.getLogger(__name__)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Philia's frame budget is about 1 MiB; the margin keeps a reply that is just at
# the budget (plus JSON-RPC envelope) from being refused on our side.
MAX_FRAME_BYTES = 2**20 + 2**16
# The largest request frame sent: Philia's budget (the embedded store closes the link with
# 1009 on anything larger). A bigger one is refused here, before it is sent
# (arona_grpc.sizes keeps every request the service makes below it).
MAX_REQUEST_BYTES = 2**20
# WebSocket close code "message too big": the peer refused a frame of ours for its size.
CLOSE_MESSAGE_TOO_BIG = 1009
# JSON-RPC errors that refuse the call for what it is (invalid request, invalid params):
# sending it again gets the same answer, and Philia itself is well.
PERMANENT_RPC_CODES = frozenset({-32600, -32602})
QUERY_METHOD = "Sync.MemoryQueryRequest"
STORE_METHOD = "Sync.MemoryStoreRequest"
DELETE_METHOD = "Sync.MemoryDeleteRequest"
# The longest request id: ids count up from 1 and never reach 20 digits.
LONGEST_ID = "9" * 20
# Server-supplied text quoted in our errors is cut to this length.
MAX_QUOTED = 200
# A link on which nothing was sent for this long gets a heartbeat; Philia closes links idle
# for about 45 s (protocol/philia-wire.md).
HEARTBEAT_S = 20.0
HEARTBEAT = b'{"jsonrpc":"2.0","method":"Base.Heartbeat"}'
# How long a closing handshake aiohttp starts itself (after a protocol error from the
# peer) waits for the peer's answer; our own faults abort instead.
CLOSE_TIMEOUT_S = 1.0
# The ``method`` label of each call in the metrics.
METRIC_METHODS = {
    QUERY_METHOD: "query",
    STORE_METHOD: "store",
    DELETE_METHOD: "delete",
}


# The store property carrying when an episode happened; absent means now.
OCCURRED_AT = "occurred_at"
TRACE_CONTEXT = tracing.TRACE_CONTEXT
TRACER = tracing.Tracer("arona_grpc")


def occurred_at_text(seconds: float) -> str:
    """POSIX ``seconds`` as Philia's ``occurred_at`` property: RFC 3339 UTC, whole seconds
    (the fraction is dropped), ``Z``: ``"2023-05-08T13:56:00Z"``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.floor(seconds)))


@dataclass(frozen=True)
class PhiliaMemory:
    """One recalled node, as Philia ranks it (best first)."""

    text: str
    score: float
    node_type: str
    # The node's id when the query result names it (the embedded store's do; the wire
    # protocol does not promise one): "" otherwise.
    node_id: str = ""


class PhiliaError(Exception):
    """A Philia call failed. The message never contains the token.

    ``permanent``: Philia refused the call for what it is (too large, invalid); the same
    call would be refused again, and Philia itself is well. ``philia_fault``: the failure
    says Philia is unreachable, slow or broken (what a circuit breaker counts); a call that
    failed only because another call's frame was refused is neither.
    """

    permanent = False
    philia_fault = True


class PhiliaUnavailable(PhiliaError):
    """Philia could not be reached or broke the protocol (refused, rejected, closed, garbage)."""

    def __init__(self, message: str, *, philia_fault: bool = True) -> None:
        super().__init__(message)
        self.philia_fault = philia_fault


class PhiliaTimeout(PhiliaError):
    """Philia did not answer within the per-call deadline."""


class PhiliaRPCError(PhiliaUnavailable):
    """Philia answered with a JSON-RPC error object (permanent for -32600 and -32602)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"Philia error {code}: {message}")
        self.code = code
        self.message = message
        self.permanent = code in PERMANENT_RPC_CODES
        self.philia_fault = not self.permanent


class PhiliaTooLarge(PhiliaError):
    """A request frame over Philia's budget: not sent, or refused by Philia (close 1009)."""

    permanent = True
    philia_fault = False


def build_upgrade_url(url: str, token: str) -> str:
    """The configured URL with ``token=<token>`` appended (``?`` or ``&``), URL-encoded."""
    parts = urlsplit(url)
    token_query = urlencode({"token": token}, quote_via=quote)
    query = f"{parts.query}&{token_query}" if parts.query else token_query
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def request_bytes(method: str, params: Mapping[str, Any]) -> int:
    """The size of the frame a request of ``method`` with ``params`` takes at most."""
    frame = {"jsonrpc": "2.0", "id": LONGEST_ID, "method": method, "params": params}
    return len(encode(frame))


def encode(frame: dict[str, Any]) -> bytes:
    """One request as UTF-8 JSON."""
    try:
        return orjson.dumps(frame)
    except TypeError:
        # orjson refuses lone surrogates in a str; json escapes them, as before.
        return json.dumps(frame).encode()


def not_text(message: aiohttp.WSMessage) -> None:
    """A frame other than text ends the link (binary, or aiohttp's report of a broken one)."""
    if message.type is aiohttp.WSMsgType.BINARY:
        raise PhiliaUnavailable("malformed frame from Philia (binary)")
    if message.type is aiohttp.WSMsgType.ERROR:
        # aiohttp's errors may quote the peer's bytes: name the type only.
        raise PhiliaUnavailable(f"malformed frame from Philia ({type(message.data).__name__})")


def decode(raw: bytes) -> dict[str, Any]:
    """Parse one text frame (its UTF-8 bytes); anything but a JSON object is malformed."""
    try:
        frame = orjson.loads(raw)
    except ValueError:
        # orjson refuses a few things JSON allows (an escaped lone surrogate, a number
        # too large for a double): the standard parser decides those rare frames.
        try:
            frame = json.loads(raw, parse_constant=_reject_constant)
        except ValueError:
            raise PhiliaUnavailable("malformed frame from Philia (not JSON)") from None
    if not isinstance(frame, dict):
        raise PhiliaUnavailable("malformed frame from Philia (not an object)")
    return frame


def _reject_constant(name: str) -> Any:
    # NaN / Infinity are not JSON; json.loads would otherwise accept them.
    raise ValueError(name)


def check_handshake(result: Any, redact: Callable[[str], str]) -> None:
    if not isinstance(result, dict) or not isinstance(result.get("ok"), bool):
        raise PhiliaUnavailable("malformed handshake reply from Philia")
    if not result["ok"]:
        error = result.get("error")
        detail = redact(error)[:MAX_QUOTED] if isinstance(error, str) and error else "no reason"
        raise PhiliaUnavailable(f"Philia refused the handshake: {detail}")


def takes_trace_context(result: dict[str, Any]) -> bool:
    """Whether a handshake's result lists :data:`TRACE_CONTEXT` among its capabilities (the
    embedded store does; the wire protocol does not say a Philia takes params it does not
    know, so none is sent one unless it says so)."""
    capabilities = result.get("capabilities")
    return isinstance(capabilities, list) and TRACE_CONTEXT in capabilities


def parse_memories(result: Any, limit: int) -> list[PhiliaMemory]:
    results = result.get("results") if isinstance(result, dict) else None
    if not isinstance(results, list):
        raise PhiliaUnavailable("malformed query result from Philia: no results list")
    memories: list[PhiliaMemory] = []
    for item in results[:limit]:
        if not isinstance(item, dict):
            raise PhiliaUnavailable("malformed query result from Philia: a result is not an object")
        text, score, node_type = item.get("text"), item.get("score"), item.get("node_type", "")
        if (
            not isinstance(text, str)
            or not isinstance(score, int | float)
            or isinstance(score, bool)
            or not math.isfinite(score)
            or not isinstance(node_type, str)
        ):
            raise PhiliaUnavailable("malformed query result from Philia: bad text, score or type")
        node_id = item.get("node_id")
        memories.append(
            PhiliaMemory(
                text=text,
                score=float(score),
                node_type=node_type,
                # Optional, and only ever a label: anything but a string is ignored.
                node_id=node_id if isinstance(node_id, str) else "",
            )
        )
    return memories


def parse_node_id(result: Any) -> str:
    node_id = result.get("node_id") if isinstance(result, dict) else None
    if not isinstance(node_id, str) or not node_id:
        raise PhiliaUnavailable("malformed store result from Philia: no node_id")
    return node_id


def parse_deleted(result: Any) -> bool:
    deleted = result.get("deleted") if isinstance(result, dict) else None
    if not isinstance(deleted, bool):
        raise PhiliaUnavailable("malformed delete result from Philia: no deleted flag")
    return deleted
