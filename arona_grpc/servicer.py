"""The gRPC face of :class:`~arona_grpc.service.MemoryDomain`: proto <-> domain only.

Every RPC runs through :meth:`MemoryServicer._guard`, so no exception escapes as
``UNKNOWN``: domain errors get the status code of :data:`STATUS_CODES` (the one
table) and their own, secret-free message; anything else is ``INTERNAL`` with a
generic message while the traceback goes to the log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.breaker import BreakerState
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
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
Context = grpc.aio.ServicerContext[object, object]

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

    async def Recall(self, request: pb.RecallRequest, context: Context) -> pb.RecallResponse:
        # The caller's deadline bounds the recall too: the service never outlasts it.
        remaining = context.time_remaining()
        return await self._guard(context, "Recall", self._recall(request, remaining))

    async def Writeback(
        self, request: pb.WritebackRequest, context: Context
    ) -> pb.WritebackResponse:
        return await self._guard(context, "Writeback", self._writeback(request))

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        return await self._guard(context, "Delete", self._delete(request))

    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        return await self._guard(context, "Status", self._status(request))

    async def _recall(
        self, request: pb.RecallRequest, remaining_s: float | None
    ) -> pb.RecallResponse:
        outcome = await self._domain.recall(request.query, request.limit, deadline_s=remaining_s)
        return pb.RecallResponse(
            state=_STATES[outcome.state],
            memories=[
                pb.Memory(text=m.text, score=m.score, node_type=m.node_type)
                for m in outcome.memories
            ],
            section=outcome.section,
        )

    async def _writeback(self, request: pb.WritebackRequest) -> pb.WritebackResponse:
        outcome = await self._domain.writeback(request.user, request.assistant)
        return pb.WritebackResponse(stored=outcome.stored, node_id=outcome.node_id)

    async def _delete(self, request: pb.DeleteRequest) -> pb.DeleteResponse:
        return pb.DeleteResponse(deleted=await self._domain.delete(request.node_id))

    async def _status(self, request: pb.StatusRequest) -> pb.StatusResponse:
        snapshot = self._domain.status(request.limit)
        reply = pb.StatusResponse(
            enabled=snapshot.enabled,
            writeback=snapshot.writeback,
            events=[_event(e) for e in snapshot.events],
            breaker=_BREAKER_STATES[snapshot.breaker],
            outbox_depth=snapshot.outbox_depth,
            outbox_dropped=snapshot.outbox_dropped,
        )
        if snapshot.breaker_opened_at is not None:
            reply.breaker_opened_at.FromDatetime(snapshot.breaker_opened_at)
        return reply

    async def _guard(
        self,
        context: Context,
        rpc: str,
        call: Awaitable[T],
    ) -> T:
        try:
            return await call
        except MemoryDomainError as exc:
            code = STATUS_CODES.get(type(exc), grpc.StatusCode.INTERNAL)
            await context.abort(code, str(exc))
        except Exception:
            logger.exception("MemoryService/%s failed", rpc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")


def _event(event: MemoryEvent) -> pb.Event:
    at = Timestamp()
    at.FromDatetime(event.at)
    return pb.Event(kind=_KINDS[event.kind], detail=event.detail, at=at)
