"""The service's vocabulary: its limits, the states and outcomes it answers with, the errors
it raises (which the servicer maps to gRPC status codes in one table), and the records it keeps
of an episode on its way, an event, and a writeback in flight.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from datetime import datetime

from arona_common.storage import StorageFault
from arona_grpc.breaker import BreakerState, Permit
from arona_grpc.config import SCOPE_SHARED
from arona_grpc.outbox import DeadLetter
from arona_grpc.philia import PhiliaMemory
from arona_grpc.scopes import (
    scope_error,
)
from arona_grpc.stores import StoreHealth

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
REPLAYED_MEMORY = 1024
# How far ahead of the service's clock a writeback's occurred_at may be (the caller's clock
# runs ahead): up to this it counts as now, beyond it the call is refused.
MAX_FUTURE_SKEW_S = 300.0


# What a store found back tells the breaker: a call that succeeded.
ANSWERED = Permit(probe=False)


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
    # The service's files that cannot be written now (arona_common.storage).
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


@dataclass
class Episode:
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
class Event:
    """One event of the ring Status reads: what happened (a recall's question, a node id, an
    error), when, whose (scope and principal ids, "" for none), and, for a recall, the node
    its turn was stored as (``DomainCore._tie_recall``): forgetting a scope, a
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
class InFlight:
    """One writeback on its way to Philia (not in the outbox)."""

    episode: Episode
    # Set once shutdown has put it in the outbox, so its failure does not queue it twice.
    kept: bool = False


OUTBOX_PART = "outbox"
# What a write the outbox cannot take loses.
OUTBOX_FAULT_COST = "episodes Philia cannot take now are lost until it can be written"


def refused(reason: str) -> InvalidArgument:
    """The error of a writeback Philia refused for what it is (kept: not to be sent again)."""
    return InvalidArgument(
        f"Philia refused the episode ({reason}); it is kept in the dead-letter list",
        code=DEAD_LETTER,
        queued=True,
    )


def checked_scope(scope: str) -> str:
    """``scope`` when it names ``<principal>[/<user>]`` (:func:`scope_error`); else
    INVALID_ARGUMENT saying what is wrong."""
    problem = scope_error(scope)
    if problem is not None:
        raise InvalidArgument(problem)
    return scope
