"""The WebSocket JSON-RPC face of the embedded store (the Philia wire protocol subset).

:class:`StoreServer` serves ``/ws`` with aiohttp (its WebSocket frames are parsed in C: about
0.02 ms less store CPU per chat turn than ``websockets`` in the benchmark); the token is checked
on the upgrade (``?token=``, HTTP 401 otherwise) and again by ``Sync.ConnectHandshake``; nothing
but the handshake is served before it succeeds (-32005). No request line is logged: the upgrade
URL carries the token. Recalls run on the event loop: one costs a
fraction of a millisecond of SQLite work, less than handing it to a thread and back (measured
at 10,000 nodes: 0.45 ms of store CPU per recall through the hop, 0.39 ms without), and reads
its own snapshot, so it never waits for a write (a recall that finds the reader held by
another thread waits on the worker thread instead:
:meth:`~arona_store.store.MemoryStore.try_query`).
Writes run on the loop too (an FTS index update and a WAL commit, about 0.1 ms), with the
stores that arrive within :data:`WRITE_LINGER_S` of each other committed together in one
transaction (group commit: a transaction costs more than the stores in it), and a store is
answered only once its transaction has committed. What could stall the loop is moved off
it: WAL checkpoints (which sync the database file) run on a dedicated worker thread once
:data:`CHECKPOINT_COMMITS` transactions or :data:`CHECKPOINT_STORES` stores have been written
since the last one (the log then holds a few MB, as with SQLite's own automatic checkpoints),
and a write that finds the database held (by that checkpoint, or another process) waits on
that thread instead. Deletes run on that thread: each is answered once the node is erased
from every index, segment and log (``MemoryStore.delete_many``, a fraction of a second), and
the deletes that arrive meanwhile are erased together next.
Connections idle for ``idle_timeout_s`` are closed with code 4000, as Philia does.
The handshake's result lists the ``trace_context`` capability: a query, store or delete whose
params carry a ``traceparent`` is a server span in the caller's trace, a recall's retrieval and
ranking its children (arona_grpc.tracing), ended before the reply goes out.
A store's ``properties["occurred_at"]`` (RFC 3339 with its offset, e.g.
``2023-05-08T13:56:00Z``) is the memory's time, the one recency is measured from; absent, the
memory is dated now; malformed or out of range, the store is refused as invalid params.

With the ``hybrid`` ranking (``arona_store/RANKING.md``) the model's work stays off the loop
and off the write path. A store is committed and answered without a vector (a store identical
to a stored node that has one keeps it: the refresh is not embedded again), and its node goes
to the embedding worker: one task that hands the embedding thread every node stored since its
last step, up to :data:`EMBED_BATCH_MAX`, embeds them there and stores their vectors in one
transaction (a node deleted meanwhile gets none), then takes the next batch. So a store never
waits for the model, and stores that arrive while it is busy are embedded together. Until its
vector lands (a fraction of a second at the benchmark's load: ``bench/README.md``) a new memory
is found by its words; the ranking counts it at its candidates' mean cosine. A recall (a search
of the words and of the vectors, its query embedded meanwhile on one of the store's query
threads) runs on one of :data:`RECALL_THREADS` recall threads, answered whenever done so that a
connection's recalls run side by side. Nodes stored without a vector (by the lexical ranking,
an older version, or a store stopped before it embedded them) are embedded in the background
on the same embedding thread from start-up on, newest first, a batch at a time between the
worker's, while recalls use the vectors already there. A stop finishes the worker's batch in
hand and leaves the nodes still queued to that background fill of the next start: they are
stored, only their vectors wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import WSCloseCode, WSMsgType, web
from opentelemetry.trace import Span

from arona_grpc import tracing
from arona_grpc.database import DatabaseUnavailable
from arona_grpc.storage import StorageFaults, write_error
from arona_store import jsonrpc
from arona_store.base import StoreBase
from arona_store.jsonrpc import Call, JsonId, RpcError
from arona_store.nodes import StoreError, key_of
from arona_store.ranking import Ranking, check_ranking, ranking_from_env
from arona_store.store import DEFAULT_LIMIT, MAX_LIMIT, MemoryHit, MemoryStore, NewNode

if TYPE_CHECKING:
    from arona_store.embedding import Embedder

logger = logging.getLogger(__name__)

WS_PATH = "/ws"
MAX_FRAME_BYTES = 2**20
IDLE_CLOSE_CODE = 4000
# Writes between two WAL checkpoints: a transaction adds a few pages to the log, and each
# store in it a few more.
CHECKPOINT_COMMITS = 100
CHECKPOINT_STORES = 500
# How long the first store of a batch waits for others to share its transaction, and the
# most one transaction takes. A store's reply is that much later; nobody waits on it (the
# gateway writes back after answering), and a transaction costs more than a store in it.
WRITE_LINGER_S = 0.01
WRITE_BATCH_MAX = 64
# The most deletes one erasure covers (each erasure merges the full-text indexes).
DELETE_BATCH_MAX = 256
# Philia answers a stalled handler with -32603 after about 8 s; so do we.
HANDLER_TIMEOUT_S = 8.0
DEFAULT_PORT = 8424
STORE_PART = "memory store"
# What a store the database cannot take costs.
STORE_COST = "stores are refused until it can be written"
# Hybrid ranking: a recall's query is embedded while another recall holds the store's read
# lock, so two use two cores at once (arona_store.base.QUERY_EMBEDDING_THREADS).
RECALL_THREADS = 2
# Hybrid ranking: the thread that embeds stored nodes, and the most nodes one step of the
# embedding worker takes (a step is one hop to that thread, one read of the nodes still without
# a vector and one write transaction for their vectors; the model runs once per text whatever
# the batch, arona_store.embedding). 64 of the benchmark's episodes take about 0.3 s of CPU.
EMBED_THREAD = "arona-store-embed"
EMBED_BATCH_MAX = 64

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

_T = TypeVar("_T")
TRACER = tracing.Tracer("arona_store")
# The methods whose calls get a span: those the gateway makes.
_TRACED = frozenset({QUERY, STORE, DELETE})
_Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# Methods answered in the background, out of order: those that wait for the write queue.
_IN_BACKGROUND = frozenset({STORE, DELETE})


@dataclass
class _Session:
    """Per-connection state."""

    session_id: str | None = None
    refused: bool = False


def _version() -> str:
    try:
        return metadata.version("arona-memory-gateway")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def _bad_params(message: str) -> RpcError:
    return RpcError(jsonrpc.INVALID_PARAMS, f"Invalid params: {message}")


def _query_params(params: Mapping[str, Any]) -> tuple[str, int, str | None]:
    """``query``, ``limit`` and ``node_type_filter`` (None or absent: every node type)."""
    query = params.get("query")
    if not isinstance(query, str):
        raise _bad_params("query must be a string")
    limit = params.get("limit", DEFAULT_LIMIT)
    if limit is None:
        limit = DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise _bad_params(f"limit must be an integer between 1 and {MAX_LIMIT}")
    node_type = params.get("node_type_filter")
    if node_type is not None and (not isinstance(node_type, str) or not node_type):
        raise _bad_params("node_type_filter must be a non-empty string or null")
    return query, limit, node_type


def _query_result(query: str, hits: list[MemoryHit]) -> dict[str, Any]:
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


class _IdleWatch:
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


def _served(call: Call) -> AbstractContextManager[Span]:
    """The server span of a query, store or delete: the child of the caller's span when its
    params carry a ``traceparent`` (see the handshake's capabilities). Ended before the reply
    is sent, so a caller that has its answer finds the span ended."""
    if call.method not in _TRACED or not tracing.active():
        return tracing.NO_SPAN
    return TRACER.span(
        call.method,
        kind=tracing.SERVER,
        parent=tracing.context_of(call.params),
        attributes={"rpc.system": "jsonrpc", "rpc.method": call.method},
    )


def _traced_hits(hits: Sequence[MemoryHit]) -> None:
    span = tracing.current_span()
    if span.is_recording():
        span.set_attribute("arona.store.hits", len(hits))


def _optional_str(params: Mapping[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _bad_params(f"{key} must be a string")


def _occurred_at(properties: Mapping[str, str]) -> datetime | None:
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
        raise _bad_params(
            f"properties.{OCCURRED_AT} must be an RFC 3339 time with its offset,"
            " e.g. 2023-05-08T13:56:00Z"
        ) from None
    return when


def _answer(batch: Sequence[tuple[object, asyncio.Future[_T]]], results: Sequence[_T]) -> None:
    """Answer each waiting call of a write or delete batch with its result (a call its
    caller gave up on is skipped)."""
    for (_, done), result in zip(batch, results, strict=True):
        if not done.done():
            done.set_result(result)


def _refuse(batch: Sequence[tuple[object, asyncio.Future[_T]]], error: Exception) -> None:
    """Answer each waiting call of a batch that failed with ``error``."""
    for _, done in batch:
        if not done.done():
            done.set_exception(error)


class StoreServer:
    """The embedded Philia-compatible store, listening. Build with :meth:`start`."""

    def __init__(
        self,
        *,
        store: StoreBase,
        executor: ThreadPoolExecutor,
        token: str,
        host: str,
        idle_timeout_s: float,
        embed_executor: ThreadPoolExecutor | None = None,
        recall_executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.store = store
        # The database's write faults: said once, not a traceback per refused store.
        self._storage = StorageFaults()
        self._executor = executor
        # Hybrid ranking only: the model's threads (module docstring).
        self._embed_executor = embed_executor
        self._recall_executor = recall_executor
        self._filling: asyncio.Task[None] | None = None
        self._token = token.encode("utf-8")
        self._host = host
        self._idle_timeout_s = idle_timeout_s
        self._runner: web.AppRunner | None = None
        self._connections: set[web.WebSocketResponse] = set()
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None
        # Stores waiting for the next write transaction, and the task committing them.
        self._queued: list[tuple[NewNode, asyncio.Future[str]]] = []
        self._writer: asyncio.Task[None] | None = None
        # Transactions and stores written since the last checkpoint began.
        self._commits = 0
        self._stores = 0
        self._batch_full = asyncio.Event()
        # Deletes waiting for the next erasure, and the task running them.
        self._deletes: list[tuple[str, asyncio.Future[bool]]] = []
        self._deleter: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._checkpointing: asyncio.Future[None] | None = None
        # Hybrid ranking: nodes stored without a vector, waiting for the embedding worker (the
        # task embedding them), and what it has embedded: texts, in how many steps.
        self._to_embed: list[str] = []
        self._embedding: asyncio.Task[None] | None = None
        self._embedded = 0
        self._embed_steps = 0
        self.port = 0
        self._greeting = jsonrpc.notification_frame(
            SERVER_VERSION,
            {"version": _version(), "build_info": f"arona-store ({store.backend})"},
        )
        self._methods: dict[str, _Handler] = {
            QUERY: self._query,
            STORE: self._store,
            DELETE: self._delete,
        }

    @classmethod
    async def start(
        cls,
        *,
        db_path: Path,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = 45.0,
        ranking: Ranking | None = None,
        embedder: Embedder | None = None,
        database_url: str | None = None,
    ) -> StoreServer:
        """Open the database at ``db_path`` (or the store on PostgreSQL at ``database_url``:
        :mod:`arona_store.pg.store`) and listen on ``host:port`` (0 = any free port).

        ``ranking`` None: as ``ARONA_STORE_RANKING`` says (:func:`ranking_from_env`: ``hybrid``
        when the semantic extra is installed). A ranking that cannot run raises
        :class:`~arona_store.ranking.RankingError` (one line) before anything is opened.
        ``embedder``: the model of a ``hybrid`` store, one already loaded (None: loaded here).
        """
        if not token:
            raise ValueError("the memory store needs a non-empty token")
        if idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be positive")
        ranking = ranking_from_env(os.environ) if ranking is None else check_ranking(ranking)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arona-store-db")
        embed_executor = recall_executor = None
        if ranking == "hybrid":
            embed_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=EMBED_THREAD)
            recall_executor = ThreadPoolExecutor(
                max_workers=RECALL_THREADS, thread_name_prefix="arona-store-recall"
            )
        loop = asyncio.get_running_loop()
        try:
            store: StoreBase
            if database_url is not None:
                from arona_store.pg.store import PgMemoryStore

                store = await loop.run_in_executor(
                    executor,
                    functools.partial(
                        PgMemoryStore.open,
                        database_url,
                        ranking=ranking,
                        embedder=embedder if ranking == "hybrid" else None,
                    ),
                )
            else:
                store = await loop.run_in_executor(
                    executor,
                    functools.partial(
                        MemoryStore.open,
                        db_path,
                        checkpoint_on_commit=False,
                        ranking=ranking,
                        embedder=embedder if ranking == "hybrid" else None,
                    ),
                )
        except BaseException:
            for pool in (executor, embed_executor, recall_executor):
                if pool is not None:
                    pool.shutdown(wait=False)
            raise
        logger.info("memory store ranking: %s", ranking)
        server = cls(
            store=store,
            executor=executor,
            token=token,
            host=host,
            idle_timeout_s=idle_timeout_s,
            embed_executor=embed_executor,
            recall_executor=recall_executor,
        )
        app = web.Application()
        app.router.add_get(WS_PATH, server._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        try:
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            await loop.run_in_executor(executor, store.close)
            for pool in (executor, embed_executor, recall_executor):
                if pool is not None:
                    pool.shutdown(wait=False)
            raise
        server._runner = runner
        if embed_executor is not None:
            server._filling = asyncio.create_task(server._fill_vectors(embed_executor))
        server.port = int(runner.addresses[0][1])
        logger.info("memory store listening on %s", server.url)
        return server

    @property
    def url(self) -> str:
        """The WebSocket URL to give clients, without the token."""
        host = self._host
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}{WS_PATH}"

    async def stop(self) -> None:
        """Close every connection, stop listening and close the database; idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop())
        # Shielded so a caller cancelled mid-stop does not leave the database open.
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        try:
            if self._runner is not None:
                await asyncio.gather(
                    *(
                        ws.close(code=WSCloseCode.GOING_AWAY, message=b"server stopping")
                        for ws in list(self._connections)
                    ),
                    return_exceptions=True,
                )
                await self._runner.cleanup()
            for queue in (self._writer, self._deleter):
                if queue is not None:
                    # Stores and deletes already queued are done before the database closes.
                    await asyncio.gather(queue, return_exceptions=True)
            if self._background:
                await asyncio.gather(*self._background, return_exceptions=True)
            if self._embedding is not None:
                # It stops after the batch in hand (module docstring).
                await asyncio.gather(self._embedding, return_exceptions=True)
            if self._embed_steps:
                logger.info(
                    "memory store: embedded %d new memories in %d steps",
                    self._embedded,
                    self._embed_steps,
                )
            if self._checkpointing is not None:
                await asyncio.gather(self._checkpointing, return_exceptions=True)
            if self._filling is not None:
                # It stops after the batch in hand (it checks _stopping between batches).
                await asyncio.gather(self._filling, return_exceptions=True)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self.store.close)
        finally:
            self._executor.shutdown(wait=False)
            for pool in (self._embed_executor, self._recall_executor):
                if pool is not None:
                    pool.shutdown(wait=False)
            self._stopped.set()
            logger.info("memory store stopped")

    async def wait_stopped(self) -> None:
        """Return once :meth:`stop` has finished."""
        await self._stopped.wait()

    async def wait_embedded(self) -> None:
        """Return once nothing waits for the model (hybrid ranking; at once otherwise): the
        nodes of every store answered so far, and of those answered meanwhile, have their
        vectors, and so have the nodes the start found without one; or their embedding
        failed, or the server is stopping."""
        while pending := [
            task for task in (self._embedding, self._filling) if task and not task.done()
        ]:
            # asyncio.wait: a caller that gives up stops neither the worker nor the fill.
            await asyncio.wait(pending)

    async def __aenter__(self) -> StoreServer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- transport ---------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        """Refuse a missing or wrong ``?token=`` (401) before upgrading; then serve frames."""
        tokens = request.query.getall("token", [])
        if len(tokens) != 1 or not hmac.compare_digest(tokens[0].encode("utf-8"), self._token):
            logger.info("memory store refused an upgrade: missing or invalid token")
            return web.Response(status=HTTPStatus.UNAUTHORIZED, text="Unauthorized\n")
        ws = web.WebSocketResponse(
            timeout=2, autoping=True, compress=False, max_msg_size=MAX_FRAME_BYTES
        )
        await ws.prepare(request)
        self._connections.add(ws)
        session = _Session()
        idle = _IdleWatch(ws, self._idle_timeout_s)
        try:
            await ws.send_str(self._greeting)
            while True:
                msg = await ws.receive()
                if msg.type is WSMsgType.TEXT or msg.type is WSMsgType.BINARY:
                    frame: str | bytes = msg.data
                else:
                    break
                idle.seen()
                answer = self._dispatch(frame, session)
                if isinstance(answer, list):
                    replies = answer
                elif answer[0].method == QUERY and self._recall_executor is None:
                    # Answered at once unless another thread holds the reader.
                    with _served(answer[0]):
                        now = self._query_now(answer[0])
                        replies = now if now is not None else await self._run(*answer)
                elif answer[0].method in _IN_BACKGROUND or answer[0].method == QUERY:
                    # Answered whenever done, so the frames behind it are read meanwhile:
                    # one client's concurrent stores then share a transaction, its recalls
                    # do not wait for them, and its hybrid recalls (milliseconds each, on a
                    # recall thread) run side by side on both recall threads instead of one
                    # after another. Clients match replies by id.
                    self._in_background(self._answer_later(ws, *answer))
                    continue
                else:
                    replies = await self._run(*answer)
                for reply in replies:
                    await ws.send_str(reply)
                if session.refused:
                    await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"invalid token")
                    break
        except ConnectionError:
            pass
        finally:
            idle.stop()
            self._connections.discard(ws)
        return ws

    async def _answer_later(self, ws: web.WebSocketResponse, call: Call, handler: _Handler) -> None:
        with _served(call):
            replies = await self._run(call, handler)
        try:
            for reply in replies:
                await ws.send_str(reply)
        except ConnectionError:
            pass  # the client left; what it asked for is done all the same

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch(self, frame: str | bytes, session: _Session) -> list[str] | tuple[Call, _Handler]:
        """The frames to send back for one received frame (possibly none), or the method
        call to run for it."""
        if isinstance(frame, bytes):
            return [
                jsonrpc.error_frame(
                    None, jsonrpc.INVALID_REQUEST, "Invalid Request: binary frames are not accepted"
                )
            ]
        try:
            call = jsonrpc.parse_call(frame)
        except RpcError as err:
            return [jsonrpc.error_frame(err.request_id, err.code, err.message)]
        if call.method == HANDSHAKE:
            return self._reply(call, self._handshake(call, session))
        if session.session_id is None:
            return self._reply(
                call, RpcError(jsonrpc.AUTH_REQUIRED, "Authentication required: handshake first")
            )
        if call.method == HEARTBEAT:
            ack = jsonrpc.notification_frame(HEARTBEAT_ACK, {})
            return [ack, *self._reply(call, {"ok": True})]
        handler = self._methods.get(call.method)
        if handler is None:
            return self._reply(call, RpcError(jsonrpc.METHOD_NOT_FOUND, "Method not found"))
        return call, handler

    async def _run(self, call: Call, handler: _Handler) -> list[str]:
        """Run one method call and return its reply frames (none for a notification)."""
        try:
            async with asyncio.timeout(HANDLER_TIMEOUT_S):
                result = await handler(call.params)
        except TimeoutError:
            tracing.failed(tracing.current_span(), "timeout")
            logger.warning("memory store method %s timed out", call.method)
            return self._reply(call, RpcError(jsonrpc.INTERNAL_ERROR, "Request timed out"))
        except Exception as exc:
            return self._failed(call, exc)
        return self._reply(call, result)

    def _query_now(self, call: Call) -> list[str] | None:
        """A recall's reply frames, computed right here; None if it has to wait."""
        try:
            query, limit, node_type = _query_params(call.params)
            hits = self.store.try_query(query, limit, node_type=node_type)
        except Exception as exc:
            return self._failed(call, exc)
        if hits is None:
            return None
        _traced_hits(hits)
        return self._reply(call, _query_result(query, hits))

    def _failed(self, call: Call, exc: Exception) -> list[str]:
        tracing.failed(tracing.current_span(), type(exc).__name__)
        if isinstance(exc, RpcError):
            return self._reply(call, exc)
        if isinstance(exc, DatabaseUnavailable):  # said once per outage (arona_store.pg.link)
            return self._reply(call, DATABASE_AWAY)
        logger.error("memory store method %s failed", call.method, exc_info=exc)
        return self._reply(call, RpcError(jsonrpc.INTERNAL_ERROR, "Internal error"))

    @staticmethod
    def _reply(call: Call, outcome: dict[str, Any] | RpcError) -> list[str]:
        if call.is_notification:
            return []
        request_id: JsonId = call.request_id
        if isinstance(outcome, RpcError):
            return [jsonrpc.error_frame(request_id, outcome.code, outcome.message)]
        return [jsonrpc.result_frame(request_id, outcome)]

    def _handshake(self, call: Call, session: _Session) -> dict[str, Any] | RpcError:
        token = call.params.get("token")
        if token is not None and not isinstance(token, str):
            return _bad_params("token must be a string")
        if token is None or not hmac.compare_digest(token.encode("utf-8"), self._token):
            session.refused = True
            return {"ok": False, "error": "invalid token", "session_id": None, "reconnect": False}
        if session.session_id is None:
            session.session_id = str(uuid.uuid4())
        return {
            "ok": True,
            "error": None,
            "session_id": session.session_id,
            "reconnect": False,
            # A request's params may carry the caller's traceparent: the store continues the
            # trace (a client that does not know the key ignores it, as the protocol asks).
            "capabilities": [tracing.TRACE_CONTEXT],
        }

    async def _in_db(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, tracing.carried(fn), *args)

    async def _query(self, params: dict[str, Any]) -> dict[str, Any]:
        """A recall that another thread's recall holds up: it waits on the worker thread (a
        hybrid recall always runs on the recall thread)."""
        query, limit, node_type = _query_params(params)
        recall = functools.partial(self.store.query, query, limit, node_type=node_type)
        if self._recall_executor is not None:
            loop = asyncio.get_running_loop()
            hits = await loop.run_in_executor(self._recall_executor, tracing.carried(recall))
        else:
            hits = await self._in_db(recall)
        _traced_hits(hits)
        return _query_result(query, hits)

    async def _store(self, params: dict[str, Any]) -> dict[str, Any]:
        text = params.get("text")
        if not isinstance(text, str) or not text.strip():
            raise _bad_params("text must be a non-empty string")
        node_type = params.get("node_type", "episode")
        if not isinstance(node_type, str) or not node_type.strip():
            raise _bad_params("node_type must be a non-empty string")
        source_episode_id = _optional_str(params, "source_episode_id")
        related = params.get("related_node_ids")
        if related is None:
            related = []
        if not isinstance(related, list) or not all(isinstance(x, str) for x in related):
            raise _bad_params("related_node_ids must be a list of strings")
        properties = params.get("properties")
        if properties is None:
            properties = {}
        if not isinstance(properties, dict) or not all(
            isinstance(v, str) for v in properties.values()
        ):
            raise _bad_params("properties must be an object of strings")

        node = NewNode(
            text=text,
            node_type=node_type,
            created_at=_occurred_at(properties),
            source_episode_id=source_episode_id,
            related_node_ids=related,
            properties=properties,
        )
        return {"node_id": await self._write(node)}

    async def _write(self, node: NewNode) -> str:
        """Store ``node`` (refreshing an identical one) in the next write transaction."""
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queued.append((node, done))
        if len(self._queued) >= WRITE_BATCH_MAX:
            self._batch_full.set()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._commit_queued())
        return await done

    async def _commit_queued(self) -> None:
        """Commit queued stores, each batch in one transaction, until none are left."""
        while self._queued:
            if len(self._queued) < WRITE_BATCH_MAX:
                self._batch_full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._batch_full.wait(), WRITE_LINGER_S)
            batch = self._queued[:WRITE_BATCH_MAX]
            del self._queued[:WRITE_BATCH_MAX]
            nodes = [node for node, _ in batch]
            try:
                # Never embedding here: the embedding worker does, once the stores are answered.
                ids = self.store.try_add_many(nodes, refresh=True, embed=False)
                if ids is None:
                    ids = await self._in_db(
                        functools.partial(self.store.add_many, refresh=True, embed=False), nodes
                    )
            except Exception as exc:
                _refuse(batch, self._write_failure(exc))
                continue
            self._storage.succeeded(STORE_PART)
            _answer(batch, ids)
            if self._embed_executor is not None:
                self._embed_later(ids)
            self._commits += 1
            self._stores += len(batch)
            if (self._commits >= CHECKPOINT_COMMITS or self._stores >= CHECKPOINT_STORES) and (
                self._checkpointing is None or self._checkpointing.done()
            ):
                self._commits = self._stores = 0
                self._checkpointing = asyncio.get_running_loop().run_in_executor(
                    self._executor, self._checkpoint
                )

    def _write_failure(self, exc: Exception) -> Exception:
        """What a store or delete that failed answers: the disk (full, read-only, permissions)
        is said once per fault and refused in those words, a delete whose erasure could not
        finish says so, anything else stays "Internal error"."""
        if isinstance(exc, sqlite3.Error):
            self._storage.failed(STORE_PART, self.store.where, exc, STORE_COST)
            return RpcError(
                jsonrpc.INTERNAL_ERROR,
                f"the memory store cannot write its database: {write_error(exc)}",
            )
        if isinstance(exc, StoreError):
            return RpcError(jsonrpc.INTERNAL_ERROR, f"the memory store: {exc}")
        if isinstance(exc, DatabaseUnavailable):
            return DATABASE_AWAY
        return exc

    def _embed_later(self, ids: list[str]) -> None:
        """Hand the nodes ``ids``, just stored, to the embedding worker (started if idle)."""
        self._to_embed += ids
        if self._embedding is None or self._embedding.done():
            self._embedding = asyncio.create_task(self._embed_queued())

    async def _embed_queued(self) -> None:
        """The embedding worker: embed the queued nodes that still have no vector, every one
        queued at a time up to :data:`EMBED_BATCH_MAX`, on the embedding thread, until none are
        left or the server stops (module docstring). A node whose identical stored node had a
        vector (kept by the refresh), or that was deleted meanwhile, costs no model run
        (:meth:`~arona_store.store.MemoryStore.fill_missing`); a batch that fails is left to
        the background fill of the next start."""
        assert self._embed_executor is not None
        loop = asyncio.get_running_loop()
        while self._to_embed and self._stopping is None:
            batch = list(dict.fromkeys(self._to_embed[:EMBED_BATCH_MAX]))
            del self._to_embed[:EMBED_BATCH_MAX]
            try:
                embedded = await loop.run_in_executor(
                    self._embed_executor, self.store.fill_missing, batch
                )
            except DatabaseUnavailable:
                continue  # said once per outage; found by their words, embedded at next start
            except Exception:
                logger.warning("memory store: embedding new memories failed", exc_info=True)
                continue
            if embedded:
                self._embedded += embedded
                self._embed_steps += 1

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task kept until done (awaited by :meth:`stop`)."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fill_vectors(self, pool: ThreadPoolExecutor) -> None:
        """Embed the stored nodes that have no vector, a batch at a time on the embedding
        thread, until none is left or the server stops."""
        loop = asyncio.get_running_loop()
        try:
            missing = await loop.run_in_executor(pool, self.store.unembedded)
            if not missing:
                return
            logger.info("memory store: embedding %d stored nodes in the background", missing)
            started = time.perf_counter()
            done = 0
            while self._stopping is None:
                filled = await loop.run_in_executor(pool, self.store.fill_vectors)
                if not filled:
                    break
                done += filled
            logger.info(
                "memory store: embedded %d stored nodes in %.1f s",
                done,
                time.perf_counter() - started,
            )
        except DatabaseUnavailable:
            pass  # said once per outage
        except Exception:
            logger.warning("memory store: embedding stored nodes failed", exc_info=True)

    def _checkpoint(self) -> None:
        """One WAL checkpoint (worker thread); a failure is logged, the next one retries."""
        try:
            self.store.checkpoint()
        except (sqlite3.Error, DatabaseUnavailable) as exc:
            # A disk that takes no writes, or a database away, is said by the stores.
            logger.debug("memory store checkpoint failed: %s", exc)
        except Exception:
            logger.warning("memory store checkpoint failed", exc_info=True)

    async def _delete(self, params: dict[str, Any]) -> dict[str, Any]:
        """A delete, answered once the node is erased (:meth:`MemoryStore.delete_many`);
        deletes that arrive while others are being erased share the next erasure."""
        node_id = params.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            raise _bad_params("node_id must be a non-empty string")
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._deletes.append((node_id, done))
        if self._deleter is None or self._deleter.done():
            self._deleter = asyncio.create_task(self._delete_queued())
        return {"deleted": await done}

    async def _delete_queued(self) -> None:
        """Delete and erase the queued nodes, as many at a time as have queued, until none
        are left."""
        while self._deletes:
            batch = self._deletes[:DELETE_BATCH_MAX]
            del self._deletes[:DELETE_BATCH_MAX]
            try:
                found = await self._in_db(self.store.delete_many, [node for node, _ in batch])
            except Exception as exc:
                _refuse(batch, self._write_failure(exc))
                continue
            _answer(batch, found)


async def serve_forever(
    *,
    db_path: Path,
    token: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    idle_timeout_s: float = 45.0,
    on_ready: Callable[[StoreServer], None] | None = None,
    ranking: Ranking | None = None,
) -> None:
    """Run the store until cancelled, then stop it cleanly (the ``store`` command's body).

    ``on_ready`` is called once listening, e.g. to print :attr:`StoreServer.url`.
    """
    server = await StoreServer.start(
        db_path=db_path,
        token=token,
        host=host,
        port=port,
        idle_timeout_s=idle_timeout_s,
        ranking=ranking,
    )
    try:
        if on_ready is not None:
            on_ready(server)
        await server.wait_stopped()
    finally:
        await server.stop()
