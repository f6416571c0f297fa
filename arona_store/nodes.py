"""What a stored node is: its row, its time-ordered key, and the store's caller error.

Time-ordered keys. A node's ``seq`` (the rowid of both ``nodes`` and the FTS index) is its
``created_at`` in whole microseconds, bumped to the next free integer on a collision; so the
``created_at`` the ranking uses is ``seq / 1e6`` (exact to the microsecond; a bulk load of
nodes sharing one timestamp spreads them by a microsecond each, nothing a ranking by time can
see). FTS5 walks a match list in rowid order for free, so matches arrive newest first.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

# A node's seq is its created_at in these units (microseconds).
KEY_SCALE = 1_000_000
# Timestamps further than this from 1970 (about year 5138) are refused: their keys would not
# fit a 64-bit rowid with room to spare.
MAX_ABS_EPOCH_S = 1e11

Timestamp = datetime | float | int

# A node row as inserted: seq, id, node_type, text, created_at, source_episode_id,
# related_node_ids (JSON), properties (JSON), digest.
Row = tuple[int, str, str, str, float, str | None, str, str, bytes]


class StoreError(Exception):
    """A caller error the store refuses (empty text, bad limit); the message is safe to show."""


@dataclass(frozen=True)
class MemoryHit:
    """One ranked recall result."""

    node_id: str
    node_type: str
    text: str
    score: float
    created_at: float


@dataclass(frozen=True)
class NewNode:
    """One node to insert with :meth:`MemoryStore.add_many`."""

    text: str
    node_type: str = "episode"
    created_at: Timestamp | None = None
    source_episode_id: str | None = None
    related_node_ids: Sequence[str] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    # Its embedding as stored (arona_store.vectors.to_blob), for a hybrid store; None: the
    # store embeds it itself.
    vector: bytes | None = None


def epoch(value: Timestamp | None) -> float:
    """Seconds since 1970 of ``value``; None is now."""
    if value is None:
        return time.time()
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value)


def key_of(created_at: float) -> int:
    """The time-ordered key of a node created at ``created_at`` (before collisions)."""
    if not math.isfinite(created_at) or abs(created_at) > MAX_ABS_EPOCH_S:
        raise StoreError("created_at must be a finite time within a few thousand years")
    return math.floor(created_at * KEY_SCALE)


def now_key(now: float) -> int:
    # Clamped like a stored key so a far-off `now` cannot overflow SQLite's integers.
    return math.floor(max(-MAX_ABS_EPOCH_S, min(MAX_ABS_EPOCH_S, now)) * KEY_SCALE)


def digest(
    node_type: str, text: str, source_episode_id: str | None, related: str, properties: str
) -> bytes:
    """The 16-byte digest that finds identical nodes (fields as stored, JSON-encoded)."""
    canonical = json.dumps([node_type, text, source_episode_id, related, properties])
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()
