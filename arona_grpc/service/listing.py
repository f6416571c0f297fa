"""Listing: a page of a scope's stored episodes from the episode index, newest first."""

from __future__ import annotations

import logging

from arona_grpc.episodes import (
    IndexPage,
    IndexUnavailable,
)
from arona_grpc.scopes import (
    scope_id,
)
from arona_grpc.service.core import DomainCore
from arona_grpc.service.model import (
    DATABASE_UNAVAILABLE,
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    InvalidArgument,
    MemoryUnavailable,
    NotConfigured,
    checked_scope,
)

logger = logging.getLogger(__name__)


class ListingPart(DomainCore):
    """:meth:`list_episodes`."""

    async def list_episodes(
        self,
        scope: str,
        limit: int = 0,
        before: str = "",
        *,
        anonymous: bool = False,
        contains: str = "",
    ) -> IndexPage:
        """A page of ``scope``'s stored episodes (``anonymous``: of those stored with no
        scope), newest first, only those whose preview holds ``contains`` when given (see
        :class:`IndexPage`)."""
        if anonymous == bool(scope):
            raise InvalidArgument("give a scope, or ask for the episodes of no scope")
        sid = scope_id(checked_scope(scope)) if scope else ""
        if before and not (before.isascii() and before.isdigit() and len(before) <= 18):
            raise InvalidArgument("before must be a cursor returned as next")
        if self._index is None:
            raise NotConfigured("memory is not configured (ARONA_MEMORY_URL, ARONA_MEMORY_TOKEN)")
        limit = min(limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        try:
            return await self._index.page(
                sid, limit, int(before) if before else None, contains=contains
            )
        except IndexUnavailable as exc:
            raise MemoryUnavailable(str(exc), code=DATABASE_UNAVAILABLE) from None
