"""The only place that calls the gRPC ``MemoryService`` stub.

It turns gRPC results into plain values for the turn pipeline and the RPC
methods, and gRPC errors into :class:`~gateway_http.errors.GatewayError`
(through the one table in :mod:`gateway_http.errors`). Recall never raises:
a failed or slow recall, or an unreachable gRPC service, is the ``offline``
state, so a chat turn always goes on. Writeback never raises for a gRPC failure
either: it runs in the background and its failures are only logged.

Each recall and writeback is a client span whose trace context goes with the call (in the
``Exchange`` call's ``trace_context``, or as metadata on a unary call).

Recall and writeback run on every turn, so an outage would fail them on every turn:
:class:`~arona_grpc.failure_log.FailureLog` keeps that to a few lines, not one per turn.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arona_common import tracing
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.failure_log import FailureLog
from arona_grpc.logs import REQUEST_ID, REQUEST_ID_HEADER
from arona_grpc.service import DATABASE_UNAVAILABLE, OUTBOX_PART
from arona_grpc.service import NOT_INDEXED as NOT_INDEXED  # a Delete's reasons, for rpc
from arona_grpc.service import OTHER_SCOPE as OTHER_SCOPE
from arona_grpc.servicer import ERROR_CODE_KEY, QUEUED_KEY
from gateway_http.auth import ANONYMOUS
from gateway_http.errors import GRPC_TO_KIND, ErrorKind, GatewayError
from gateway_http.grpc_channel import ReplicaWatch, memory_call_metadata, replica_view
from gateway_http.memory_stream import CallFailed, ExchangeStream, StreamPool
from gateway_http.metrics import GatewayMetrics, NoMetrics
from gateway_http.views import rfc3339_ms

logger = logging.getLogger(__name__)

ENABLED = "enabled"
DISABLED = "disabled"
OFFLINE = "offline"

TRACER = tracing.Tracer("gateway_http")
# The client spans of a turn's two calls (the RPC semantic conventions' "{service}/{method}").
_SERVICE = "arona.memory.v1.MemoryService"
RECALL_SPAN = f"{_SERVICE}/Recall"
WRITEBACK_SPAN = f"{_SERVICE}/Writeback"
_RECALL_RPC = {"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": "Recall"}
_WRITEBACK_RPC = {"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": "Writeback"}

_STATE_NAMES = {
    pb.MEMORY_STATE_ENABLED: ENABLED,
    pb.MEMORY_STATE_DISABLED: DISABLED,
    pb.MEMORY_STATE_OFFLINE: OFFLINE,
}
_EVENT_KINDS = {
    pb.EVENT_KIND_RECALL: "recall",
    pb.EVENT_KIND_WRITEBACK: "writeback",
    pb.EVENT_KIND_DELETE: "delete",
    pb.EVENT_KIND_ERROR: "error",
}
_SCOPE_MODES = {
    pb.SCOPE_MODE_SHARED: "shared",
    pb.SCOPE_MODE_USER: "user",
}
_BREAKER_NAMES = {
    pb.BREAKER_STATE_CLOSED: "closed",
    pb.BREAKER_STATE_OPEN: "open",
    pb.BREAKER_STATE_HALF_OPEN: "half_open",
}


_GENERIC = {
    ErrorKind.BAD_INPUT: "invalid argument",
    ErrorKind.NOT_CONFIGURED: "memory is not configured",
    ErrorKind.UNAVAILABLE: "memory service unavailable",
    ErrorKind.TIMEOUT: "memory service timed out",
    ErrorKind.AUTH: "memory service refused the credentials",
    ErrorKind.INTERNAL: "Internal error",
}


# The most of a gRPC status message quoted in a log line.
_MAX_QUOTED = 200


def _quoted(exc: grpc.aio.AioRpcError) -> str:
    """The status message of a failed call, for the log (never shown to a client)."""
    details = (exc.details() or "").strip()
    return details[:_MAX_QUOTED] if details else "no details"


def _trailer(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    """One trailing metadata value of a failed call (None when absent)."""
    metadata: Any = exc.trailing_metadata() or ()
    for item in metadata:
        name, value = item[0], item[1]
        if name == key:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


def _gateway_error(exc: grpc.aio.AioRpcError) -> GatewayError:
    """A failed call as the HTTP layer's error: the service's own message for client
    mistakes, a generic one otherwise (transport details are not for clients)."""
    kind = GRPC_TO_KIND.get(exc.code(), ErrorKind.INTERNAL)
    if _trailer(exc, ERROR_CODE_KEY) == DATABASE_UNAVAILABLE:
        return GatewayError(
            ErrorKind.UNAVAILABLE, "the database is unavailable", DATABASE_UNAVAILABLE
        )
    if kind in (ErrorKind.BAD_INPUT, ErrorKind.NOT_CONFIGURED) and exc.details():
        return GatewayError(kind, exc.details() or "")
    return GatewayError(kind, _GENERIC[kind])


@dataclass(frozen=True)
class Recall:
    state: str
    section: str
    # Memories in the section.
    count: int = 0


@dataclass(frozen=True)
class KeptEpisode:
    """What the memory service did with an episode handed over for good (an import)."""

    # Stored now, as node_id; False with queued: kept in its outbox, stored when Philia
    # answers again; False without: memory or writeback is off, or the turn was empty.
    stored: bool
    node_id: str = ""
    queued: bool = False


@dataclass(frozen=True)
class RecalledMemory:
    text: str
    score: float
    node_type: str
    # "" when the store does not name its query results' nodes.
    node_id: str = ""


@dataclass(frozen=True)
class RecallDetail:
    """A recall as a turn would see it, with the memories behind its section."""

    state: str
    section: str
    memories: tuple[RecalledMemory, ...]


if TYPE_CHECKING:
    # The async stub type exists only in the generated typing stubs.
    _Stubs = tuple[pb_grpc.MemoryServiceAsyncStub, health_pb2_grpc.HealthStub]


async def _wait_for_stream(
    streams: StreamPool, left_s: float
) -> tuple[ExchangeStream | None, float]:
    """None was open: wait for a stream within the call's budget; it and what is left. No
    stream (None) when the service turned out to have no Exchange (an older version): this
    call and every later one go unary."""
    deadline = time.monotonic() + left_s
    try:
        stream = await streams.stream(left_s)
    except CallFailed:
        if not streams.unimplemented:
            raise
        return None, deadline - time.monotonic()
    return stream, deadline - time.monotonic()


def _rfc3339_ms(ts: Timestamp) -> str:
    return rfc3339_ms(ts.ToDatetime(tzinfo=UTC))


def _store_view(store: pb.MemoryStore) -> dict[str, Any]:
    """``{url, state, since, error}``: one store, ``state`` ``up`` or ``down``, ``error`` what
    took it down (None while it is up)."""
    return {
        "url": store.url,
        "state": "up" if store.up else "down",
        "since": _rfc3339_ms(store.since),
        "error": store.error or None,
    }


def _event_view(event: pb.Event) -> dict[str, str]:
    """``{kind, detail, at}``, plus ``scope_id`` when the event concerns a scope (a turn of
    a caller with a principal; never for the anonymous turns of an open REST)."""
    view = {
        "kind": _EVENT_KINDS.get(event.kind, "error"),
        "detail": event.detail,
        "at": _rfc3339_ms(event.at),
    }
    if event.scope_id:
        view["scope_id"] = event.scope_id
    return view


def _dead_letter_view(dead: pb.DeadLetter) -> dict[str, Any]:
    """``{at, reason, chars}``, plus ``scope_id`` when the episode was someone's (as events)."""
    view: dict[str, Any] = {"at": _rfc3339_ms(dead.at), "reason": dead.reason, "chars": dead.chars}
    if dead.scope_id:
        view["scope_id"] = dead.scope_id
    return view


def storage_fault_view(
    part: str, where: str, reason: str, since: datetime, failed_writes: int
) -> dict[str, Any]:
    """``{part, file, reason, since, failed_writes}``: a file that cannot be written now."""
    return {
        "part": part,
        "file": where,
        "reason": reason,
        "since": rfc3339_ms(since),
        "failed_writes": failed_writes,
    }


@dataclass(frozen=True)
class ForgetTarget:
    """Whose memory a forget erases, exactly one of: one ``scope``, every scope of one
    ``principal`` (its own and those it narrowed to), the turns of no principal
    (``anonymous``), or ``everything``."""

    scope: str = ""
    principal: str = ""
    anonymous: bool = False
    everything: bool = False

    @property
    def owner(self) -> str | None:
        """Whose conversations go with it: None for everyone's, "" for none (a scope a
        principal narrowed to a user: the principal's conversations are not that user's)."""
        if self.everything:
            return None
        if self.anonymous:
            return ANONYMOUS
        if self.principal:
            return self.principal
        return "" if "/" in self.scope else self.scope


# A forget deletes its episodes a batch at a time, each batch erased from every index of
# the store: thousands of them take longer than one call's usual deadline.
FORGET_TIMEOUT_S = 300.0


class MemoryClient:
    """Calls ``arona.memory.v1.MemoryService``: recall and writeback over the ``Exchange``
    streams of ``streams`` when given (unary calls otherwise), everything else unary, on
    ``channel`` or, with streams, on a replica that has one open."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        recall_budget_s: float,
        rpc_timeout_s: float,
        metrics: GatewayMetrics | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        streams: StreamPool | None = None,
        replicas: ReplicaWatch | str | None = None,
    ) -> None:
        self._channel = channel
        self._streams = streams
        # What memory.status says of the replicas: the watch over the streams' replicas, or
        # the one target the unary calls go to.
        self._replicas = replicas
        self._metrics = metrics or NoMetrics()
        # Sent on every MemoryService call (the bearer token); the health check needs none.
        self._metadata = metadata
        self._stub = pb_grpc.MemoryServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        # Stubs of the other replicas' channels, made when first used.
        self._stubs: dict[grpc.aio.Channel, _Stubs] = {channel: (self._stub, self._health)}
        self._recall_budget_s = recall_budget_s
        # Writeback/Delete/Status wait for one Philia RPC plus the gRPC hop.
        self._rpc_timeout_s = rpc_timeout_s + 1.0
        self._recall_log = FailureLog(logger, "MemoryService/Recall")
        self._writeback_log = FailureLog(logger, "MemoryService/Writeback")

    @property
    def writeback_wanted(self) -> bool:
        """False while the service says it stores no writebacks (memory or writeback off):
        a turn then skips the call."""
        return self._streams is None or not self._streams.writeback_off

    async def recall(self, query: str, limit: int = 5, scope: str = "") -> Recall:
        with TRACER.span(RECALL_SPAN, kind=tracing.CLIENT, attributes=_RECALL_RPC) as span:
            recall = await self._recall(query, limit, scope)
            if span.is_recording():
                span.set_attribute("arona.memory.state", recall.state)
                span.set_attribute("arona.memory.count", recall.count)
            return recall

    async def _recall(self, query: str, limit: int, scope: str) -> Recall:
        try:
            reply = await self._recall_reply(query, limit, scope)
        except CallFailed as exc:
            return self._recall_failed(exc.code, exc.details)
        self._recall_log.succeeded()
        if reply is None:
            return Recall(DISABLED, "")
        state = _STATE_NAMES.get(reply.state, OFFLINE)
        if state == ENABLED and not reply.section:
            state = DISABLED
        if state != ENABLED:
            return Recall(state, "")
        return Recall(state, reply.section, len(reply.memories))

    async def _recall_reply(self, query: str, limit: int, scope: str) -> pb.RecallResponse | None:
        """One Recall within the recall budget, on a stream when there are streams; None when
        the replica has no memory configured (it would answer ``disabled``, so none is sent).
        A failure is :class:`CallFailed`, whichever way the call went."""
        streams = self._streams
        left_s = self._recall_budget_s
        if streams is not None and not streams.unimplemented:
            stream = streams.next_open()
            if stream is None:
                stream, left_s = await _wait_for_stream(streams, left_s)
            if stream is not None:
                hello = stream.hello
                if hello is not None and not hello.enabled:
                    return None
                call_id, call = stream.start(left_s)
                tracing.inject(call.trace_context)
                request = call.recall
                request.query = query
                request.limit = limit
                request.scope = scope
                return (await stream.reply(call_id, left_s)).recall
        try:
            reply: pb.RecallResponse = await self._unary()[0].Recall(
                pb.RecallRequest(query=query, limit=limit, scope=scope),
                timeout=left_s,
                metadata=self._call_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            raise CallFailed(exc.code(), _quoted(exc)) from None
        return reply

    def _recall_failed(self, code: grpc.StatusCode, details: str) -> Recall:
        tracing.failed(tracing.current_span(), code.name)
        self._recall_log.failed(
            f"memory recall failed ({code.name}: {details[:_MAX_QUOTED] or 'no details'}); "
            "going on without memories"
        )
        return Recall(OFFLINE, "")

    async def recall_detail(self, query: str, limit: int, scope: str = "") -> RecallDetail:
        """What :meth:`recall` gives a turn, plus the memories its section was made of.

        The same call as a turn's (on a stream when there are streams), the budget, the state
        and the section a turn's; a failed call is ``offline``, except a client mistake the
        service names (``INVALID_ARGUMENT``), which is raised.
        """
        with TRACER.span(RECALL_SPAN, kind=tracing.CLIENT, attributes=_RECALL_RPC):
            try:
                reply = await self._recall_reply(query, limit, scope)
            except CallFailed as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT and exc.details:
                    raise GatewayError(ErrorKind.BAD_INPUT, exc.details) from None
                tracing.failed(tracing.current_span(), exc.code.name)
                self._recall_log.failed(
                    f"memory recall failed ({exc.code.name}: "
                    f"{exc.details[:_MAX_QUOTED] or 'no details'})"
                )
                return RecallDetail(OFFLINE, "", ())
        self._recall_log.succeeded()
        if reply is None:
            return RecallDetail(DISABLED, "", ())
        state = _STATE_NAMES.get(reply.state, OFFLINE)
        if state == ENABLED and not reply.section:
            state = DISABLED
        if state != ENABLED:
            return RecallDetail(state, "", ())
        memories = tuple(
            RecalledMemory(m.text, m.score, m.node_type, m.node_id) for m in reply.memories
        )
        return RecallDetail(state, reply.section, memories)

    async def writeback(
        self,
        user: str,
        assistant: str,
        scope: str = "",
        episode_id: str = "",
        occurred_at: float | None = None,
    ) -> bool:
        """Hand one turn to the memory service; whether the service took it.

        ``occurred_at`` (POSIX seconds) is when the turn happened; None: now.

        Taken: stored, not wanted (memory or writeback off, an empty turn), or kept in the
        service's outbox although the call failed (it says so in a trailer). Not taken: the
        service was unreachable or failed otherwise, and the turn must be sent again. A failed
        call is logged (the service's own message says whether its outbox kept the episode).
        """
        # The child of the span it was sent under, and linked to it: a turn's, which ends
        # without waiting for it (a journal replay's has none).
        with TRACER.span(
            WRITEBACK_SPAN,
            kind=tracing.CLIENT,
            attributes=_WRITEBACK_RPC,
            links=tracing.link_to_current(),
        ) as span:
            taken = await self._writeback(user, assistant, scope, episode_id, occurred_at)
            span.set_attribute("arona.writeback.taken", taken)
            return taken

    async def _writeback(
        self, user: str, assistant: str, scope: str, episode_id: str, occurred_at: float | None
    ) -> bool:
        streams = self._streams
        reply: pb.WritebackResponse | None = None
        left_s = self._rpc_timeout_s
        if streams is not None and not streams.unimplemented:
            try:
                # On the stream the next call takes, to go out with it.
                stream = streams.next_open(stay=True)
                if stream is None:
                    stream, left_s = await _wait_for_stream(streams, left_s)
                if stream is not None:
                    call_id, call = stream.start(left_s, linger=True)
                    tracing.inject(call.trace_context)
                    request = call.writeback
                    request.user = user
                    request.assistant = assistant
                    request.scope = scope
                    request.episode_id = episode_id
                    if occurred_at is not None:
                        request.occurred_at.FromNanoseconds(int(occurred_at * 1e9))
                    reply = (await stream.reply(call_id, left_s)).writeback
            except CallFailed as exc:
                return self._writeback_failed(exc.code, exc.details, exc.queued)
        if reply is None:
            unary = pb.WritebackRequest(
                user=user, assistant=assistant, scope=scope, episode_id=episode_id
            )
            if occurred_at is not None:
                unary.occurred_at.FromNanoseconds(int(occurred_at * 1e9))
            try:
                reply = await self._unary()[0].Writeback(
                    unary,
                    timeout=left_s,
                    metadata=self._call_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                return self._writeback_failed(
                    exc.code(), _quoted(exc), _trailer(exc, QUEUED_KEY) == "1"
                )
        self._writeback_log.succeeded()
        if reply.stored:
            self._metrics.writeback("stored")
        else:
            self._metrics.writeback("not_stored")
        return True

    async def keep_episode(
        self,
        user: str,
        assistant: str,
        scope: str,
        episode_id: str,
        occurred_at: float | None,
        timeout_s: float,
    ) -> KeptEpisode:
        """One unary ``Writeback`` whose outcome the caller must know (an import, not a turn).

        A failure after which the service kept the episode in its outbox is a
        :class:`KeptEpisode` too (``queued``); any other failure raises
        :class:`GatewayError`, with the service's own message for bad input.
        """
        request = pb.WritebackRequest(
            user=user, assistant=assistant, scope=scope, episode_id=episode_id
        )
        if occurred_at is not None:
            request.occurred_at.FromNanoseconds(int(occurred_at * 1e9))
        try:
            reply = await self._unary()[0].Writeback(
                request, timeout=timeout_s, metadata=self._call_metadata()
            )
        except grpc.aio.AioRpcError as exc:
            if _trailer(exc, QUEUED_KEY) == "1":
                return KeptEpisode(stored=False, queued=True)
            raise _gateway_error(exc) from None
        return KeptEpisode(stored=reply.stored, node_id=reply.node_id)

    def _writeback_failed(self, code: grpc.StatusCode, details: str, queued: bool) -> bool:
        tracing.failed(tracing.current_span(), code.name)
        self._metrics.writeback("failed")
        self._writeback_log.failed(
            f"writeback failed ({code.name}: {details[:_MAX_QUOTED] or 'no details'})"
        )
        return queued

    async def delete(self, node_id: str, scope: str = "", *, own: bool = False) -> tuple[bool, str]:
        """Delete one node: whether it was deleted, and the service's reason when not
        (``not_indexed``, ``other_scope``, ``not_in_memory``); ``own``: only one stored for
        exactly ``scope``, in either scope mode."""
        request = pb.DeleteRequest(node_id=node_id, scope=scope, own=own)
        reply = await self._call(self._unary()[0].Delete, request)
        return bool(reply.deleted), reply.reason

    async def list_episodes(
        self,
        scope: str,
        limit: int,
        before: str = "",
        *,
        anonymous: bool = False,
        contains: str = "",
    ) -> dict[str, Any]:
        """``{memories: [{node_id, preview, at}], next}``: a page of a scope's episodes (or,
        ``anonymous``, of those of no scope), only those holding ``contains`` if given."""
        request = pb.ListRequest(
            scope=scope, limit=limit, before=before, anonymous=anonymous, contains=contains
        )
        reply = await self._call(self._unary()[0].List, request)
        return {
            "memories": [
                {"node_id": e.node_id, "preview": e.preview, "at": _rfc3339_ms(e.at)}
                for e in reply.episodes
            ],
            "next": reply.next or None,
        }

    async def forget(self, target: ForgetTarget) -> int:
        """Erase every episode of ``target``; how many were deleted."""
        request = pb.ForgetRequest(
            scope=target.scope,
            principal=target.principal,
            anonymous=target.anonymous,
            everything=target.everything,
        )
        reply = await self._call(self._unary()[0].Forget, request, FORGET_TIMEOUT_S)
        return int(reply.deleted)

    async def status(self, limit: int = 50) -> dict[str, Any]:
        channel = self._unary_channel()
        reply = await self._call(self._stubs_of(channel)[0].Status, pb.StatusRequest(limit=limit))
        result: dict[str, Any] = {
            "enabled": reply.enabled,
            "writeback": reply.writeback,
            "events": [_event_view(e) for e in reply.events],
            "breaker": _BREAKER_NAMES.get(reply.breaker, "closed"),
            "breaker_opened_at": (
                _rfc3339_ms(reply.breaker_opened_at)
                if reply.HasField("breaker_opened_at")
                else None
            ),
            "outbox_depth": reply.outbox_depth,
            "outbox_dropped": reply.outbox_dropped,
            "outbox_bytes": reply.outbox_bytes,
            "dead_letters": reply.dead_letters,
            "dead_letters_recent": [_dead_letter_view(d) for d in reply.recent_dead_letters],
            "scope": _SCOPE_MODES.get(reply.scope_mode, "shared"),
            "storage_faults": [
                storage_fault_view(
                    f.part, f.where, f.reason, f.since.ToDatetime(tzinfo=UTC), f.failed_writes
                )
                for f in reply.storage_faults
            ],
            "stores": [_store_view(store) for store in reply.stores],
        }
        if any(f.part == OUTBOX_PART for f in reply.storage_faults):
            # Not a count to trust: what the outbox could not keep is lost, not counted.
            result["outbox_depth"] = None
        watch = self._replicas
        if isinstance(watch, str):
            result["replicas"] = [replica_view(watch)]
            result["answered_by"] = watch
        elif watch is not None:
            result["replicas"] = watch.view()
            result["answered_by"] = watch.address_of(channel)
        return result

    def _unary(self) -> _Stubs:
        """The stubs for a unary call: on a replica with an open stream, when there are
        streams (so an operator's call goes where turns go)."""
        return self._stubs_of(self._unary_channel())

    def _unary_channel(self) -> grpc.aio.Channel:
        return self._streams.channel() if self._streams is not None else self._channel

    def _stubs_of(self, channel: grpc.aio.Channel) -> _Stubs:
        stubs = self._stubs.get(channel)
        if stubs is None:
            assert self._streams is not None  # without streams there is one channel
            # The replicas changed: forget the stubs of channels that are gone.
            current = self._streams.channels
            for gone in [c for c in self._stubs if c not in current]:
                del self._stubs[gone]
            stubs = (pb_grpc.MemoryServiceStub(channel), health_pb2_grpc.HealthStub(channel))
            self._stubs[channel] = stubs
        return stubs

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The call's metadata: the bearer token, the request id when there is one, and the
        trace context when tracing is on."""
        metadata = self._metadata
        request_id = REQUEST_ID.get()
        if request_id is not None:
            metadata = (*metadata, (REQUEST_ID_HEADER, request_id))
        if tracing.active():
            carrier: dict[str, str] = {}
            tracing.inject(carrier)
            metadata = (*metadata, *carrier.items())
        return metadata

    async def ready(self, timeout_s: float = 2.0) -> bool:
        """Whether the gRPC service answers its health check as SERVING."""
        try:
            reply = await self._unary()[1].Check(
                health_pb2.HealthCheckRequest(service="arona.memory.v1.MemoryService"),
                timeout=timeout_s,
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await method(
                request,
                timeout=timeout_s or self._rpc_timeout_s,
                metadata=self._call_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("memory service call failed: %s", exc.code().name)
            raise _gateway_error(exc) from None


def command_client(settings: Settings, channel: grpc.aio.Channel) -> MemoryClient:
    """The client of a command-line tool (``import``, ``forget``) on ``channel``, with the
    deadlines and token of ``settings``."""
    return MemoryClient(
        channel,
        recall_budget_s=settings.recall_budget_s,
        rpc_timeout_s=settings.memory_timeout_s,
        metadata=memory_call_metadata(settings),
    )
