"""The facade: :class:`MemoryDomain` composed of its parts, and its shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arona_grpc.service.erasure import ErasurePart
from arona_grpc.service.listing import ListingPart
from arona_grpc.service.recall import RecallPart
from arona_grpc.service.status import StatusPart
from arona_grpc.service.writeback import WritebackPart

logger = logging.getLogger(__name__)


class MemoryDomain(RecallPart, WritebackPart, ErasurePart, ListingPart, StatusPart):
    """Recall, Writeback, Delete, List, Forget and Status over one lazily connected
    Philia client (or a pool of stores, when ``ARONA_MEMORY_URL`` names several)."""

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Give in-flight writebacks and the replay ``grace_s``, keep the rest, close."""
        if self._closing:
            return
        self._closing = True
        self._closed_event.set()
        self._wake.set()
        if self._watch_task is not None:
            self._watch_task.cancel()
        waits: set[asyncio.Future[Any]] = set()
        if not self._inflight_idle.is_set():
            waits.add(asyncio.ensure_future(self._inflight_idle.wait()))
        if self._replay_task is not None:
            waits.add(self._replay_task)
        if waits:
            await asyncio.wait(waits, timeout=grace_s)
        if self._outbox is not None:
            for record in self._inflight.values():
                if not record.kept:
                    record.kept = True
                    self._put_soon(record.episode)
            if self._inflight:
                logger.warning(
                    "%d writeback(s) still in flight at shutdown: kept in the outbox",
                    len(self._inflight),
                )
        for waiting in waits:
            waiting.cancel()
        if waits:
            await asyncio.wait(waits)
        self._fail_waiters("the memory service is stopping; the episode stays queued")
        if self._client is not None:
            await self._client.aclose()
        if self._outbox is not None:
            await self._outbox.aclose()
        if self._index is not None:
            await self._index.aclose()
