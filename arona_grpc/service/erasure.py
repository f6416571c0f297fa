"""Deletion and erasure: one node deleted, or everything of a scope, a principal, the episodes
of no scope, or everyone forgotten, from the outbox, Philia, the episode index and the events;
other replicas of a shared index are told, and clear their events too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable

from arona_common.storage import write_error
from arona_grpc.episodes import (
    EVERYONE,
    IndexUnavailable,
    Whose,
)
from arona_grpc.philia import PhiliaError
from arona_grpc.scopes import (
    principal_error,
    scope_id,
)
from arona_grpc.service.core import DomainCore
from arona_grpc.service.model import (
    DATABASE_UNAVAILABLE,
    EVENT_BUFFER_SIZE,
    FORGET_BATCH,
    NOT_IN_MEMORY,
    NOT_INDEXED,
    OTHER_SCOPE,
    DeleteOutcome,
    EventKind,
    InvalidArgument,
    MemoryDomainError,
    MemoryUnavailable,
    NotConfigured,
    checked_scope,
)

logger = logging.getLogger(__name__)


class ErasurePart(DomainCore):
    """:meth:`delete` and :meth:`forget`."""

    async def delete(self, node_id: str, scope: str = "", *, own: bool = False) -> DeleteOutcome:
        """Delete one node; whether it existed, and why not when it did not.

        In ``shared`` mode any node is deleted in Philia, as the seed has it. In ``user``
        mode only an indexed episode is: with ``scope``, one indexed for that scope (another
        scope's node is ``OTHER_SCOPE``); without, whoever's it is, as the index says (an
        admin's or an internal service's delete by id). A node the index does not know is
        ``NOT_INDEXED``; neither asks Philia. A deleted node leaves the index and the events
        its turn recorded (its question among them). ``own``: in either mode, only a node
        the index holds for exactly ``scope`` (for no scope when it is empty).
        """
        if not node_id.strip():
            raise InvalidArgument("node_id is required")
        if self._client is None or self._index is None:
            raise NotConfigured("memory is not configured (ARONA_MEMORY_URL, ARONA_MEMORY_TOKEN)")
        if self._user_scoped or own:
            sid = await self._indexed_owner(node_id)
            if sid is None:
                return DeleteOutcome(False, NOT_INDEXED)
            if (scope or own) and sid != (scope_id(checked_scope(scope)) if scope else ""):
                return DeleteOutcome(False, OTHER_SCOPE)
        else:
            sid = self._scope_id(scope)
        deleted = await self._philia_delete(node_id, sid)
        self._clear_events(None, [node_id])
        await self._unindex([node_id])
        await self._note_erasure(None, [node_id])
        return DeleteOutcome(True) if deleted else DeleteOutcome(False, NOT_IN_MEMORY)

    async def forget(
        self,
        scope: str = "",
        *,
        principal: str = "",
        anonymous: bool = False,
        everything: bool = False,
    ) -> int:
        """Erase the episodes of one ``scope``, of every scope of one ``principal`` (its own
        and those it narrowed to), of no scope (``anonymous``), or ``everything``; how many
        Philia deleted.

        Everything the service keeps of them goes: their episodes waiting in the outbox and
        their dead letters, the nodes in Philia (deleted together, :data:`FORGET_BATCH` at a
        time), their index entries, and their events (the questions their turns recalled
        with), with nothing of them left in the files' logs. An episode leaves the index
        once Philia has deleted it (or no longer has it), so a call that stopped half-way
        (Philia down) can simply be made again; it says so.
        """
        if sum((bool(scope), bool(principal), anonymous, everything)) != 1:
            raise InvalidArgument("forget one scope, one principal, the anonymous, or everything")
        if self._client is None or self._index is None:
            raise NotConfigured("memory is not configured (ARONA_MEMORY_URL, ARONA_MEMORY_TOKEN)")
        if scope:
            whose = Whose(scope_id=scope_id(checked_scope(scope)))
        elif principal:
            problem = principal_error(principal)
            if problem is not None:
                raise InvalidArgument(f"principal {problem}")
            whose = Whose(principal_id=scope_id(principal))
        else:
            whose = Whose(scope_id="") if anonymous else EVERYONE
        try:
            if self._outbox is not None:
                await self._outbox.forget(whose)
            await self._index.written()
            node_ids = await self._index.node_ids(whose)
        except IndexUnavailable as exc:
            raise MemoryUnavailable(str(exc), code=DATABASE_UNAVAILABLE) from None
        except MemoryDomainError:
            raise
        except Exception as exc:  # the outbox's file or database
            raise MemoryUnavailable(
                f"the outbox could not be cleared ({write_error(exc)}): nothing was forgotten",
                code=DATABASE_UNAVAILABLE,
            ) from None
        sid = whose.scope_id or ""
        deleted = 0
        done: list[str] = []
        try:
            for start in range(0, len(node_ids), FORGET_BATCH):
                batch = node_ids[start : start + FORGET_BATCH]
                results = await asyncio.gather(
                    *(self._philia_delete(node_id, sid) for node_id in batch),
                    return_exceptions=True,
                )
                failure: BaseException | None = None
                for node_id, result in zip(batch, results, strict=True):
                    if isinstance(result, BaseException):
                        failure = failure or result
                        continue
                    deleted += result
                    done.append(node_id)
                if failure is not None:
                    raise failure
        except MemoryDomainError as exc:
            raise type(exc)(
                f"{exc} ({deleted} of {len(node_ids)} episode(s) deleted; call again for the rest)",
                code=exc.code,
            ) from None
        finally:
            self._clear_events(whose if len(done) == len(node_ids) else None, done)
            await self._unindex(done)
        await self._note_erasure(whose, [])
        return deleted

    async def _note_erasure(self, whose: Whose | None, node_ids: list[str]) -> None:
        """Tell the other replicas of a shared index to clear their events too."""
        assert self._index is not None
        try:
            await self._index.note_erasure(whose, node_ids)
        except IndexUnavailable as exc:
            raise MemoryUnavailable(
                f"forgotten, but the other replicas could not be told ({exc}): try again",
                code=DATABASE_UNAVAILABLE,
            ) from None

    async def clear_erased_events(self) -> None:
        """Clear the events of what other replicas of a shared index forgot since the oldest
        event here (Status calls it first)."""
        if self._index is None or not self._events:
            return
        try:
            erased = await self._index.erasures_since(int(self._events[0].at * 1_000_000))
        except IndexUnavailable:
            return  # said by the index; the events stay until it answers
        for whose, node_ids in erased:
            self._clear_events(whose, node_ids)

    def _clear_events(self, whose: Whose | None, node_ids: Iterable[str] = ()) -> None:
        """Forget the events of ``whose`` (every one of its scopes) and of these nodes."""
        gone = set(node_ids)
        kept = [
            e
            for e in self._events
            if not (e.node_id in gone or (whose is not None and whose.holds(e.scope_id, e.pid)))
        ]
        if len(kept) != len(self._events):
            self._events = deque(kept, maxlen=EVENT_BUFFER_SIZE)

    async def _indexed_owner(self, node_id: str) -> str | None:
        assert self._index is not None
        try:
            return await self._index.owner(node_id)
        except IndexUnavailable as exc:
            raise MemoryUnavailable(str(exc), code=DATABASE_UNAVAILABLE) from None

    async def _unindex(self, node_ids: list[str]) -> None:
        """Take deleted episodes out of the index, leaving nothing of them in its files."""
        if self._index is None or not node_ids:
            return
        try:
            await self._index.remove(node_ids)
            await self._index.erase()
        except IndexUnavailable:
            logger.warning("%d deleted episode(s) are still in the episode index", len(node_ids))
            raise MemoryUnavailable(
                "deleted from memory, but the episode index could not be cleared: try again",
                code=DATABASE_UNAVAILABLE,
            ) from None

    async def _philia_delete(self, node_id: str, sid: str) -> bool:
        """One ``Sync.MemoryDeleteRequest`` behind the breaker; whether the node existed."""
        assert self._client is not None
        permit = self._breaker.admit()
        if permit is None:
            raise MemoryUnavailable(
                f"memory breaker open (retry in {self._breaker.cooldown_left():.1f} s)"
            )
        try:
            deleted = await self._client.delete(node_id)
        except PhiliaError as exc:
            self._judged(permit, exc)
            raise self._fault("delete", exc, sid) from None
        except asyncio.CancelledError:
            self._breaker.abandon(permit)
            raise
        self._succeeded(permit)
        self._record(EventKind.DELETE, node_id, sid)
        return deleted
