"""The gRPC face of :class:`~arona_grpc.service.MemoryDomain`: proto <-> domain only.

Every RPC ends any failure through :func:`_abort`, so no exception escapes as
``UNKNOWN``: domain errors get the status code of :data:`STATUS_CODES` (the one
table) and their own, secret-free message; anything else is ``INTERNAL`` with a
generic message while the traceback goes to the log.

Each Recall and Writeback, unary or on an ``Exchange`` stream, is a server span
(arona_common.tracing) in the caller's trace: its ``traceparent`` comes as metadata on a unary
call and in the ``trace_context`` of a stream's call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import NoReturn

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import context as otel_context
from opentelemetry.trace import Span

from arona_common import tracing
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.batching import BatchWriter
from arona_grpc.breaker import BreakerState
from arona_grpc.config import SCOPE_SHARED, SCOPE_USER
from arona_grpc.episodes import IndexPage
from arona_grpc.logs import REQUEST_ID, REQUEST_ID_HEADER, sane_request_id
from arona_grpc.service import (
    EventKind,
    InvalidArgument,
    MemoryDomain,
    MemoryDomainError,
    MemoryEvent,
    MemoryState,
    MemoryTimeout,
    MemoryUnavailable,
    NotConfigured,
    RecallOutcome,
    StatusSnapshot,
)

logger = logging.getLogger(__name__)
TRACER = tracing.Tracer("arona_grpc")
SERVICE_NAME = "arona.memory.v1.MemoryService"
RECALL = "Recall"
WRITEBACK = "Writeback"

Context = grpc.aio.ServicerContext[object, object]

# How long a writeback's reply waits to go out with the next reply (usually a recall's,
# which a turn waits for) instead of in a write of its own.
REPLY_LINGER_S = 0.01

# Trailing metadata of a failed call: the cause for machines, and "the episode is queued".
ERROR_CODE_KEY = "arona-error-code"
QUEUED_KEY = "arona-queued"

STATUS_CODES: dict[type[MemoryDomainError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotConfigured: grpc.StatusCode.FAILED_PRECONDITION,
    MemoryUnavailable: grpc.StatusCode.UNAVAILABLE,
    MemoryTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_STATES = {
    MemoryState.ENABLED: pb.MEMORY_STATE_ENABLED,
    MemoryState.DISABLED: pb.MEMORY_STATE_DISABLED,
    MemoryState.OFFLINE: pb.MEMORY_STATE_OFFLINE,
}

_BREAKER_STATES = {
    BreakerState.CLOSED: pb.BREAKER_STATE_CLOSED,
    BreakerState.OPEN: pb.BREAKER_STATE_OPEN,
    BreakerState.HALF_OPEN: pb.BREAKER_STATE_HALF_OPEN,
}

_SCOPE_MODES = {
    SCOPE_SHARED: pb.SCOPE_MODE_SHARED,
    SCOPE_USER: pb.SCOPE_MODE_USER,
}

_KINDS = {
    EventKind.RECALL: pb.EVENT_KIND_RECALL,
    EventKind.WRITEBACK: pb.EVENT_KIND_WRITEBACK,
    EventKind.DELETE: pb.EVENT_KIND_DELETE,
    EventKind.ERROR: pb.EVENT_KIND_ERROR,
}


class MemoryServicer(pb_grpc.MemoryServiceServicer):
    """``arona.memory.v1.MemoryService`` over a :class:`MemoryDomain`."""

    def __init__(self, domain: MemoryDomain) -> None:
        self._domain = domain
        # The Exchange streams open now.
        self._exchanges: set[_Exchange] = set()
        self._stopping = False

    def say_goodbye(self) -> None:
        """The service is stopping: every Exchange stream, now and from now on, is asked to
        close (its calls already sent are still answered)."""
        self._stopping = True
        for exchange in self._exchanges:
            exchange.goodbye()

    # Each RPC is one coroutine with its own try: no wrapper coroutine or closure per
    # call on the hot path (Recall and Writeback run on every chat turn).

    async def Recall(self, request: pb.RecallRequest, context: Context) -> pb.RecallResponse:
        try:
            _adopt_request_id(context)
            with _served(RECALL, _metadata_parent(context)) as span:
                # The caller's deadline bounds the recall too: the service never outlasts it.
                outcome = await self._domain.recall(
                    request.query,
                    request.limit,
                    scope=request.scope,
                    deadline_s=context.time_remaining(),
                )
                _traced_recall(span, outcome)
            reply = pb.RecallResponse()
            _fill_recall(reply, outcome)
            return reply
        except Exception as exc:
            await _abort(context, "Recall", exc)

    async def Writeback(
        self, request: pb.WritebackRequest, context: Context
    ) -> pb.WritebackResponse:
        try:
            _adopt_request_id(context)
            with _served(WRITEBACK, _metadata_parent(context)) as span:
                outcome = await self._domain.writeback(
                    request.user,
                    request.assistant,
                    request.scope,
                    request.episode_id,
                    _occurred_at(request),
                )
                span.set_attribute("arona.writeback.stored", outcome.stored)
            logger.debug("Writeback: %s", outcome.node_id if outcome.stored else "not stored")
            return pb.WritebackResponse(stored=outcome.stored, node_id=outcome.node_id)
        except Exception as exc:
            await _abort(context, "Writeback", exc)

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        try:
            _adopt_request_id(context)
            outcome = await self._domain.delete(request.node_id, request.scope, own=request.own)
            return pb.DeleteResponse(deleted=outcome.deleted, reason=outcome.reason)
        except Exception as exc:
            await _abort(context, "Delete", exc)

    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        try:
            _adopt_request_id(context)
            # What other replicas forgot leaves this one's events too.
            await self._domain.clear_erased_events()
            return _status_reply(self._domain.status(request.limit))
        except Exception as exc:
            await _abort(context, "Status", exc)

    async def List(self, request: pb.ListRequest, context: Context) -> pb.ListResponse:
        try:
            _adopt_request_id(context)
            page = await self._domain.list_episodes(
                request.scope,
                request.limit,
                request.before,
                anonymous=request.anonymous,
                contains=request.contains,
            )
            return _list_reply(page)
        except Exception as exc:
            await _abort(context, "List", exc)

    async def Forget(self, request: pb.ForgetRequest, context: Context) -> pb.ForgetResponse:
        try:
            _adopt_request_id(context)
            deleted = await self._domain.forget(
                request.scope,
                principal=request.principal,
                anonymous=request.anonymous,
                everything=request.everything,
            )
            return pb.ForgetResponse(deleted=deleted)
        except Exception as exc:
            await _abort(context, "Forget", exc)

    # A coroutine that writes its replies itself (grpc.aio's reader/writer style), not the
    # generator the generated base class declares.
    async def Exchange(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.ExchangeRequest], context: Context
    ) -> None:
        exchange = _Exchange(self._domain, context)
        self._exchanges.add(exchange)
        if self._stopping:
            exchange.goodbye()
        try:
            await exchange.run(request_iterator)
        finally:
            self._exchanges.discard(exchange)


def _metadata_parent(context: Context) -> otel_context.Context | None:
    """The caller's trace context, from a unary call's metadata (None when tracing is off)."""
    if not tracing.active():
        return None
    return tracing.extract(tracing.headers_carrier(context.invocation_metadata() or ()))


def _served(method: str, parent: otel_context.Context | None) -> AbstractContextManager[Span]:
    """The server span of one Recall or Writeback, unary or on an Exchange stream: the child
    of the caller's span when the call carries its trace context."""
    if not tracing.active():
        return tracing.NO_SPAN
    return TRACER.span(
        f"{SERVICE_NAME}/{method}",
        kind=tracing.SERVER,
        parent=parent,
        attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method},
    )


def _traced_recall(span: Span, outcome: RecallOutcome) -> None:
    if span.is_recording():
        span.set_attribute("arona.memory.state", outcome.state.value)
        span.set_attribute("arona.memory.count", len(outcome.memories))


def _adopt_request_id(context: Context) -> None:
    """Log this RPC under the caller's ``x-request-id`` (the RPC runs in its own task)."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER:
            request_id = sane_request_id(value if isinstance(value, str) else None)
            if request_id is not None:
                REQUEST_ID.set(request_id)
            return


def _occurred_at(request: pb.WritebackRequest) -> float | None:
    """The request's ``occurred_at`` in POSIX seconds; None when unset (now)."""
    if not request.HasField("occurred_at"):
        return None
    at = request.occurred_at
    if not 0 <= at.nanos < 1_000_000_000:
        raise InvalidArgument("occurred_at.nanos must be from 0 to 999999999")
    return at.seconds + at.nanos / 1e9


def _fill_recall(reply: pb.RecallResponse, outcome: RecallOutcome) -> None:
    reply.state = _STATES[outcome.state]
    reply.section = outcome.section
    # Added in place: building Memory messages first and passing the list copies
    # each one again (about twice the cost, measured).
    add = reply.memories.add
    for m in outcome.memories:
        add(text=m.text, score=m.score, node_type=m.node_type, node_id=m.node_id)
    logger.debug("Recall: %s, %d memories", outcome.state.value, len(outcome.memories))


def _status_of(rpc: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a failed call ends with: a domain error's own code and message, or
    INTERNAL with a generic message (the traceback goes to the log)."""
    if isinstance(exc, MemoryDomainError):
        return STATUS_CODES.get(type(exc), grpc.StatusCode.INTERNAL), str(exc)
    logger.error("MemoryService/%s failed", rpc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error"


async def _abort(context: Context, rpc: str, exc: Exception) -> NoReturn:
    """End the RPC with the status of ``exc``: its own code and message, or INTERNAL."""
    code, message = _status_of(rpc, exc)
    if isinstance(exc, MemoryDomainError):
        trailers = []
        if exc.code:
            trailers.append((ERROR_CODE_KEY, exc.code))
        if exc.queued:
            trailers.append((QUEUED_KEY, "1"))
        if trailers:
            context.set_trailing_metadata(tuple(trailers))
    await context.abort(code, message)


class _Exchange:
    """One ``Exchange`` stream: each call runs in a task of its own, so a slow call never
    holds up another; replies are written, batched, by one flush task at a time (a gRPC
    stream takes one write at a time, and a write must not be cancelled halfway)."""

    def __init__(self, domain: MemoryDomain, context: Context) -> None:
        self._domain = domain
        self._context = context
        self._calls: dict[int, asyncio.Task[None]] = {}
        # Replies not written yet: the next write takes them all.
        self._out = pb.ExchangeResponse()
        # False, True (to be sent), None (sent).
        self._goodbye: bool | None = False
        # The only writer of the replies; open once the hello is written.
        self._writer = BatchWriter(
            self._write_replies, lambda: bool(self._out.replies), REPLY_LINGER_S, open=False
        )
        self._loop = asyncio.get_running_loop()

    async def run(self, requests: AsyncIterator[pb.ExchangeRequest]) -> None:
        _adopt_request_id(self._context)
        snapshot = self._domain.status(1)
        await self._context.write(
            pb.ExchangeResponse(
                hello=pb.Hello(
                    enabled=snapshot.enabled,
                    writeback=snapshot.enabled and snapshot.writeback,
                    scope_mode=_SCOPE_MODES[snapshot.scope_mode],
                )
            )
        )
        # Replies and the goodbye go out only after the hello.
        self._writer.open = True
        self._writer.kick()
        try:
            async for batch in requests:
                for call_id in batch.cancel:
                    task = self._calls.pop(call_id, None)
                    if task is not None:
                        task.cancel()
                # Recalls first: a turn waits for its recall, nobody for a writeback.
                later = []
                for call in batch.calls:
                    if call.HasField("writeback"):
                        later.append(call)
                    else:
                        self._start(call)
                for call in later:
                    self._start(call)
            # The caller closed its side: the calls under way still get their replies.
            while self._calls:
                await asyncio.wait(list(self._calls.values()))
            self._writer.kick()
            await self._writer.drain()
        finally:
            # The stream is over: nothing more is written on it.
            self._writer.close()
            for task in self._calls.values():
                task.cancel()

    def goodbye(self) -> None:
        """Ask the caller to send no more calls here and close its side."""
        if self._goodbye is False:
            self._goodbye = True
            self._writer.kick()

    def _start(self, call: pb.Call) -> None:
        kind = call.WhichOneof("request")
        task = self._loop.create_task(self._run_call(call, kind))
        self._calls[call.id] = task
        if call.timeout_ms and kind != "recall":
            # A recall ends before its deadline by itself (it gets deadline_s).
            timer = self._loop.call_later(call.timeout_ms / 1000.0, task.cancel)
            task.add_done_callback(lambda _: timer.cancel())

    async def _run_call(self, call: pb.Call, kind: str | None) -> None:
        # The reply is added to the next write only once it is whole (no await after).
        try:
            if call.request_id:
                request_id = sane_request_id(call.request_id)
                if request_id is not None:
                    REQUEST_ID.set(request_id)
            if kind == "recall":
                request = call.recall
                with _served(RECALL, tracing.context_of(call.trace_context)) as span:
                    outcome = await self._domain.recall(
                        request.query,
                        request.limit,
                        scope=request.scope,
                        deadline_s=call.timeout_ms / 1000.0 if call.timeout_ms else None,
                    )
                    _traced_recall(span, outcome)
                _fill_recall(self._out.replies.add(id=call.id).recall, outcome)
            elif kind == "writeback":
                wb = call.writeback
                with _served(WRITEBACK, tracing.context_of(call.trace_context)) as span:
                    done = await self._domain.writeback(
                        wb.user, wb.assistant, wb.scope, wb.episode_id, _occurred_at(wb)
                    )
                    span.set_attribute("arona.writeback.stored", done.stored)
                logger.debug("Writeback: %s", done.node_id if done.stored else "not stored")
                reply = self._out.replies.add(id=call.id).writeback
                reply.stored = done.stored
                reply.node_id = done.node_id
                # Nobody waits for it: it goes out with the next recall's reply.
                self._writer.linger()
                return
            else:
                raise InvalidArgument("a call carries a recall or a writeback")
        except asyncio.CancelledError:
            # The caller gave up on it (or its deadline passed): nobody waits for a reply.
            return
        except Exception as exc:
            code, message = _status_of((kind or "call").capitalize(), exc)
            error = self._out.replies.add(id=call.id).error
            error.code = code.value[0]
            error.message = message
            if isinstance(exc, MemoryDomainError):
                error.error_code = exc.code
                error.queued = exc.queued
        finally:
            self._calls.pop(call.id, None)
        self._writer.kick()

    async def _write_replies(self) -> bool:
        """Write the replies ready (and the goodbye, when due); whether another write may
        follow."""
        if self._goodbye is True:
            self._goodbye = None  # sent, with whatever replies are ready
            self._out.goodbye = True
        elif not self._out.replies:
            return False
        batch, self._out = self._out, pb.ExchangeResponse()
        try:
            await self._context.write(batch)
        except Exception as exc:
            # The stream ended under the write (the caller left, the server is stopping):
            # there is nobody to reply to.
            logger.debug("Exchange: a write failed, the stream is gone: %s", exc)
            self._writer.open = False
            return False
        return True


def _status_reply(snapshot: StatusSnapshot) -> pb.StatusResponse:
    reply = pb.StatusResponse(
        enabled=snapshot.enabled,
        writeback=snapshot.writeback,
        events=[_event(e) for e in snapshot.events],
        breaker=_BREAKER_STATES[snapshot.breaker],
        outbox_depth=snapshot.outbox_depth,
        outbox_dropped=snapshot.outbox_dropped,
        scope_mode=_SCOPE_MODES[snapshot.scope_mode],
        outbox_bytes=snapshot.outbox_bytes,
        dead_letters=snapshot.dead_letters,
    )
    for fault in snapshot.storage_faults:
        failing = reply.storage_faults.add(
            part=fault.part,
            where=fault.where,
            reason=fault.reason,
            failed_writes=fault.failed_writes,
        )
        failing.since.FromNanoseconds(int(fault.since * 1e6) * 1000)
    for dead in snapshot.recent_dead_letters:
        item = reply.recent_dead_letters.add(
            reason=dead.reason, chars=dead.chars, scope_id=dead.scope_id
        )
        item.at.FromNanoseconds(int(dead.at * 1e6) * 1000)
    if snapshot.breaker_opened_at is not None:
        reply.breaker_opened_at.FromDatetime(snapshot.breaker_opened_at)
    for health in snapshot.stores:
        store = reply.stores.add(url=health.url, up=health.up, error=health.error)
        store.since.FromDatetime(health.since)
    return reply


def _event(event: MemoryEvent) -> pb.Event:
    at = Timestamp()
    at.FromDatetime(event.at)
    return pb.Event(kind=_KINDS[event.kind], detail=event.detail, at=at, scope_id=event.scope_id)


def _list_reply(page: IndexPage) -> pb.ListResponse:
    reply = pb.ListResponse(next=str(page.next) if page.next is not None else "")
    for episode in page.episodes:
        item = reply.episodes.add(node_id=episode.node_id, preview=episode.preview)
        item.at.FromNanoseconds(int(episode.at * 1e6) * 1000)
    return reply
