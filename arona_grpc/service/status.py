"""Status: configuration, breaker, outbox and the newest events of the ring."""

from __future__ import annotations

import itertools
import logging
from datetime import UTC, datetime

from arona_grpc.service.core import DomainCore
from arona_grpc.service.model import (
    DEFAULT_STATUS_LIMIT,
    EVENT_BUFFER_SIZE,
    MemoryEvent,
    StatusSnapshot,
)

logger = logging.getLogger(__name__)


class StatusPart(DomainCore):
    """:meth:`status`."""

    def status(self, limit: int = 0) -> StatusSnapshot:
        """Configuration, breaker, outbox and the most recent events, newest first."""
        limit = min(limit or DEFAULT_STATUS_LIMIT, EVENT_BUFFER_SIZE)
        self.storage.recheck()
        newest_first = tuple(
            MemoryEvent(e.kind, e.detail, datetime.fromtimestamp(e.at, UTC), e.scope_id)
            for e in itertools.islice(reversed(self._events), limit)
        )
        outbox = self._outbox
        return StatusSnapshot(
            self.enabled,
            self.writeback_enabled,
            newest_first,
            breaker=self._breaker.state,
            breaker_opened_at=self._breaker.opened_at,
            outbox_depth=outbox.depth if outbox is not None else 0,
            outbox_dropped=outbox.dropped if outbox is not None else 0,
            scope_mode=self._settings.memory_scope,
            outbox_bytes=outbox.bytes if outbox is not None else 0,
            dead_letters=outbox.dead_letters if outbox is not None else 0,
            recent_dead_letters=outbox.recent_dead_letters if outbox is not None else (),
            storage_faults=self.storage.current(),
            stores=self.stores(),
        )
