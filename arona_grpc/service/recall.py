"""Recall: the memories for a turn's question and their section, within the caller's deadline
and behind the breaker; Philia's faults become ``OFFLINE``, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import time

from arona_grpc.philia import PhiliaError
from arona_grpc.scopes import (
    is_scoped_node_type,
    principal_id,
    scoped_node_type,
)
from arona_grpc.service.core import DomainCore
from arona_grpc.service.model import (
    CUT_OFF_SHARE,
    DEADLINE_MARGIN_S,
    DEFAULT_RECALL_LIMIT,
    MAX_MEMORY_CHARS,
    MAX_RECALL_LIMIT,
    MAX_SECTION_CHARS,
    EventKind,
    MemoryState,
    RecallOutcome,
)
from arona_grpc.service.section import capped_section
from arona_grpc.sizes import fitted_query

logger = logging.getLogger(__name__)


class RecallPart(DomainCore):
    """:meth:`recall`."""

    async def recall(
        self, query: str, limit: int = 0, *, scope: str = "", deadline_s: float | None = None
    ) -> RecallOutcome:
        """Memories for ``query`` and their section; Philia faults give ``OFFLINE``.

        In ``user`` mode only ``scope``'s episodes are recalled (an empty scope is refused).
        ``deadline_s`` is the caller's remaining time: the recall ends before it.
        """
        sid = self._scope_id(scope)
        if self._client is None or not query.strip():
            return RecallOutcome(MemoryState.DISABLED, (), "")
        pid = principal_id(scope)
        limit = min(limit or DEFAULT_RECALL_LIMIT, MAX_RECALL_LIMIT)
        budget_s = self._settings.recall_budget_s
        if deadline_s is not None:
            budget_s = min(budget_s, deadline_s - DEADLINE_MARGIN_S)
        if budget_s <= 0:
            return RecallOutcome(MemoryState.OFFLINE, (), "")
        permit = self._breaker.admit()
        if permit is None:
            # No event per refused turn: the opening itself was recorded.
            logger.debug("memory breaker open: recall skipped")
            return RecallOutcome(MemoryState.OFFLINE, (), "")
        node_type = scoped_node_type(sid) if self._user_scoped else None
        # A long question is recalled by its last part (arona_grpc.sizes).
        query = fitted_query(
            query,
            self._settings.memory_max_query_chars,
            {"limit": limit, "node_type_filter": node_type or ""},
        )
        started = time.monotonic()
        try:
            found = await self._client.query(query, limit, timeout_s=budget_s, node_type=node_type)
        except PhiliaError as exc:
            self._recall_failed(self._safe(f"recall failed: {exc}"), sid, permit, exc)
            return RecallOutcome(MemoryState.OFFLINE, (), "")
        except asyncio.CancelledError:
            if time.monotonic() - started < CUT_OFF_SHARE * budget_s:
                self._breaker.abandon(permit)
                raise
            self._recall_failed(
                "recall failed: no answer from Philia within "
                f"{budget_s:.3g} s (the caller's deadline ended it)",
                sid,
                permit,
            )
            raise
        self._succeeded(permit)
        self._record(EventKind.RECALL, query, sid, pid)
        if not self._user_scoped:
            # One user's episodes (stored in user mode, by this or another gateway on the same
            # Philia) are never shared memory: Philia returns them to an unfiltered query.
            found = [m for m in found if not is_scoped_node_type(m.node_type)]
        kept, section = capped_section(found, MAX_SECTION_CHARS, MAX_MEMORY_CHARS)
        if not kept:
            return RecallOutcome(MemoryState.DISABLED, (), "")
        return RecallOutcome(MemoryState.ENABLED, kept, section)
