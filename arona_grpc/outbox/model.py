"""What both outbox backends share: an entry, a dead letter, the bound's arithmetic, and the
counts and pending puts kept in memory (:class:`Kept`), which the domain reads on every turn
without touching a database.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from arona_grpc.failure_log import FailureLog

logger = logging.getLogger(__name__)

T = TypeVar("T")

OUTBOX_FILE = "outbox.db"
# What one queued episode costs beyond its fields' bytes (row, index entries, page slack).
ENTRY_OVERHEAD_BYTES = 100
# Dead letters kept with their text; older ones are removed (their count stays).
DEAD_LETTERS_KEPT = 1000
# Dead letters Status shows, newest first.
DEAD_LETTERS_SHOWN = 5


class OutboxClosed(RuntimeError):
    """The outbox was closed; nothing more can be queued."""


@dataclass(frozen=True)
class OutboxEntry:
    seq: int
    text: str
    node_type: str
    # Whose episode it is (for the episode index); "" when nobody's.
    scope_id: str = ""
    # The caller's id of the episode ("" for none).
    episode_id: str = ""
    # When it happened, in POSIX microseconds (queued without a time: when it was queued).
    occurred_us: int = 0
    # The scope id of its scope's principal ("" for nobody's or unknown).
    principal_id: str = ""


@dataclass(frozen=True)
class DeadLetter:
    """An episode Philia refused for what it is, as Status shows it (never its text)."""

    # Wall-clock seconds when it was refused.
    at: float
    reason: str
    # The length of its text, in characters.
    chars: int
    scope_id: str = ""


@dataclass(frozen=True)
class Counts:
    depth: int
    dropped: int
    bytes: int = 0
    dead: int = 0
    # The newest dead letters, newest first.
    recent: tuple[DeadLetter, ...] = ()


def entry_bytes(text: str, node_type: str, scope_id: str, episode_id: str) -> int:
    """What one queued episode counts against the outbox's bound."""
    return (
        len(text.encode("utf-8", "surrogatepass"))
        + len(node_type.encode("utf-8", "surrogatepass"))
        + len(scope_id)
        + len(episode_id)
        + ENTRY_OVERHEAD_BYTES
    )


# The columns of an OutboxEntry, on both backends.
ENTRY_COLUMNS = (
    "seq, text, node_type, scope_id, episode_id, coalesce(occurred_us, queued_us),"
    " coalesce(principal_id, '')"
)
# What a dead letter keeps of a queued episode (the same columns on both backends).
DEAD_COLUMNS = "text, node_type, scope_id, episode_id, queued_us, occurred_us, principal_id"


def now_us() -> int:
    return int(time.time() * 1_000_000)


def entry_of(row: Any) -> OutboxEntry:
    return OutboxEntry(
        int(row[0]), str(row[1]), str(row[2]), str(row[3]), str(row[4]), int(row[5]), str(row[6])
    )


def dead_letters_of(rows: Sequence[Any]) -> tuple[DeadLetter, ...]:
    return tuple(DeadLetter(int(r[0]) / 1_000_000, str(r[1]), int(r[2]), str(r[3])) for r in rows)


class Kept:
    """What both outboxes keep in memory: the counts last seen, and the puts handed over but
    not yet committed (the queue is non-empty from the moment an episode is handed over, so
    later writebacks line up behind it at once)."""

    def __init__(self) -> None:
        self._counts = Counts(0, 0)
        self._unsettled = 0
        self._drops = FailureLog(logger, "the outbox")

    @property
    def depth(self) -> int:
        """Episodes waiting (including ones handed over but not yet committed)."""
        return self._counts.depth + self._unsettled

    @property
    def bytes(self) -> int:
        """The bytes the waiting episodes count against the bound."""
        return self._counts.bytes

    @property
    def dropped(self) -> int:
        """Episodes dropped on overflow, over the outbox's whole life."""
        return self._counts.dropped

    @property
    def dead_letters(self) -> int:
        """Episodes Philia refused for what they are, over the outbox's whole life."""
        return self._counts.dead

    @property
    def recent_dead_letters(self) -> tuple[DeadLetter, ...]:
        """The newest dead letters (at most :data:`DEAD_LETTERS_SHOWN`), newest first."""
        return self._counts.recent

    @property
    def pending(self) -> bool:
        # Asked on every writeback and every successful call: kept to two reads.
        return self._counts.depth > 0 or self._unsettled > 0

    def _settle(self, counts: Counts) -> None:
        before = self._counts.dropped
        self._counts = counts
        if counts.dropped > before:
            # Once full, every new episode drops some: a warning per period, not each.
            self._drops.failed(
                f"outbox full: dropped {counts.dropped - before} oldest episode(s) "
                f"({counts.dropped} in all)"
            )
