"""The writeback outbox: episodes that could not be stored, kept until replayed.

One SQLite file (``outbox.db`` under ``ARONA_DATA_DIR``), or a PostgreSQL table shared by the
replicas, holds a FIFO of episodes keyed by an ever-growing sequence number, so that replay
order is queue order. It is bounded by the **bytes** its episodes take
(``ARONA_MEMORY_OUTBOX_MAX_MB``, default 256: each episode counts its text, its other fields
and :data:`ENTRY_OVERHEAD_BYTES`), not by a count: when a new episode would overflow it, the
**oldest** entries are dropped (the newest turns are the ones a user is most likely to ask
about next) and counted; the count survives restarts and is reported by Status.

The replay takes the oldest episodes a batch at a time (:meth:`Outbox.oldest`), removes those
Philia stored in one transaction, and moves one Philia refused for what it is (too large,
invalid: sending it again would be refused again) to the **dead-letter list**
(:meth:`Outbox.dead_letter`), so it never holds up the episodes behind it. Dead letters keep
their text on disk for an operator (the newest :data:`DEAD_LETTERS_KEPT`); their count and the
reasons of the last few (no text) are reported by Status.

The file is created only when the first episode has to be kept, so a healthy gateway
never pays for SQLite: the domain stores episodes straight to Philia and consults only
:attr:`Outbox.pending`, an in-memory mirror. All SQLite work runs on one worker thread
that owns the connection, in submission order (a commit may wait on the disk, which must
not stall the event loop). Work already submitted completes even if its caller is
cancelled, which is what keeps an episode queued during shutdown.

Its modules: :mod:`~arona_grpc.outbox.model` (entries, dead letters, the counts both backends keep
in memory), :mod:`~arona_grpc.outbox.sqlite` (``outbox.db``) and
:mod:`~arona_grpc.outbox.postgres` (the table the replicas share); :func:`open_outbox` picks one.
"""

from __future__ import annotations

from typing import Any

from arona_grpc.config import Settings
from arona_grpc.outbox.model import (
    DEAD_LETTERS_KEPT,
    DEAD_LETTERS_SHOWN,
    ENTRY_OVERHEAD_BYTES,
    OUTBOX_FILE,
    DeadLetter,
    OutboxClosed,
    OutboxEntry,
    entry_bytes,
)
from arona_grpc.outbox.postgres import PostgresOutbox
from arona_grpc.outbox.sqlite import Outbox

AnyOutbox = Outbox | PostgresOutbox


def open_outbox(settings: Settings, pool: Any | None) -> AnyOutbox:
    """The outbox of this deployment: the shared table with a pool, else ``outbox.db``."""
    if pool is not None:
        assert settings.database_url is not None
        return PostgresOutbox(
            pool,
            settings.database_url,
            settings.memory_outbox_max_bytes,
            settings.memory_outbox_claim_s,
        )
    return Outbox(settings.data_dir, settings.memory_outbox_max_bytes)


__all__ = [
    "DEAD_LETTERS_KEPT",
    "DEAD_LETTERS_SHOWN",
    "ENTRY_OVERHEAD_BYTES",
    "OUTBOX_FILE",
    "AnyOutbox",
    "DeadLetter",
    "Outbox",
    "OutboxClosed",
    "OutboxEntry",
    "PostgresOutbox",
    "entry_bytes",
    "open_outbox",
]
