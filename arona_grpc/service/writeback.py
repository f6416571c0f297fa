"""Writeback: one turn stored as an episode (dated, fenced, scoped), straight to Philia on the
healthy path, behind the outbox when it is not empty, into it when Philia fails; an episode sent
again under its caller's id is not stored twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from arona_grpc.philia import PhiliaError
from arona_grpc.scopes import (
    EPISODE_NODE_TYPE,
    principal_id,
    scoped_node_type,
)
from arona_grpc.service.model import (
    MAX_FUTURE_SKEW_S,
    OUTBOX_PART,
    Episode,
    InFlight,
    InvalidArgument,
    MemoryDomainError,
    MemoryUnavailable,
    WritebackOutcome,
)
from arona_grpc.service.replay import OutboxPart
from arona_grpc.service.section import without_memory_section
from arona_grpc.sizes import fitted_episode

logger = logging.getLogger(__name__)


def checked_occurred_at(occurred_at: float | None, now: float) -> float | None:
    """A writeback's ``occurred_at`` (POSIX seconds) as stored: None stays None (now); a
    time up to :data:`MAX_FUTURE_SKEW_S` ahead of ``now`` becomes ``now``.

    Raises :class:`InvalidArgument` for a time before 1970-01-01T00:00:00Z or further ahead.
    """
    if occurred_at is None:
        return None
    if not occurred_at >= 0.0:  # NaN too
        raise InvalidArgument("occurred_at is before 1970-01-01T00:00:00Z")
    if occurred_at > now + MAX_FUTURE_SKEW_S:
        ahead = _rfc3339(occurred_at)
        raise InvalidArgument(
            f"occurred_at {ahead} is in the future (more than {MAX_FUTURE_SKEW_S:.0f} s from now)"
        )
    return min(occurred_at, now)


def _rfc3339(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:.0f} s after 1970"


class WritebackPart(OutboxPart):
    """:meth:`writeback`, in front of the outbox."""

    async def writeback(
        self,
        user: str,
        assistant: str,
        scope: str = "",
        episode_id: str = "",
        occurred_at: float | None = None,
    ) -> WritebackOutcome:
        """Store the turn as an episode, unless memory or writeback is off or it is empty.

        ``occurred_at`` (POSIX seconds; None: now) is when the turn happened; see
        :func:`checked_occurred_at` for what is refused.

        In ``user`` mode the episode's node type is ``episode:<scope id>`` (an empty scope is
        refused). An episode that cannot be stored now is kept in the outbox (the error says
        so). A stored episode is noted in the episode index. An episode sent again with an
        ``episode_id`` that is already waiting in the outbox is not queued twice. A stored
        episode is answered once its index entry can be read (by every replica of a shared
        index), so the caller's next ``List`` shows it.
        """
        sid = self._scope_id(scope)
        received = time.time()
        occurred_at = checked_occurred_at(occurred_at, received)
        if self._client is None or self._outbox is None:
            return WritebackOutcome(stored=False)
        node_type = scoped_node_type(sid) if self._user_scoped else EPISODE_NODE_TYPE
        # Each side at most ARONA_MEMORY_MAX_EPISODE_CHARS, the request within Philia's frame
        # budget (arona_grpc.sizes).
        text = fitted_episode(
            without_memory_section(user),
            without_memory_section(assistant),
            node_type,
            self._settings.memory_max_episode_chars,
        )
        if not text:
            return WritebackOutcome(stored=False)
        episode = Episode(
            text,
            node_type,
            sid,
            episode_id,
            occurred_at,
            received,
            principal_id=principal_id(scope),
            asked=without_memory_section(user),
        )
        try:
            outcome = await self._writeback(episode)
        except MemoryDomainError as exc:
            exc.queued = episode.kept
            raise
        if sid and self._index is not None:
            # Read-your-write: once this answer is in, a List on any replica shows it.
            await self._index.written()
        return outcome

    async def _writeback(self, episode: Episode) -> WritebackOutcome:
        assert self._client is not None and self._outbox is not None
        text, node_type, sid = episode.text, episode.node_type, episode.scope_id
        if episode.episode_id:
            stored = self._stored_ids.get(episode.episode_id)
            if stored is not None:
                # Sent again after it was stored (the answer was lost, or the outbox stored
                # it meanwhile): the same episode, not a second copy.
                return WritebackOutcome(stored=True, node_id=stored)
        if self._closing:
            await self._keep(episode)
            raise MemoryUnavailable("the memory service is stopping; the episode is queued")
        if self._outbox.pending:
            return await self._queue_behind(episode)
        permit = self._breaker.admit()
        if permit is None:
            await self._keep(episode)
            raise MemoryUnavailable(
                "writeback queued in the outbox: memory breaker open "
                f"(retry in {self._breaker.cooldown_left():.1f} s)"
            )
        key = self._next_inflight
        self._next_inflight += 1
        record = self._inflight[key] = InFlight(episode)
        self._inflight_idle.clear()
        try:
            node_id = await self._client.store(text, node_type, occurred_at=episode.occurred_at)
        except PhiliaError as exc:
            self._judged(permit, exc)
            if exc.permanent:
                # Sending it again would be refused again: kept aside, not queued.
                already_kept, record.kept = record.kept, True
                raise await self._bury(episode, exc, queued=already_kept) from None
            # Recorded before the outbox write, so Status shows the failure at once.
            kept = (
                " (queued in the outbox)"
                if not self.storage.failing(OUTBOX_PART)
                else " (lost: the outbox cannot be written)"
            )
            error = self._fault("writeback", exc, sid, kept)
            if not record.kept:
                record.kept = True
                await self._keep(episode)
            raise error from None
        except asyncio.CancelledError:
            self._breaker.abandon(permit)
            if not record.kept:
                record.kept = True
                # Submitted now, committed even though this task is being cancelled.
                self._put_soon(episode)
            raise
        finally:
            del self._inflight[key]
            if not self._inflight:
                self._inflight_idle.set()
        self._succeeded(permit)
        self._stored(episode, node_id)
        return WritebackOutcome(stored=True, node_id=node_id)
