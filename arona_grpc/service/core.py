"""The state every part of :class:`~arona_grpc.service.MemoryDomain` shares, and what they all
use: the one Philia client (or the pool of stores), the breaker in front of it, the episode index,
the outbox, the ring of events that Status reports, and the bookkeeping of an episode once Philia
stored it (its event, its id remembered, its index entry).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from arona_common.storage import StorageFaults
from arona_grpc.breaker import CircuitBreaker, Permit
from arona_grpc.config import Settings
from arona_grpc.episodes import (
    EpisodeIndex,
    open_index,
)
from arona_grpc.metrics import ServiceMetrics
from arona_grpc.outbox import AnyOutbox, open_outbox
from arona_grpc.philia import PhiliaClient, PhiliaError, PhiliaTimeout
from arona_grpc.scopes import (
    is_scoped_node_type,
    scope_id,
)
from arona_grpc.service.model import (
    ANSWERED,
    EVENT_BUFFER_SIZE,
    REPLAYED_MEMORY,
    TIE_LOOKBACK,
    Episode,
    Event,
    EventKind,
    InFlight,
    InvalidArgument,
    MemoryDomainError,
    MemoryTimeout,
    MemoryUnavailable,
    checked_scope,
)
from arona_grpc.service.scope_mode import check_scope_mode
from arona_grpc.sizes import shortened
from arona_grpc.stores import MemoryLink, StoreHealth, StorePool

logger = logging.getLogger(__name__)


class DomainCore:
    """The shared state and helpers of the parts (see the module)."""

    def __init__(
        self,
        settings: Settings,
        client: MemoryLink | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        index: EpisodeIndex | None = None,
        pool: Any | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        """``pool`` (PostgreSQL, ``ARONA_DATABASE_URL``) holds the index and the outbox;
        without it they are SQLite files under ``ARONA_DATA_DIR``."""
        self._settings = settings
        # ARONA_METRICS=false: none at all.
        self.metrics = metrics or (ServiceMetrics() if settings.metrics else None)
        if self.metrics is not None:
            self.metrics.watch(self)
        self._user_scoped = settings.user_scoped
        # Which of the service's files cannot be written now: said once, shown by Status.
        self.storage = StorageFaults()
        self._client: MemoryLink | None = None
        self._pool: StorePool | None = None
        self._index: EpisodeIndex | None = None
        if settings.memory_enabled:
            assert settings.memory_token is not None
            # Lazy: constructing the client opens nothing.
            self._client = client or self._memory_link(settings)
            # Lazy too: the file appears with the first episode (or the first List).
            self._index = index or open_index(
                settings.data_dir, pool, settings.database_url, storage=self.storage
            )
        # A turn records one or two events, Status reads them rarely, so the MemoryEvent and
        # its datetime are made only then.
        self._events: deque[Event] = deque(maxlen=EVENT_BUFFER_SIZE)
        self._breaker = CircuitBreaker(
            settings.memory_breaker_failures,
            settings.memory_breaker_cooldown_s,
            clock=clock,
            on_open=lambda reason: self._record(EventKind.ERROR, reason, ""),
        )
        # Constructing the outbox opens nothing: the file appears with its first episode.
        self._outbox: AnyOutbox | None = None
        if self.writeback_enabled:
            self._outbox = open_outbox(settings, pool)
        self._watch_task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._waiters: dict[int, asyncio.Future[str]] = {}
        self._replayed: OrderedDict[int, str] = OrderedDict()
        # Callers' episode ids stored lately (a writeback or the replay), with their node ids:
        # the same episode sent again (its caller never got the answer) is that one.
        self._stored_ids: OrderedDict[str, str] = OrderedDict()
        self._inflight: dict[int, InFlight] = {}
        self._inflight_idle = asyncio.Event()
        self._inflight_idle.set()
        self._next_inflight = 0
        self._closing = False
        self._closed_event = asyncio.Event()

    def _memory_link(self, settings: Settings) -> MemoryLink:
        """The one Philia client, or a pool over the stores ``ARONA_MEMORY_URL`` names."""
        assert settings.memory_token is not None
        urls = settings.memory_urls
        if len(urls) == 1:
            return PhiliaClient(
                urls[0], settings.memory_token, settings.memory_timeout_s, metrics=self.metrics
            )
        self._pool = StorePool(
            urls,
            settings.memory_token,
            settings.memory_timeout_s,
            recheck_s=settings.memory_breaker_cooldown_s,
            metrics=self.metrics,
            on_down=lambda message: self._record(EventKind.ERROR, message, ""),
            on_up=self._store_back,
        )
        return self._pool

    def _store_back(self) -> None:
        """A store answers again (its check connected and shook hands, or a call succeeded):
        as good a sign as a probe's, so the breaker closes and an outbox waiting out its
        back-off goes on now."""
        self._succeeded(ANSWERED)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def writeback_enabled(self) -> bool:
        return self.enabled and self._settings.memory_writeback

    @property
    def client(self) -> MemoryLink | None:
        """The Philia client, or the pool of stores (None when memory is not configured)."""
        return self._client

    def stores(self) -> tuple[StoreHealth, ...]:
        """Each store, when ``ARONA_MEMORY_URL`` names several; empty for one."""
        return self._pool.health() if self._pool is not None else ()

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    @property
    def outbox(self) -> AnyOutbox | None:
        """The writeback outbox (None when memory or writeback is off)."""
        return self._outbox

    @property
    def index(self) -> EpisodeIndex | None:
        """The index of stored episodes (None when memory is not configured)."""
        return self._index

    async def check_scope_mode(self) -> None:
        """:func:`check_scope_mode` on this service's index; run before it listens."""
        if self._index is not None:
            await check_scope_mode(self._settings, self._index)

    def _succeeded(self, permit: Permit) -> None:
        self._breaker.success(permit)
        # Philia answers: a replay waiting out its back-off can go on now.
        if self._outbox is not None and self._outbox.pending:
            self._wake.set()
            self._kick_replay()

    def _kick_replay(self) -> None:
        """Start replaying the outbox unless it runs already (the outbox part does)."""
        raise NotImplementedError

    def _fault(
        self, action: str, exc: PhiliaError, sid: str, suffix: str = ""
    ) -> MemoryDomainError:
        message = self._safe(f"{action} failed: {exc}{suffix}")
        logger.warning("%s", message)
        self._record(EventKind.ERROR, message, sid)
        if isinstance(exc, PhiliaTimeout):
            return MemoryTimeout(message)
        return MemoryUnavailable(message)

    def _recall_failed(
        self, message: str, sid: str, permit: Permit, exc: PhiliaError | None = None
    ) -> None:
        """A recall Philia did not answer: logged, an event, and the breaker told
        (:meth:`_judged`; no answer at all is a failure)."""
        logger.warning("%s; the turn goes on without memories", message)
        self._record(EventKind.ERROR, message, sid)
        if exc is None:
            self._breaker.failure(permit)
        else:
            self._judged(permit, exc)

    def _judged(self, permit: Permit, exc: PhiliaError) -> None:
        """Tell the breaker what a failed call says about Philia: a call refused for what it
        is was answered (Philia is well); one that failed because another call's frame was
        refused says nothing; anything else is a failure."""
        if exc.permanent:
            self._breaker.success(permit)
        elif exc.philia_fault:
            self._breaker.failure(permit)
        else:
            self._breaker.abandon(permit)

    def _safe(self, text: str) -> str:
        # Philia errors are already token-free; this is the backstop for status output.
        return self._client.redact(text) if self._client is not None else text

    def _record(self, kind: EventKind, detail: str, sid: str, pid: str = "") -> None:
        # A detail (a recall's question, an error) is kept short: Status answers up to a
        # hundred of them, and a question may be thousands of characters.
        detail = shortened(detail, self._settings.memory_status_detail_chars)
        self._events.append(Event(kind, detail, time.time(), sid, pid))

    def _tie_recall(self, episode: Episode, node_id: str) -> None:
        """Tie the recall its turn made (the newest recall event of its scope whose question
        the user's text holds) to the stored node, so deleting the node clears that event."""
        if not episode.asked:
            return
        for event in itertools.islice(reversed(self._events), TIE_LOOKBACK):
            if event.kind is EventKind.RECALL and event.scope_id == episode.scope_id:
                if not event.node_id and event.question in episode.asked:
                    event.node_id = node_id
                    return

    def _scope_id(self, scope: str) -> str:
        """The scope id of a request's scope ("" for none); required in ``user`` mode."""
        if not scope:
            if self._user_scoped:
                raise InvalidArgument("scope is required when ARONA_MEMORY_SCOPE=user")
            return ""
        return scope_id(checked_scope(scope))

    def _remember_id(self, episode_id: str, node_id: str) -> None:
        if episode_id:
            self._stored_ids[episode_id] = node_id
            if len(self._stored_ids) > REPLAYED_MEMORY:
                self._stored_ids.popitem(last=False)

    def _stored(self, episode: Episode, node_id: str) -> None:
        """Philia stored ``episode`` as ``node_id``: an event, its id remembered, and an
        index entry (the episodes of no scope too, so that they can be listed and forgotten)."""
        self._remember_id(episode.episode_id, node_id)
        self._tie_recall(episode, node_id)
        self._record(EventKind.WRITEBACK, node_id, episode.scope_id, episode.principal_id)
        if self._index is not None:
            scoped = is_scoped_node_type(episode.node_type)
            self._index.record(
                node_id, episode.scope_id, episode.text, scoped, episode.principal_id
            )
