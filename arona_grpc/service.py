"""Domain logic of Recall, Writeback, Delete and Status, and the events ring buffer.

:class:`MemoryDomain` knows nothing of gRPC: it takes plain values, returns plain
outcomes and raises :class:`MemoryDomainError` subclasses that the servicer maps to
status codes in one table. Philia faults never escape ``recall`` (they become
``OFFLINE``); ``writeback`` and ``delete`` raise :class:`MemoryUnavailable` or
:class:`MemoryTimeout`. Every outcome worth knowing lands in a bounded ring buffer of
events that ``status`` reports newest first.

Robustness, all in front of the one Philia client:

- **Breaker** (:mod:`arona_grpc.breaker`): every Philia call (recall, writeback,
  delete, outbox replay) asks it first. While it is open, recall answers ``OFFLINE``
  at once and Writeback/Delete fail fast (``UNAVAILABLE``) without touching the
  network; each opening is recorded as an ``error`` event.
- **Recall budget**: recall waits at most ``ARONA_MEMORY_RECALL_BUDGET_MS`` (default:
  the RPC timeout) and never longer than its caller's own deadline, so the service
  gives up no later than the chat turn does.
- **Several stores** (:mod:`arona_grpc.stores`): when ``ARONA_MEMORY_URL`` names several
  store processes serving the same memories, the one client is a pool that spreads the calls
  over the stores that are up and makes a call that failed on one store once more on
  another. The breaker and everything above see one memory that fails only when no store
  answers; each store going down is an ``error`` event, and one coming back closes the
  breaker and wakes the outbox replay. Status lists each store.
- **Section cap**: the injected section is at most :data:`MAX_SECTION_CHARS`
  characters, header included. A memory longer than :data:`MAX_MEMORY_CHARS` is cut
  and ends with an ellipsis (``…``); while the section is still too long, the memory
  with the lowest score is dropped (the later one on a tie). Results beyond ``limit``
  are ignored by the client.
- **Outbox** (:mod:`arona_grpc.outbox`): an episode that could not be stored is kept
  in SQLite and replayed in order, by one background task, once Philia answers
  again. While the outbox is not empty, new episodes line up behind it, so episodes
  reach Philia in the order they were queued. Replay starts after a successful call,
  when an episode is queued (first waiting out the breaker's cooldown), and at start
  for an outbox left by an earlier run; it stops after :data:`MAX_REPLAY_FAILURES`
  failed attempts in a row (waiting longer after each) until one of those happens
  again. An episode leaves the outbox only after Philia gave its node id, so normal
  recovery stores each one exactly once; a store whose answer was lost (a timeout,
  a link cut mid-call) may be stored twice. The healthy path (breaker closed, outbox
  empty) never touches SQLite.
- **Episode ids**: a caller's id of an episode makes sending it again safe. One waiting in
  the outbox is not queued twice; one stored lately (the last :data:`_REPLAYED_MEMORY`,
  by a writeback or the replay) is answered with its node id and not stored again, so a
  caller that lost the answer (an import killed mid-call, a journal sent again after a
  crash) stores nothing twice while this process runs.
- **Dated episodes**: a writeback may say when its turn happened (``occurred_at``, POSIX
  seconds; :func:`checked_occurred_at` says what is accepted); Philia receives it as the
  store request's ``occurred_at`` property. Without one, the healthy path sends no property
  (Philia dates the episode itself, now), and an episode kept in the outbox is dated when
  the service received it: a replay after an outage never makes old turns look new.
- **Shutdown** (:meth:`MemoryDomain.aclose`): in-flight writebacks and the replay get
  a grace period; episodes still in flight after it are kept in the outbox for the
  next start.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from arona_grpc import tracing
from arona_grpc.breaker import BreakerState, CircuitBreaker, Permit
from arona_grpc.config import SCOPE_SHARED, ConfigError, Settings
from arona_grpc.episodes import (
    EVERYONE,
    INDEX_FILE,
    EpisodeIndex,
    IndexPage,
    IndexUnavailable,
    Whose,
    open_index,
)
from arona_grpc.metrics import ServiceMetrics
from arona_grpc.outbox import AnyOutbox, DeadLetter, OutboxClosed, OutboxEntry, open_outbox
from arona_grpc.philia import PhiliaClient, PhiliaError, PhiliaMemory, PhiliaTimeout
from arona_grpc.redact import redact_url
from arona_grpc.scopes import (
    EPISODE_NODE_TYPE,
    is_scoped_node_type,
    principal_error,
    principal_id,
    scope_error,
    scope_id,
    scoped_node_type,
)
from arona_grpc.sizes import compose_episode, fitted_episode, fitted_query, shortened
from arona_grpc.storage import StorageFault, StorageFaults, write_error
from arona_grpc.stores import MemoryLink, StoreHealth, StorePool

logger = logging.getLogger(__name__)

SECTION_HEADER = "## Relevant Long-Term Memories"
DEFAULT_RECALL_LIMIT = 5
# A bound on one recall so that a careless limit cannot ask Philia for a reply
# beyond its frame budget.
MAX_RECALL_LIMIT = 100
EVENT_BUFFER_SIZE = 100
# The code of an error caused by the database (PostgreSQL) being unreachable.
DATABASE_UNAVAILABLE = "database_unavailable"
# The code of a writeback Philia refused for what it is (kept in the dead-letter list).
DEAD_LETTER = "dead_letter"
# A dead letter's reason is cut to this many characters.
MAX_DEAD_LETTER_REASON = 200
DEFAULT_STATUS_LIMIT = 50
DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 100
# The injected section, header included, never exceeds this many characters.
MAX_SECTION_CHARS = 4000
# One memory's text is cut to this many characters (ellipsis included).
MAX_MEMORY_CHARS = 1000
ELLIPSIS = "\u2026"
# The service answers a little before its caller's deadline, so the answer (OFFLINE)
# still reaches the caller instead of a DEADLINE_EXCEEDED.
DEADLINE_MARGIN_S = 0.05
# A recall its caller cancels once this share of its budget is spent was cut off by the
# caller's deadline (on a loaded loop the caller's timer can fire before the service's own):
# Philia did not answer in time, which counts against the breaker like a timeout. A recall
# cancelled earlier was abandoned (the client left) and counts for nothing.
CUT_OFF_SHARE = 0.75
# Replay gives up after this many failed attempts in a row, until kicked again.
MAX_REPLAY_FAILURES = 5
# Episodes a replay sends Philia at once (pipelined over the one link): the embedded store
# commits up to 64 stores in one transaction, so two of its batches per round trip.
REPLAY_BATCH = 128
MAX_REPLAY_BACKOFF_S = 60.0
# How often a replica looks at a shared (PostgreSQL) outbox for episodes to replay.
OUTBOX_WATCH_S = 2.0
# How far back a stored episode looks for the recall event of its turn.
TIE_LOOKBACK = 20
# Deletes a forget sends Philia at once (pipelined over the one link; the embedded store
# erases the deletes that arrive together at once).
FORGET_BATCH = 64
# How many replayed node ids are remembered for writebacks waiting on them.
_REPLAYED_MEMORY = 1024
# How far ahead of the service's clock a writeback's occurred_at may be (the caller's clock
# runs ahead): up to this it counts as now, beyond it the call is refused.
MAX_FUTURE_SKEW_S = 300.0


# What a store found back tells the breaker: a call that succeeded.
_ANSWERED = Permit(probe=False)


class MemoryState(enum.Enum):
    """The outcome of a recall for one chat turn."""

    ENABLED = "enabled"
    DISABLED = "disabled"
    OFFLINE = "offline"


class EventKind(enum.Enum):
    RECALL = "recall"
    WRITEBACK = "writeback"
    DELETE = "delete"
    ERROR = "error"


@dataclass(frozen=True)
class MemoryEvent:
    kind: EventKind
    # The query (recall), the node id (writeback, delete) or a message (error), shortened to
    # ARONA_MEMORY_STATUS_DETAIL_CHARS.
    detail: str
    at: datetime
    # The hashed id of the scope concerned; "" when none.
    scope_id: str = ""


@dataclass(frozen=True)
class RecallOutcome:
    state: MemoryState
    # The memories in the section (blank ones left out, long ones cut), best first.
    memories: tuple[PhiliaMemory, ...]
    section: str


@dataclass(frozen=True)
class WritebackOutcome:
    stored: bool
    node_id: str = ""


# Why a Delete deleted nothing (DeleteOutcome.reason).
NOT_INDEXED = "not_indexed"  # user mode: not in the episode index (never stored, or gone)
OTHER_SCOPE = "other_scope"  # user mode: indexed for another scope than the one named
NOT_IN_MEMORY = "not_in_memory"  # Philia was asked and has no such node


@dataclass(frozen=True)
class DeleteOutcome:
    deleted: bool
    # Why not, when not (NOT_INDEXED, OTHER_SCOPE, NOT_IN_MEMORY); "" when deleted.
    reason: str = ""


@dataclass(frozen=True)
class StatusSnapshot:
    enabled: bool
    writeback: bool
    events: tuple[MemoryEvent, ...]
    breaker: BreakerState = BreakerState.CLOSED
    breaker_opened_at: datetime | None = None
    outbox_depth: int = 0
    outbox_dropped: int = 0
    scope_mode: str = SCOPE_SHARED
    outbox_bytes: int = 0
    dead_letters: int = 0
    # The newest dead letters, newest first (no text).
    recent_dead_letters: tuple[DeadLetter, ...] = ()
    # The service's files that cannot be written now (arona_grpc.storage).
    storage_faults: tuple[StorageFault, ...] = ()
    # Each store, when ARONA_MEMORY_URL names several (arona_grpc.stores); empty for one.
    stores: tuple[StoreHealth, ...] = ()


class MemoryDomainError(Exception):
    """Base of the errors the service reports; messages never carry secrets.

    ``code`` names the cause for machines (``database_unavailable``); ``queued`` says that
    a writeback's episode is safe in the outbox although the call failed.
    """

    def __init__(self, message: str = "", *, code: str = "", queued: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.queued = queued


class InvalidArgument(MemoryDomainError):
    """The request itself is wrong."""


class NotConfigured(MemoryDomainError):
    """Memory is not configured (no Philia URL or token)."""


class MemoryUnavailable(MemoryDomainError):
    """Philia refused, failed or broke the protocol."""


class MemoryTimeout(MemoryDomainError):
    """Philia did not answer in time."""


def render_section(memories: Iterable[PhiliaMemory]) -> str:
    """The system section to inject, or ``""`` when no memory has any text.

    One ``- [score] text`` line per memory under the header, score with two
    decimals; a memory's own line breaks are kept but its continuation lines are
    indented by two spaces, so a memory can never start a heading or bullet.
    """
    lines = [
        f"- [{m.score:.2f}] " + "\n  ".join(m.text.strip().splitlines())
        for m in memories
        if m.text.strip()
    ]
    return "\n".join([SECTION_HEADER, *lines]) if lines else ""


def cap_memories(
    memories: Iterable[PhiliaMemory],
    max_chars: int = MAX_SECTION_CHARS,
    max_memory_chars: int = MAX_MEMORY_CHARS,
) -> tuple[PhiliaMemory, ...]:
    """The memories that fit one section of at most ``max_chars`` characters.

    Blank memories are left out; a text longer than ``max_memory_chars`` is cut and
    ends with ``…``; then the lowest score is dropped (the later one on a tie) until
    the rendered section fits. The order of the survivors is kept.
    """
    return _capped_section(memories, max_chars, max_memory_chars)[0]


def _capped_section(
    memories: Iterable[PhiliaMemory], max_chars: int, max_memory_chars: int
) -> tuple[tuple[PhiliaMemory, ...], str]:
    """:func:`cap_memories` and the section it renders, rendered once when it fits."""
    kept: list[PhiliaMemory] = []
    for memory in memories:
        text = memory.text.strip()
        if not text:
            continue
        if len(text) > max_memory_chars:
            text = text[: max_memory_chars - len(ELLIPSIS)].rstrip() + ELLIPSIS
        if text != memory.text:
            memory = PhiliaMemory(
                text=text, score=memory.score, node_type=memory.node_type, node_id=memory.node_id
            )
        kept.append(memory)
    section = render_section(kept)
    while kept and len(section) > max_chars:
        lowest = min(range(len(kept)), key=lambda i: (kept[i].score, -i))
        del kept[lowest]
        section = render_section(kept)
    return tuple(kept), section


# An injected section inside a turn's text: the header line, then its bullets and their
# indented continuation lines (the shape render_section gives it).
_SECTION_BLOCK = re.compile(
    r"^[ \t]*" + re.escape(SECTION_HEADER) + r"[^\n]*(?:\n(?:- \[|  )[^\n]*)*\n?", re.MULTILINE
)
_BLANK_RUN = re.compile(r"\n{3,}")


def without_memory_section(text: str) -> str:
    """``text`` without any injected memory section (header, bullets, indented lines).

    An episode must never contain recalled memories: stored again, they would be recalled
    as new ones, nesting sections turn after turn (the ``echo`` model's replies carry the
    section it received). Text without a section is returned unchanged.
    """
    if SECTION_HEADER not in text:
        return text
    return _BLANK_RUN.sub("\n\n", _SECTION_BLOCK.sub("", text)).strip()


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


def episode_text(user: str, assistant: str) -> str:
    """``User: …\\nAssistant: …`` with an empty (or blank) side left out.

    Injected memory sections are removed from both sides first.
    """
    return compose_episode(without_memory_section(user), without_memory_section(assistant))


@dataclass
class _Episode:
    """One episode to store: its text, node type and scope id ("" for nobody's)."""

    text: str
    node_type: str
    scope_id: str
    # The caller's id of the episode ("" for none).
    episode_id: str = ""
    # When it happened (POSIX seconds), as the caller said; None: now.
    occurred_at: float | None = None
    # When the service received it: the outbox dates an episode without occurred_at so.
    received: float = 0.0
    # Set once the outbox has it: a failure after that still leaves it safe.
    kept: bool = False
    # The scope id of its scope's principal ("" for nobody's): forgetting a principal.
    principal_id: str = ""
    # What the user said (the question its turn recalled with), to tie that recall's event
    # to the stored node: deleting the node clears the event.
    asked: str = ""

    @property
    def occurred_us(self) -> int:
        """When it happened, in POSIX microseconds, for the outbox."""
        at = self.received if self.occurred_at is None else self.occurred_at
        return int(at * 1_000_000)


@dataclass(slots=True)
class _Event:
    """One event of the ring Status reads: what happened (a recall's question, a node id, an
    error), when, whose (scope and principal ids, "" for none), and, for a recall, the node
    its turn was stored as (:meth:`MemoryDomain._tie_recall`): forgetting a scope, a
    principal or that node clears the events that hold its words."""

    kind: EventKind
    detail: str
    at: float
    scope_id: str
    pid: str = ""
    node_id: str = ""

    @property
    def question(self) -> str:
        """A recall's question as recorded (without the ellipsis of a shortened one)."""
        return self.detail.removesuffix(ELLIPSIS)


@dataclass
class _InFlight:
    """One writeback on its way to Philia (not in the outbox)."""

    episode: _Episode
    # Set once shutdown has put it in the outbox, so its failure does not queue it twice.
    kept: bool = False


OUTBOX_PART = "outbox"
# What a write the outbox cannot take loses.
OUTBOX_FAULT_COST = "episodes Philia cannot take now are lost until it can be written"


class ScopeModeRefused(ConfigError):
    """The index holds per-user memories and the service was asked to share memory."""


async def check_scope_mode(settings: Settings, index: EpisodeIndex) -> None:
    """Refuse (:class:`ScopeModeRefused`) to serve shared memory from an episode index that
    holds episodes stored for one user alone: shared recall and ``memory.list`` would be
    everyone's view of them. An index that cannot be read is left to the code that uses it."""
    if settings.user_scoped:
        return
    try:
        scoped = await index.holds_scoped()
    except (IndexUnavailable, OSError):
        return
    if not scoped:
        return
    if settings.database_url:
        where = f"the episode index in {redact_url(settings.database_url)}"
        elsewhere = "another database"
    else:
        where = str(settings.data_dir / INDEX_FILE)
        elsewhere = "another ARONA_DATA_DIR"
    raise ScopeModeRefused(
        f"{where} holds per-user memories (stored with ARONA_MEMORY_SCOPE=user), which "
        "shared mode would show to every caller: set ARONA_MEMORY_SCOPE=user; or forget them "
        "(run it with ARONA_MEMORY_SCOPE=user, then `arona-gateway forget --all` beside it) "
        f"and start again; or, for a new shared memory, use {elsewhere}"
    )


class MemoryDomain:
    """Recall, Writeback, Delete and Status over one lazily connected Philia client (or a
    pool of stores, when ``ARONA_MEMORY_URL`` names several)."""

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
        self._events: deque[_Event] = deque(maxlen=EVENT_BUFFER_SIZE)
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
        self._inflight: dict[int, _InFlight] = {}
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
        self._succeeded(_ANSWERED)

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
        kept, section = _capped_section(found, MAX_SECTION_CHARS, MAX_MEMORY_CHARS)
        if not kept:
            return RecallOutcome(MemoryState.DISABLED, (), "")
        return RecallOutcome(MemoryState.ENABLED, kept, section)

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
        episode = _Episode(
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

    async def _writeback(self, episode: _Episode) -> WritebackOutcome:
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
        record = self._inflight[key] = _InFlight(episode)
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
            if (scope or own) and sid != (scope_id(_checked(scope)) if scope else ""):
                return DeleteOutcome(False, OTHER_SCOPE)
        else:
            sid = self._scope_id(scope)
        deleted = await self._philia_delete(node_id, sid)
        self._clear_events(None, [node_id])
        await self._unindex([node_id])
        await self._note_erasure(None, [node_id])
        return DeleteOutcome(True) if deleted else DeleteOutcome(False, NOT_IN_MEMORY)

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
        sid = scope_id(_checked(scope)) if scope else ""
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
            whose = Whose(scope_id=scope_id(_checked(scope)))
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

    # --- outbox --------------------------------------------------------------------

    async def _keep(self, episode: _Episode) -> int | None:
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

    def _put_soon(self, episode: _Episode) -> None:
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

    async def _queue_behind(self, episode: _Episode) -> WritebackOutcome:
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

    def _succeeded(self, permit: Permit) -> None:
        self._breaker.success(permit)
        # Philia answers: a replay waiting out its back-off can go on now.
        if self._outbox is not None and self._outbox.pending:
            self._wake.set()
            self._kick_replay()

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
                    _Episode(
                        entry.text,
                        entry.node_type,
                        entry.scope_id,
                        entry.episode_id,
                        principal_id=entry.principal_id,
                    ),
                    node_id,
                )
            self._replayed[entry.seq] = node_id
            if len(self._replayed) > _REPLAYED_MEMORY:
                self._replayed.popitem(last=False)
            waiter = self._waiters.pop(entry.seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(node_id)

    async def _bury(self, episode: _Episode, exc: PhiliaError, *, queued: bool) -> InvalidArgument:
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
        return _refused(reason)

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
            waiter.set_exception(_refused(reason))

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

    # --- helpers -------------------------------------------------------------------

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
        self._events.append(_Event(kind, detail, time.time(), sid, pid))

    def _tie_recall(self, episode: _Episode, node_id: str) -> None:
        """Tie the recall its turn made (the newest recall event of its scope whose question
        the user's text holds) to the stored node, so deleting the node clears that event."""
        if not episode.asked:
            return
        for event in itertools.islice(reversed(self._events), TIE_LOOKBACK):
            if event.kind is EventKind.RECALL and event.scope_id == episode.scope_id:
                if not event.node_id and event.question in episode.asked:
                    event.node_id = node_id
                    return

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

    def _scope_id(self, scope: str) -> str:
        """The scope id of a request's scope ("" for none); required in ``user`` mode."""
        if not scope:
            if self._user_scoped:
                raise InvalidArgument("scope is required when ARONA_MEMORY_SCOPE=user")
            return ""
        return scope_id(_checked(scope))

    def _remember_id(self, episode_id: str, node_id: str) -> None:
        if episode_id:
            self._stored_ids[episode_id] = node_id
            if len(self._stored_ids) > _REPLAYED_MEMORY:
                self._stored_ids.popitem(last=False)

    def _stored(self, episode: _Episode, node_id: str) -> None:
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


def _refused(reason: str) -> InvalidArgument:
    """The error of a writeback Philia refused for what it is (kept: not to be sent again)."""
    return InvalidArgument(
        f"Philia refused the episode ({reason}); it is kept in the dead-letter list",
        code=DEAD_LETTER,
        queued=True,
    )


def _ignore_result(future: asyncio.Future[int | None]) -> None:
    # Retrieve the outcome so a failed write is not reported as "never retrieved";
    # the outbox has already logged it.
    if not future.cancelled():
        future.exception()


def _checked(scope: str) -> str:
    """``scope`` when it names ``<principal>[/<user>]`` (:func:`scope_error`); else
    INVALID_ARGUMENT saying what is wrong."""
    problem = scope_error(scope)
    if problem is not None:
        raise InvalidArgument(problem)
    return scope
