"""A call of the store's wire protocol as the server takes it: the methods' names, a connection's
session and its idle watch, each method's params checked and its result shaped, a traced call's
span, and the answers of a batch of calls given at once."""

import asyncio
import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from opentelemetry.trace import Span

from arona_common import tracing
from arona_store import jsonrpc
from arona_store.jsonrpc import Call, RpcError
from arona_store.nodes import StoreError, key_of
from arona_store.store import DEFAULT_LIMIT, MAX_LIMIT, MemoryHit

if TYPE_CHECKING:
    pass


logger = logging.getLogger(__name__)

IDLE_CLOSE_CODE = 4000


HANDSHAKE = "Sync.ConnectHandshake"
QUERY = "Sync.MemoryQueryRequest"
STORE = "Sync.MemoryStoreRequest"
# What a call answers while the store's database (PostgreSQL) does not.
DATABASE_AWAY = RpcError(jsonrpc.INTERNAL_ERROR, "the memory store's database is unavailable")
DELETE = "Sync.MemoryDeleteRequest"
HEARTBEAT = "Base.Heartbeat"
HEARTBEAT_ACK = "Base.HeartbeatAck"
SERVER_VERSION = "Sync.ServerVersion"
# The store property holding when a memory happened (RFC 3339); absent: now.
OCCURRED_AT = "occurred_at"

T = TypeVar("T")
TRACER = tracing.Tracer("arona_store")
# The methods whose calls get a span: those the gateway makes.
TRACED = frozenset({QUERY, STORE, DELETE})


class Session:
    """Per-connection state."""

    session_id: str | None = None
    refused: bool = False


def server_version() -> str:
    try:
        return metadata.version("arona-memory-gateway")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def bad_params(message: str) -> RpcError:
    return RpcError(jsonrpc.INVALID_PARAMS, f"Invalid params: {message}")


def query_params(params: Mapping[str, Any]) -> tuple[str, int, str | None]:
    """``query``, ``limit`` and ``node_type_filter`` (None or absent: every node type)."""
    query = params.get("query")
    if not isinstance(query, str):
        raise bad_params("query must be a string")
    limit = params.get("limit", DEFAULT_LIMIT)
    if limit is None:
        limit = DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise bad_params(f"limit must be an integer between 1 and {MAX_LIMIT}")
    node_type = params.get("node_type_filter")
    if node_type is not None and (not isinstance(node_type, str) or not node_type):
        raise bad_params("node_type_filter must be a non-empty string or null")
    return query, limit, node_type


def query_result(query: str, hits: list[MemoryHit]) -> dict[str, Any]:
    return {
        "query": query,
        "total": len(hits),
        "results": [
            # node_id beyond Philia's fields: a client that does not know it ignores it.
            {
                "node_type": hit.node_type,
                "text": hit.text,
                "score": round(hit.score, 6),
                "node_id": hit.node_id,
            }
            for hit in hits
        ],
    }


class IdleWatch:
    """Closes a connection with code 4000 once no frame came for ``idle_s``, as Philia does.

    One timer per connection, moved only when it fires: noting a frame is one assignment,
    where a timeout around every receive would make and cancel a timer per frame.
    """

    def __init__(self, ws: web.WebSocketResponse, idle_s: float) -> None:
        self._ws = ws
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(
            self._last + idle_s, self._check
        )
        self._closing: asyncio.Task[bool] | None = None

    def seen(self) -> None:
        self._last = self._loop.time()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        due = self._last + self._idle_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._timer = None
        logger.debug("closing an idle memory store connection")
        # Closing makes the pending receive end, and with it the connection's handler.
        self._closing = asyncio.create_task(
            self._ws.close(code=IDLE_CLOSE_CODE, message=b"idle timeout")
        )


def served(call: Call) -> AbstractContextManager[Span]:
    """The server span of a query, store or delete: the child of the caller's span when its
    params carry a ``traceparent`` (see the handshake's capabilities). Ended before the reply
    is sent, so a caller that has its answer finds the span ended."""
    if call.method not in TRACED or not tracing.active():
        return tracing.NO_SPAN
    return TRACER.span(
        call.method,
        kind=tracing.SERVER,
        parent=tracing.context_of(call.params),
        attributes={"rpc.system": "jsonrpc", "rpc.method": call.method},
    )


def traced_hits(hits: Sequence[MemoryHit]) -> None:
    span = tracing.current_span()
    if span.is_recording():
        span.set_attribute("arona.store.hits", len(hits))


def optional_str(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None or isinstance(value, str):
        return value
    raise bad_params(f"{key} must be a string")


def occurred_at_of(properties: Mapping[str, str]) -> datetime | None:
    """When the memory happened: ``properties["occurred_at"]`` (an RFC 3339 time with its
    offset, e.g. ``2023-05-08T13:56:00Z``); None (now) when absent."""
    value = properties.get(OCCURRED_AT)
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value.strip())
        if value.strip()[10:11] not in ("T", "t", " ") or when.utcoffset() is None:
            raise ValueError("not an RFC 3339 time with its offset")
        key_of(when.timestamp())
    except (ValueError, OverflowError, StoreError):
        raise bad_params(
            f"properties.{OCCURRED_AT} must be an RFC 3339 time with its offset,"
            " e.g. 2023-05-08T13:56:00Z"
        ) from None
    return when


def answer_all(batch: Sequence[tuple[object, asyncio.Future[T]]], results: Sequence[T]) -> None:
    """Answer each waiting call of a write or delete batch with its result (a call its
    caller gave up on is skipped)."""
    for (_, done), result in zip(batch, results, strict=True):
        if not done.done():
            done.set_result(result)


def refuse_all(batch: Sequence[tuple[object, asyncio.Future[T]]], error: Exception) -> None:
    """Answer each waiting call of a batch that failed with ``error``."""
    for _, done in batch:
        if not done.done():
            done.set_exception(error)
