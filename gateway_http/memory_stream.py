"""Recall and Writeback carried over ``MemoryService/Exchange`` streams.

A unary gRPC call per recall and per writeback costs more CPU than the rest of a memory
turn's hop together; the same calls multiplexed over long-lived bidirectional streams cost
a fraction of it. :class:`ExchangeStream` is one such stream: each call gets its own id,
deadline and request id, replies are matched by id in whatever order they come, a call the
caller gives up on (its turn was cancelled, its deadline passed) is cancelled on the
service too, and a broken stream fails every call pending on it at once.

:class:`StreamPool` keeps ``per_channel`` streams on each channel (one channel per gRPC
replica) and spreads calls over the open ones. A stream that breaks is opened again in the
background, with a backoff while its replica stays away; calls meanwhile go to the other
replicas' streams. Only when no stream is open does a call wait, within its own deadline,
for one to open.

A failed call raises :class:`CallFailed`, which carries what a failed unary call would:
its status code, message, and the ``arona-error-code``/``arona-queued`` trailers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.batching import BatchWriter
from arona_grpc.logs import REQUEST_ID

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# What read() returns at the end of a stream.
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]

# How long a writeback waits to go out with the next call (a turn's recall, usually) instead
# of in a write of its own. Nobody waits for a writeback: going out with the next recall it
# costs one gRPC write less, and its work is done while the recall waits for Philia.
WRITEBACK_LINGER_S = 0.01

# How long a replica whose stream could not be opened is left alone before the next try
# (doubling up to the most, as the channel's own reconnect backoff).
MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.0


class CallFailed(Exception):
    """A call that ended without a reply: the status a unary call would have ended with."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str = "",
        error_code: str = "",
        queued: bool = False,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.error_code = error_code
        self.queued = queued


def _failed(error: pb.CallError) -> CallFailed:
    return CallFailed(
        _CODES.get(error.code, grpc.StatusCode.UNKNOWN),
        error.message,
        error.error_code,
        error.queued,
    )


def _seen(future: asyncio.Future[None]) -> None:
    """Mark a future's exception as retrieved (nobody may be waiting for it)."""
    if not future.cancelled():
        future.exception()


class ExchangeStream:
    """One ``Exchange`` stream; opens itself when made (call from a running loop)."""

    def __init__(
        self, stub: pb_grpc.MemoryServiceAsyncStub, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # No request iterator: this object writes (grpc.aio's reader/writer style).
        self._call = stub.Exchange(None, metadata=metadata)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[pb.Reply]] = {}
        # Calls and cancellations not written yet: the next write takes them all.
        self._batch = pb.ExchangeRequest()
        # When each call of the batch must be answered by (monotonic seconds).
        self._deadlines: list[float] = []
        # The only writer of the stream's calls (lingering ones wait for the next call).
        self._writer = BatchWriter(
            self._write_batch, lambda: bool(self._batch.calls), WRITEBACK_LINGER_S, open=True
        )
        self.hello: pb.Hello | None = None
        # Done when the service's hello arrives, or failed with CallFailed.
        self.opened: asyncio.Future[None] = self._loop.create_future()
        self.opened.add_done_callback(_seen)
        self.dead = False
        # Open, and takes new calls: not dead, and the service has not said goodbye.
        self.usable = False
        # Said goodbye, or retired: takes no new call, ends once the pending ones are answered.
        self._retired = False
        self._closing = False
        self.failure: CallFailed | None = None
        self._reader = self._loop.create_task(self._read(), name="memory-stream-reader")

    @property
    def ended(self) -> asyncio.Future[None]:
        """Done once the stream is over (its reader has stopped)."""
        return self._reader

    @property
    def closing(self) -> bool:
        """The service said goodbye: the stream ends once its pending calls are answered."""
        return self.hello is not None and not self.usable and not self.dead

    def start(self, timeout_s: float, *, linger: bool = False) -> tuple[int, pb.Call]:
        """A new call, to be filled in before the caller's next ``await``; then :meth:`reply`.

        ``linger``: the call may wait up to :data:`WRITEBACK_LINGER_S` for the next one, to
        go out with it."""
        call_id = next(self._ids)
        call = self._batch.calls.add(id=call_id)
        # Its timeout is what is left of it when it is written (see _write_batch).
        self._deadlines.append(time.monotonic() + timeout_s)
        request_id = REQUEST_ID.get()
        if request_id is not None:
            call.request_id = request_id
        if not self.dead:
            self._pending[call_id] = self._loop.create_future()
            if linger:
                self._writer.linger()
            else:
                self._writer.kick()
        return call_id, call

    async def reply(self, call_id: int, timeout_s: float) -> pb.Reply:
        """The reply to a started call; raises :class:`CallFailed` as a unary call would."""
        future = self._pending.get(call_id)
        if future is None:
            # The stream broke between start() and now.
            raise self.failure or CallFailed(grpc.StatusCode.UNAVAILABLE, "stream closed")
        timer = self._loop.call_later(timeout_s, self._expire, call_id)
        try:
            reply = await future
        except asyncio.CancelledError:
            if self._pending.pop(call_id, None) is not None:
                self._cancel(call_id)
            raise
        finally:
            timer.cancel()
        if reply.WhichOneof("result") == "error":
            raise _failed(reply.error)
        return reply

    def retire(self) -> None:
        """Take no new calls, and end the stream once the pending ones are answered."""
        if self.dead or self._retired:
            return
        self._retired = True
        self.usable = False
        self._closing = True
        self._writer.kick()

    def close(self) -> None:
        self._fail_all(CallFailed(grpc.StatusCode.CANCELLED, "the gateway is stopping"))
        self._call.cancel()
        self._reader.cancel()

    def _expire(self, call_id: int) -> None:
        future = self._pending.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._cancel(call_id)

    def _cancel(self, call_id: int) -> None:
        if not self.dead:
            self._batch.cancel.append(call_id)
            self._writer.kick()

    async def _write_batch(self) -> bool:
        """Write the calls and cancellations waiting, then, retired with none left, close
        this side; whether another write may follow."""
        try:
            wrote = bool(self._batch.calls or self._batch.cancel)
            if wrote:
                batch, self._batch = self._batch, pb.ExchangeRequest()
                deadlines, self._deadlines = self._deadlines, []
                # The service's deadline for a call is the caller's, as a unary call's is:
                # what is left when it leaves, not what was asked when it was made.
                now = time.monotonic()
                for call, deadline in zip(batch.calls, deadlines, strict=True):
                    call.timeout_ms = max(1, int((deadline - now) * 1000))
                await self._call.write(batch)
            # In the same round as the last calls (a retire's kick is spent on writing them).
            if self._closing and not (self._batch.calls or self._batch.cancel):
                self._closing = False
                await self._call.done_writing()
                return False
        except grpc.aio.AioRpcError as exc:
            self._fail_all(CallFailed(exc.code(), exc.details() or ""))
            return False
        except asyncio.InvalidStateError:
            self._fail_all(CallFailed(grpc.StatusCode.UNAVAILABLE, "the stream has ended"))
            return False
        return wrote

    async def _read(self) -> None:
        pending = self._pending
        try:
            while True:
                message = await self._call.read()
                if message is _EOF:
                    self._fail_all(CallFailed(grpc.StatusCode.UNAVAILABLE, "the stream ended"))
                    return
                assert isinstance(message, pb.ExchangeResponse)
                for reply in message.replies:
                    future = pending.pop(reply.id, None)
                    if future is not None and not future.done():
                        future.set_result(reply)
                if message.HasField("hello"):
                    self.hello = message.hello
                    self.usable = not self._retired
                    if not self.opened.done():
                        self.opened.set_result(None)
                if message.goodbye:
                    # The replica is stopping: no new calls here; the pending ones are
                    # answered before the stream ends.
                    self.retire()
        except grpc.aio.AioRpcError as exc:
            self._fail_all(CallFailed(exc.code(), exc.details() or ""))
        except asyncio.CancelledError:
            self._fail_all(CallFailed(grpc.StatusCode.CANCELLED, "the stream was closed"))
            raise

    def _fail_all(self, failure: CallFailed) -> None:
        """The stream is gone: every pending call fails with ``failure``, now."""
        if self.dead:
            return
        self.dead = True
        self.usable = False
        self._writer.open = False
        self.failure = failure
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(failure)
        if not self.opened.done():
            self.opened.set_exception(failure)
        self._call.cancel()


class _Slot:
    """A place for one stream on one replica's channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.MemoryServiceStub(channel)
        self.stream: ExchangeStream | None = None
        self.retry_at = 0.0
        self.backoff_s = MIN_BACKOFF_S

    @property
    def usable(self) -> bool:
        """Its stream is open and takes new calls."""
        return self.stream is not None and self.stream.usable


class StreamPool:
    """``per_channel`` Exchange streams on each channel, calls spread over the open ones."""

    def __init__(
        self,
        channels: Sequence[grpc.aio.Channel],
        per_channel: int,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if not channels or per_channel < 1:
            raise ValueError("a stream pool needs a channel and a stream per channel")
        self._metadata = metadata
        self._per_channel = per_channel
        self._channels: list[grpc.aio.Channel] = []
        self._slots: list[_Slot] = []
        self._next = 0
        self.replace(channels)
        # Resolves the replicas again (set by the replica watch): awaited when a call finds no
        # stream open, started when a replica's stream does not open.
        self.refresh: Callable[[], Coroutine[Any, Any, None]] | None = None
        self._refreshing: set[asyncio.Task[None]] = set()
        # What the last hello said: skip writebacks while the service stores none.
        self.writeback_off = False
        # The service has no Exchange (an older version): use unary calls.
        self.unimplemented = False
        self._closed = False

    @property
    def open_streams(self) -> int:
        return sum(1 for slot in self._slots if slot.usable)

    def streams_on(self, channel: grpc.aio.Channel) -> tuple[int, int]:
        """How many of ``channel``'s streams are open now, and how many it has."""
        mine = [slot for slot in self._slots if slot.channel is channel]
        open_now = sum(1 for slot in mine if slot.usable)
        return open_now, len(mine)

    @property
    def channels(self) -> list[grpc.aio.Channel]:
        """The channels calls are spread over, one per replica."""
        return list(self._channels)

    def channel(self) -> grpc.aio.Channel:
        """A channel to a replica with an open stream (the first one when none has)."""
        for slot in self._slots:
            if slot.usable:
                return slot.channel
        return self._channels[0]

    def replace(self, channels: Sequence[grpc.aio.Channel]) -> None:
        """Spread calls over ``channels`` from now on. A channel that stays keeps its streams;
        a new one gets its own; the streams of one that is gone take no new calls and end
        once their pending calls are answered."""
        if not channels:
            raise ValueError("a stream pool needs a channel")
        had: dict[int, list[_Slot]] = {}
        for slot in self._slots:
            had.setdefault(id(slot.channel), []).append(slot)
        # Interleaved, so that consecutive calls go to different replicas.
        slots = []
        for turn in range(self._per_channel):
            for channel in channels:
                kept = had.get(id(channel))
                slots.append(kept[turn] if kept else _Slot(channel))
        staying = {id(channel) for channel in channels}
        for key, gone in had.items():
            if key not in staying:
                for slot in gone:
                    if slot.stream is not None:
                        slot.stream.retire()
        self._channels = list(channels)
        self._slots = slots
        self._next = 0

    def next_open(self, *, stay: bool = False) -> ExchangeStream | None:
        """The next open stream, None when none is (then :meth:`stream` waits for one).

        ``stay``: the next call gets the same stream (a lingering call then goes out with
        it)."""
        slots = self._slots
        count = len(slots)
        for _ in range(count):
            slot = slots[self._next]
            stream = slot.stream
            if stream is not None and stream.usable:
                if not stay:
                    self._next = (self._next + 1) % count
                return stream
            self._next = (self._next + 1) % count
            self._reopen(slot)
        return None

    async def stream(self, timeout_s: float) -> ExchangeStream:
        """The next open stream; waits (at most ``timeout_s``) only when none is open."""
        found = self.next_open()
        if found is not None:
            return found
        deadline = time.monotonic() + timeout_s
        tried = False
        while True:
            opening = self._opening()
            if not opening and not tried:
                tried = True
                if self.refresh is not None:
                    # The replicas may have moved (a name's addresses changed): resolve
                    # again first, within this call's time (others keep the result).
                    left = deadline - time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self.refresh()), max(left, 0))
                # Nothing open and nothing opening: this call tries every replica now, as a
                # unary call would (a refused connection fails it at once; the channels'
                # own reconnect backoff keeps a dead replica from being dialled each time).
                for slot in self._slots:
                    self._reopen(slot, now=True)
                opening = self._opening()
            if not opening:
                raise CallFailed(
                    grpc.StatusCode.UNAVAILABLE, "no stream to the memory service is open"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            await asyncio.wait(opening, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            found = self.next_open()
            if found is not None:
                return found

    async def wait_open(self, timeout_s: float) -> int:
        """Open every stream that is not open and wait (at most ``timeout_s``) until each has
        opened or failed; how many are open."""
        for slot in self._slots:
            self._reopen(slot, now=True)
        opening = self._opening()
        if opening:
            await asyncio.wait(opening, timeout=timeout_s)
        return self.open_streams

    def _opening(self) -> list[asyncio.Future[None]]:
        return [
            slot.stream.opened
            for slot in self._slots
            if slot.stream is not None and not slot.stream.dead and slot.stream.hello is None
        ]

    def close(self) -> None:
        self._closed = True
        for slot in self._slots:
            if slot.stream is not None:
                slot.stream.close()
                slot.stream = None

    def _reopen(self, slot: _Slot, *, now: bool = False) -> None:
        """Open the slot's stream if it has none or a dead one; unless ``now``, not while
        its replica is in its backoff."""
        if slot.stream is not None and not slot.stream.dead and not slot.stream.closing:
            return
        if self._closed or (not now and time.monotonic() < slot.retry_at):
            return
        stream = ExchangeStream(slot.stub, self._metadata)
        slot.stream = stream
        stream.opened.add_done_callback(lambda opened: self._opened(slot, stream, opened))

    def _opened(self, slot: _Slot, stream: ExchangeStream, opened: asyncio.Future[None]) -> None:
        if slot not in self._slots:
            return  # its replica is gone
        if not opened.cancelled() and opened.exception() is None:
            slot.backoff_s = MIN_BACKOFF_S
            assert stream.hello is not None
            self.writeback_off = not stream.hello.writeback
            return
        failure = stream.failure
        if failure is not None and failure.code == grpc.StatusCode.UNIMPLEMENTED:
            self.unimplemented = True
        slot.retry_at = time.monotonic() + slot.backoff_s
        slot.backoff_s = min(slot.backoff_s * 2, MAX_BACKOFF_S)
        logger.debug("a memory stream did not open: %s", failure)
        if self.refresh is not None and not self._closed and not self._refreshing:
            # Perhaps that replica moved: look again (the watch does it at most once a second).
            task = asyncio.get_running_loop().create_task(self.refresh())
            self._refreshing.add(task)
            task.add_done_callback(self._refreshing.discard)
