"""The writeback outbox: keeping an episode Philia cannot take now, and replaying the outbox
oldest first, a batch at a time, once Philia answers again (refused episodes go to the dead-letter
list; a shared outbox on PostgreSQL is watched for other replicas' episodes).
"""

from __future__ import annotations

import asyncio
import logging

from arona_common import tracing
from arona_common.storage import write_error
from arona_grpc.breaker import BreakerState, Permit
from arona_grpc.outbox import OutboxClosed, OutboxEntry
from arona_grpc.philia import PhiliaError
from arona_grpc.service.core import DomainCore
from arona_grpc.service.model import (
    MAX_DEAD_LETTER_REASON,
    MAX_REPLAY_BACKOFF_S,
    MAX_REPLAY_FAILURES,
    OUTBOX_FAULT_COST,
    OUTBOX_PART,
    OUTBOX_WATCH_S,
    REPLAY_BATCH,
    REPLAYED_MEMORY,
    Episode,
    EventKind,
    InvalidArgument,
    MemoryTimeout,
    MemoryUnavailable,
    WritebackOutcome,
    refused,
)

logger = logging.getLogger(__name__)


class OutboxPart(DomainCore):
    """The outbox and its replay."""

    async def start(self) -> None:
        """Pick up an outbox left by an earlier run and start replaying it."""
        if self._outbox is None:
            return
        try:
            await self._outbox.load()
        except Exception as exc:  # an unreadable file must not keep the service down
            logger.error("cannot read the outbox %s: %s", self._outbox.where, type(exc).__name__)
            self._record(EventKind.ERROR, "the outbox could not be read", "")
        if self._outbox.pending:
            logger.info("%d episode(s) in the outbox: replaying", self._outbox.depth)
            self._kick_replay()
        if self._outbox.shared:
            # Other replicas queue episodes too, and one that dies leaves its own behind.
            self._watch_task = asyncio.get_running_loop().create_task(
                self._watch_outbox(), name="outbox-watch"
            )

    async def _watch_outbox(self) -> None:
        """Look at the shared outbox every :data:`OUTBOX_WATCH_S` and help replay it."""
        assert self._outbox is not None
        while not self._closing:
            try:
                async with asyncio.timeout(OUTBOX_WATCH_S):
                    await self._closed_event.wait()
                return
            except TimeoutError:
                pass
            try:
                await self._outbox.refresh()
            except Exception as exc:  # the database is away: look again next time
                logger.debug("outbox watch: %s", type(exc).__name__)
                continue
            if self._outbox.pending:
                self._kick_replay()

    async def _keep(self, episode: Episode) -> int | None:
        """Put one episode in the outbox and start the replay; its sequence number, or None
        when its caller's id is already waiting there (sent again: not queued twice)."""
        assert self._outbox is not None
        try:
            seq = await asyncio.shield(
                self._outbox.put(
                    episode.text,
                    episode.node_type,
                    episode.scope_id,
                    episode.episode_id,
                    occurred_us=episode.occurred_us,
                    unless_queued=True,
                    principal_id=episode.principal_id,
                )
            )
        except OutboxClosed:
            raise MemoryUnavailable("the memory service is stopped; the episode is lost") from None
        except Exception as exc:  # the disk: full, read-only, corrupt file
            if self.storage.failed(OUTBOX_PART, self._outbox.where, exc, OUTBOX_FAULT_COST):
                self._record(
                    EventKind.ERROR,
                    f"cannot write the outbox: {write_error(exc)}; {OUTBOX_FAULT_COST}",
                    "",
                )
            raise MemoryUnavailable("writeback failed and the outbox could not keep it") from None
        self.storage.succeeded(OUTBOX_PART)
        episode.kept = True
        self._kick_replay()
        return seq

    def _put_soon(self, episode: Episode) -> None:
        """Submit one episode to the outbox without waiting (cancellation, shutdown)."""
        assert self._outbox is not None
        try:
            self._outbox.put(
                episode.text,
                episode.node_type,
                episode.scope_id,
                episode.episode_id,
                occurred_us=episode.occurred_us,
                principal_id=episode.principal_id,
            ).add_done_callback(_ignore_result)
        except OutboxClosed:
            logger.error("an in-flight writeback was lost: the outbox is already closed")

    async def _queue_behind(self, episode: Episode) -> WritebackOutcome:
        """Queue behind earlier episodes; wait (bounded) for this one to be stored."""
        seq = await self._keep(episode)
        if seq is None:
            raise MemoryUnavailable("writeback already queued in the outbox")
        if self._breaker.state is BreakerState.OPEN:
            raise MemoryUnavailable("writeback queued in the outbox: memory breaker open")
        stored = self._replayed.get(seq)
        if stored is not None:
            return WritebackOutcome(stored=True, node_id=stored)
        waiter = self._waiters.setdefault(seq, asyncio.get_running_loop().create_future())
        assert self._client is not None
        try:
            async with asyncio.timeout(self._client.timeout_s):
                node_id = await waiter
        except TimeoutError:
            raise MemoryTimeout("writeback queued in the outbox: not replayed in time") from None
        finally:
            self._waiters.pop(seq, None)
        return WritebackOutcome(stored=True, node_id=node_id)

    def _kick_replay(self) -> None:
        if self._closing or self._client is None or self._outbox is None:
            return
        if self._replay_task is None or self._replay_task.done():
            # Kicked by some call that succeeded, but none of that call's work.
            task = asyncio.get_running_loop().create_task(
                self._replay(), name="outbox-replay", context=tracing.untraced_context()
            )
            self._replay_task = task

    async def _replay(self) -> None:
        """Store the outbox oldest first, a batch at a time; stop when empty, closing or
        failing repeatedly.

        A batch's stores go out together over the one link (pipelined: Philia takes them as
        fast as it can answer); the ones stored leave the outbox in one transaction, one
        refused for what it is goes to the dead-letter list, and the rest wait for the next
        attempt. While the breaker is half open, the batch is its one probe call.
        """
        assert self._client is not None and self._outbox is not None
        failures = 0
        while not self._closing:
            try:
                entries = await self._outbox.oldest(REPLAY_BATCH)
            except Exception as exc:  # the outbox's database is away; a later kick retries
                logger.warning("outbox replay paused: %s", self._safe(str(exc)))
                return
            if not entries:
                return
            entries = await self._not_stored_yet(entries)
            if not entries:
                continue
            permit = self._breaker.admit()
            if permit is None:
                await self._release(*(entry.seq for entry in entries))
                self._fail_waiters("writeback queued in the outbox: memory breaker open")
                await self._pause(self._breaker.cooldown_left())
                continue
            if permit.probe and len(entries) > 1:
                # The probe is one call: the rest waits for its verdict.
                await self._release(*(entry.seq for entry in entries[1:]))
                entries = entries[:1]
            stores = [
                self._client.store(
                    entry.text, entry.node_type, occurred_at=entry.occurred_us / 1_000_000
                )
                for entry in entries
            ]
            try:
                results = await asyncio.gather(*stores, return_exceptions=True)
            except asyncio.CancelledError:
                self._breaker.abandon(permit)
                # Given back now, so another replica need not wait for the claims to run out.
                asyncio.get_running_loop().create_task(
                    self._release(*(entry.seq for entry in entries))
                )
                raise
            failed = await self._replayed_batch(permit, entries, results)
            if failed is None:
                failures = 0
                continue
            failures += 1
            message = self._safe(f"outbox replay failed: {failed}")
            logger.warning("%s (%d episode(s) kept)", message, self._outbox.depth)
            self._fail_waiters(f"writeback queued in the outbox: {message}")
            if failures >= MAX_REPLAY_FAILURES:
                self._record(EventKind.ERROR, message, "")
                return
            backoff = self._settings.memory_breaker_cooldown_s * 2 ** (failures - 1)
            await self._pause(
                max(self._breaker.cooldown_left(), min(backoff, MAX_REPLAY_BACKOFF_S))
            )
        logger.debug("outbox replay stopped: shutting down")

    async def _replayed_batch(
        self, permit: Permit, entries: list[OutboxEntry], results: list[str | BaseException]
    ) -> BaseException | None:
        """Settle one replayed batch: stored ones leave the outbox, refused ones go to the
        dead-letter list, failed ones are given back; the first failure, or None."""
        assert self._outbox is not None
        stored: list[tuple[OutboxEntry, str]] = []
        failed: list[tuple[OutboxEntry, BaseException]] = []
        for entry, result in zip(entries, results, strict=True):
            if isinstance(result, str):
                stored.append((entry, result))
            elif isinstance(result, PhiliaError) and result.permanent:
                await self._dead_letter(entry, result)
            else:
                if not isinstance(result, PhiliaError):
                    logger.error("outbox replay: a store failed", exc_info=result)
                failed.append((entry, result))
        faults = [r for _, r in failed if not isinstance(r, PhiliaError) or r.philia_fault]
        if faults:
            self._breaker.failure(permit)
        elif stored or len(failed) < len(entries):
            self._breaker.success(permit)
        else:
            self._breaker.abandon(permit)
        if failed:
            await self._release(*(entry.seq for entry, _ in failed))
        if stored:
            await self._settle_stored(stored)
        return failed[0][1] if failed else None

    async def _not_stored_yet(self, entries: list[OutboxEntry]) -> list[OutboxEntry]:
        """``entries`` but those stored meanwhile: their callers sent them again (a journal,
        an import) and the service stored them, having checked for them here just before a
        replay removed the rows it found. Those leave the outbox without a second store."""
        fresh: list[OutboxEntry] = []
        known: list[tuple[OutboxEntry, str]] = []
        for entry in entries:
            node_id = self._stored_ids.get(entry.episode_id) if entry.episode_id else None
            if node_id is None:
                fresh.append(entry)
            else:
                known.append((entry, node_id))
        if known:
            await self._settle_stored(known, replayed=False)
        return fresh

    async def _settle_stored(
        self, stored: list[tuple[OutboxEntry, str]], *, replayed: bool = True
    ) -> None:
        """Replayed episodes Philia stored: out of the outbox in one transaction, indexed,
        and their waiting writebacks answered (not ``replayed``: stored by a writeback
        already, indexed then)."""
        assert self._outbox is not None
        for entry, node_id in stored:
            # Known before the row goes: the same episode sent again meanwhile is this one.
            self._remember_id(entry.episode_id, node_id)
        try:
            await self._outbox.remove(*(entry.seq for entry, _ in stored))
        except Exception as exc:
            # Stored, but still queued: sent again later (the store keeps one copy).
            logger.warning(
                "%d replayed episode(s) stay in the outbox: %s", len(stored), self._safe(str(exc))
            )
        if self.metrics is not None and replayed:
            self.metrics.outbox_replayed(len(stored))
        for entry, node_id in stored:
            if replayed:
                self._stored(
                    Episode(
                        entry.text,
                        entry.node_type,
                        entry.scope_id,
                        entry.episode_id,
                        principal_id=entry.principal_id,
                    ),
                    node_id,
                )
            self._replayed[entry.seq] = node_id
            if len(self._replayed) > REPLAYED_MEMORY:
                self._replayed.popitem(last=False)
            waiter = self._waiters.pop(entry.seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(node_id)

    async def _bury(self, episode: Episode, exc: PhiliaError, *, queued: bool) -> InvalidArgument:
        """A writeback Philia refused for what it is: into the dead-letter list (unless the
        outbox has it already, to be moved there by the replay); the error to raise."""
        assert self._outbox is not None
        reason = self._safe(str(exc))[:MAX_DEAD_LETTER_REASON]
        if not queued:
            try:
                await self._outbox.bury(
                    episode.text,
                    episode.node_type,
                    episode.scope_id,
                    episode.episode_id,
                    episode.occurred_us,
                    reason,
                    episode.principal_id,
                )
            except Exception as error:  # the disk; the caller may send it again
                logger.error("could not keep a refused episode: %s", type(error).__name__)
                return InvalidArgument(f"Philia refused the episode ({reason})")
        episode.kept = True
        message = f"Philia refused an episode ({reason}): kept in the dead-letter list"
        logger.warning("%s", message)
        self._record(EventKind.ERROR, message, episode.scope_id)
        return refused(reason)

    async def _dead_letter(self, entry: OutboxEntry, exc: PhiliaError) -> None:
        """A queued episode Philia refused for what it is: to the dead-letter list, so the
        episodes behind it go on; its waiting writeback fails (the episode is kept there)."""
        assert self._outbox is not None
        reason = self._safe(str(exc))[:MAX_DEAD_LETTER_REASON]
        try:
            await self._outbox.dead_letter(entry.seq, reason)
        except Exception as error:  # given back: tried again with the next attempt
            logger.warning("could not move an episode to the dead-letter list: %s", error)
            await self._release(entry.seq)
            return
        message = f"Philia refused a queued episode ({reason}): moved to the dead-letter list"
        logger.warning("%s", message)
        self._record(EventKind.ERROR, message, entry.scope_id)
        waiter = self._waiters.pop(entry.seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(refused(reason))

    async def _release(self, *seqs: int) -> None:
        assert self._outbox is not None
        try:
            await self._outbox.release(*seqs)
        except Exception as exc:  # its claim runs out by itself
            logger.debug("outbox release failed: %s", type(exc).__name__)

    async def _pause(self, delay_s: float) -> None:
        """Wait ``delay_s`` or until woken (a successful call, shutdown)."""
        try:
            async with asyncio.timeout(max(delay_s, 0.0)):
                await self._wake.wait()
        except TimeoutError:
            pass
        if not self._closing:
            self._wake.clear()

    def _fail_waiters(self, message: str) -> None:
        waiters = list(self._waiters.values())
        self._waiters.clear()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(MemoryUnavailable(message))


def _ignore_result(future: asyncio.Future[int | None]) -> None:
    # Retrieve the outcome so a failed write is not reported as "never retrieved";
    # the outbox has already logged it.
    if not future.cancelled():
        future.exception()
