"""Several memory stores behind one link: spreading the calls, failing over, each store's health.

``ARONA_MEMORY_URL`` may name several store processes (comma-separated) that serve the same
memories: embedded stores on one SQLite file, or on one PostgreSQL database. :class:`StorePool`
holds one :class:`~arona_grpc.philia.PhiliaClient` per URL (one token, one per-call timeout) and
makes the calls the service makes (query, store, delete) as one client would; the service,
its breaker and its outbox do not know how many stores there are. With one URL the service
uses the one client itself, as it always has.

- **Spreading.** Each call goes to the store that is up with the fewest of this pool's calls in
  flight, the next in turn among equals: recalls and stores spread evenly over the stores,
  and a store that answers slowly gets fewer. Any store takes any call: they write to the
  same memories.
- **Failing over.** A call that fails on a store because of the store (refused, closed, timed
  out, broke the protocol: :attr:`~arona_grpc.philia.PhiliaError.philia_fault`) marks that
  store down and is made once more on another store, within what is left of its deadline. A
  recall is read-only; a store made again elsewhere stays one memory (a store identical to a
  stored node is that node), and so does a delete. A call refused for what it is (too large,
  invalid) is not made again: every store would refuse it.
- **Down stores.** A store that is down takes no calls while another is up. Every
  ``recheck_s`` (``ARONA_MEMORY_BREAKER_COOLDOWN_S``) a background check connects to it
  (connect and handshake); once that succeeds, or a call it was given succeeds, it is up
  again and takes its share (``on_up`` is told, so that an outbox waiting for memory goes on
  at once). While every store is down the calls still go out, spread the same way: the
  service's breaker in front counts their failures, as it does for one store, so memory is
  ``offline`` only when no store answers.
- **Health.** :meth:`StorePool.health` says, for each store in the order of
  ``ARONA_MEMORY_URL``, its URL (redacted: the token travels on it), whether it is up, since
  when, and the error that took it down; ``memory.status`` shows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from arona_grpc.philia import PhiliaClient, PhiliaError, PhiliaMemory

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A call made again on another store needs at least this much of its deadline left: less
# could not even connect.
MIN_RETRY_S = 0.01
# An error that took a store down is shown cut to this length.
MAX_ERROR_CHARS = 300


class MemoryLink(Protocol):
    """What the service calls on its memory: one Philia client, or a pool of stores."""

    @property
    def timeout_s(self) -> float: ...

    @property
    def connects(self) -> int: ...

    def redact(self, text: str) -> str: ...

    async def query(
        self,
        query: str,
        limit: int,
        *,
        timeout_s: float | None = None,
        node_type: str | None = None,
    ) -> list[PhiliaMemory]: ...

    async def store(
        self,
        text: str,
        node_type: str = "episode",
        *,
        occurred_at: float | None = None,
        timeout_s: float | None = None,
    ) -> str: ...

    async def delete(self, node_id: str, *, timeout_s: float | None = None) -> bool: ...

    async def aclose(self) -> None: ...


class StoreMetrics(Protocol):
    """What the pool records: each client's calls, and the calls made again elsewhere."""

    def philia_call(self, method: str, outcome: str, seconds: float) -> None: ...

    def store_failover(self, method: str) -> None: ...


@dataclass(frozen=True)
class StoreHealth:
    """One store as ``memory.status`` shows it."""

    # ARONA_MEMORY_URL's entry, redacted.
    url: str
    up: bool
    # When it went up or down (the pool's start for a store that was never down).
    since: datetime
    # What took it down, one line without secrets; "" while it is up.
    error: str = ""


class _Store:
    """One store of the pool: its client, its calls in flight, its state."""

    def __init__(self, index: int, client: PhiliaClient, since: datetime) -> None:
        self.index = index
        self.client = client
        self.inflight = 0
        self.up = True
        self.since = since
        self.down_at = 0.0
        self.error = ""
        self.checking: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        """How the log names it: its place in ARONA_MEMORY_URL and its redacted URL."""
        return f"memory store {self.index + 1} ({self.client.redacted_url})"


class StorePool:
    """Calls spread over several stores that serve the same memories; see the module docstring."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        timeout_s: float,
        *,
        recheck_s: float,
        metrics: StoreMetrics | None = None,
        on_down: Callable[[str], None] | None = None,
        on_up: Callable[[], None] | None = None,
    ) -> None:
        """``recheck_s``: how long a store stays down before it is checked again, and how
        often then; ``on_down`` gets a one-line message when a store goes down; ``on_up`` is
        called when one comes back."""
        if len(urls) < 2:
            raise ValueError("a store pool needs at least two URLs")
        if not recheck_s > 0:
            raise ValueError("recheck_s must be positive")
        started = datetime.now(UTC)
        self._stores = [
            _Store(i, PhiliaClient(url, token, timeout_s, metrics=metrics), started)
            for i, url in enumerate(urls)
        ]
        self._timeout_s = timeout_s
        self._recheck_s = recheck_s
        self._metrics = metrics
        self._on_down = on_down
        self._on_up = on_up
        # Where the search for the next store starts: the one after the last chosen.
        self._next = 0
        self._closed = False

    @property
    def timeout_s(self) -> float:
        """The default per-call deadline (each store's, and a failed-over call's in all)."""
        return self._timeout_s

    @property
    def connects(self) -> int:
        """Connections opened to any of the stores since the pool was made."""
        return sum(store.client.connects for store in self._stores)

    def redact(self, text: str) -> str:
        """Mask the token in free text (every store shares it)."""
        return self._stores[0].client.redact(text)

    def health(self) -> tuple[StoreHealth, ...]:
        """Each store, in the order of ``ARONA_MEMORY_URL``."""
        return tuple(
            StoreHealth(s.client.redacted_url, s.up, s.since, "" if s.up else s.error)
            for s in self._stores
        )

    async def query(
        self,
        query: str,
        limit: int,
        *,
        timeout_s: float | None = None,
        node_type: str | None = None,
    ) -> list[PhiliaMemory]:
        """``Sync.MemoryQueryRequest`` on one store (another if it fails)."""
        return await self._call(
            "query",
            lambda client, left: client.query(query, limit, timeout_s=left, node_type=node_type),
            timeout_s,
        )

    async def store(
        self,
        text: str,
        node_type: str = "episode",
        *,
        occurred_at: float | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """``Sync.MemoryStoreRequest`` on one store (another if it fails)."""
        return await self._call(
            "store",
            lambda client, left: client.store(
                text, node_type, occurred_at=occurred_at, timeout_s=left
            ),
            timeout_s,
        )

    async def delete(self, node_id: str, *, timeout_s: float | None = None) -> bool:
        """``Sync.MemoryDeleteRequest`` on one store (another if it fails)."""
        return await self._call(
            "delete", lambda client, left: client.delete(node_id, timeout_s=left), timeout_s
        )

    async def aclose(self) -> None:
        """Stop the checks and close every store's client."""
        self._closed = True
        checks = [s.checking for s in self._stores if s.checking is not None]
        for check in checks:
            check.cancel()
        if checks:
            await asyncio.wait(checks)
        for store in self._stores:
            await store.client.aclose()

    async def _call(
        self,
        method: str,
        call: Callable[[PhiliaClient, float], Awaitable[T]],
        timeout_s: float | None,
    ) -> T:
        deadline_s = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        loop = asyncio.get_running_loop()
        ends = loop.time() + deadline_s
        first = self._pick()
        assert first is not None  # a pool has two stores or more
        try:
            return await self._on(first, call, deadline_s)
        except PhiliaError as exc:
            if exc.permanent or not exc.philia_fault:
                raise
            left = ends - loop.time()
            other = self._pick(besides=first)
            if other is None or left < MIN_RETRY_S:
                raise
        if self._metrics is not None:
            self._metrics.store_failover(method)
        logger.debug("%s: made again on %s", method, other.name)
        return await self._on(other, call, left)

    def _pick(self, besides: _Store | None = None) -> _Store | None:
        """The store for the next call: among those up (all of them when none is), the one
        with the fewest calls in flight, the first from the round-robin cursor on a tie."""
        count = len(self._stores)
        order = (self._stores[(self._next + i) % count] for i in range(count))
        candidates = [s for s in order if s is not besides]
        up = [s for s in candidates if s.up]
        chosen = min(up or candidates, key=lambda s: s.inflight, default=None)
        if chosen is not None:
            self._next = (chosen.index + 1) % count
        return chosen

    async def _on(
        self, store: _Store, call: Callable[[PhiliaClient, float], Awaitable[T]], timeout_s: float
    ) -> T:
        store.inflight += 1
        try:
            result = await call(store.client, timeout_s)
        except PhiliaError as exc:
            if exc.philia_fault and not exc.permanent:
                self._down(store, exc)
            raise
        finally:
            store.inflight -= 1
        self._up(store)
        return result

    def _down(self, store: _Store, exc: PhiliaError) -> None:
        store.error = _one_line(store.client, exc)
        store.down_at = time.monotonic()
        if not store.up:
            return
        store.up = False
        store.since = datetime.now(UTC)
        others = sum(s.up for s in self._stores)
        message = f"{store.name} is down: {store.error}"
        logger.warning(
            "%s; %s; checked again every %g s",
            message,
            f"calls go to the other {others} store(s)" if others else "no store is up",
            self._recheck_s,
        )
        if self._on_down is not None:
            self._on_down(message)
        if store.checking is None and not self._closed:
            store.checking = asyncio.get_running_loop().create_task(
                self._check(store), name=f"memory-store-{store.index + 1}-check"
            )

    def _up(self, store: _Store) -> None:
        if store.up:
            return
        store.up = True
        store.since = datetime.now(UTC)
        logger.info("%s answers again (down %.1f s)", store.name, time.monotonic() - store.down_at)
        if self._on_up is not None:
            self._on_up()

    async def _check(self, store: _Store) -> None:
        """Connect to a down store every ``recheck_s`` until it answers (or a call finds it
        up again)."""
        try:
            while not store.up and not self._closed:
                await asyncio.sleep(self._recheck_s)
                if store.up or self._closed:
                    return
                try:
                    await store.client.connect()
                except PhiliaError as exc:
                    store.error = _one_line(store.client, exc)
                    continue
                self._up(store)
        finally:
            store.checking = None


def _one_line(client: PhiliaClient, exc: PhiliaError) -> str:
    """``exc`` as a store's error: one line, no secret, at most :data:`MAX_ERROR_CHARS`."""
    return client.redact(" ".join(str(exc).split()))[:MAX_ERROR_CHARS]
