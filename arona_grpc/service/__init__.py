"""The memory service's domain: Recall, Writeback, Delete, List, Forget and Status, and the ring
of events Status reports.

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

One module a concern, composed by the facade (:mod:`~arona_grpc.service.domain`):
:mod:`~arona_grpc.service.model` (limits, states, outcomes, errors),
:mod:`~arona_grpc.service.section` (the section and its fencing),
:mod:`~arona_grpc.service.core` (the shared state: client, breaker, index, outbox, events),
:mod:`~arona_grpc.service.recall`, :mod:`~arona_grpc.service.writeback`,
:mod:`~arona_grpc.service.replay` (the outbox and its replay),
:mod:`~arona_grpc.service.erasure` (delete and forget), :mod:`~arona_grpc.service.listing`,
:mod:`~arona_grpc.service.status`, and :mod:`~arona_grpc.service.scope_mode` (the start-up check).
"""

from __future__ import annotations

from arona_grpc.service.domain import MemoryDomain
from arona_grpc.service.model import (
    DATABASE_UNAVAILABLE,
    ELLIPSIS,
    EVENT_BUFFER_SIZE,
    MAX_FUTURE_SKEW_S,
    MAX_MEMORY_CHARS,
    MAX_SECTION_CHARS,
    NOT_IN_MEMORY,
    NOT_INDEXED,
    OTHER_SCOPE,
    OUTBOX_PART,
    SECTION_HEADER,
    DeleteOutcome,
    EventKind,
    InvalidArgument,
    MemoryDomainError,
    MemoryEvent,
    MemoryState,
    MemoryTimeout,
    MemoryUnavailable,
    NotConfigured,
    RecallOutcome,
    StatusSnapshot,
    WritebackOutcome,
)
from arona_grpc.service.scope_mode import ScopeModeRefused, check_scope_mode
from arona_grpc.service.section import (
    cap_memories,
    episode_text,
    render_section,
    without_memory_section,
)

__all__ = [
    "DATABASE_UNAVAILABLE",
    "DeleteOutcome",
    "ELLIPSIS",
    "EVENT_BUFFER_SIZE",
    "EventKind",
    "InvalidArgument",
    "MAX_FUTURE_SKEW_S",
    "MAX_MEMORY_CHARS",
    "MAX_SECTION_CHARS",
    "MemoryDomain",
    "MemoryDomainError",
    "MemoryEvent",
    "MemoryState",
    "MemoryTimeout",
    "MemoryUnavailable",
    "NOT_INDEXED",
    "NOT_IN_MEMORY",
    "NotConfigured",
    "OTHER_SCOPE",
    "OUTBOX_PART",
    "RecallOutcome",
    "SECTION_HEADER",
    "ScopeModeRefused",
    "StatusSnapshot",
    "WritebackOutcome",
    "cap_memories",
    "check_scope_mode",
    "episode_text",
    "render_section",
    "without_memory_section",
]
