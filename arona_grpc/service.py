"""Domain logic of Recall, Writeback, Delete and Status, and the events ring buffer.

:class:`MemoryDomain` knows nothing of gRPC: it takes plain values, returns plain
outcomes and raises :class:`MemoryDomainError` subclasses that the servicer maps to
status codes in one table. Philia faults never escape ``recall`` (they become
``OFFLINE``); ``writeback`` and ``delete`` raise :class:`MemoryUnavailable` or
:class:`MemoryTimeout`. Every outcome worth knowing lands in a bounded ring buffer of
events that ``status`` reports newest first.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from arona_grpc.config import Settings
from arona_grpc.philia import PhiliaClient, PhiliaError, PhiliaMemory, PhiliaTimeout

logger = logging.getLogger(__name__)

SECTION_HEADER = "## Relevant Long-Term Memories"
DEFAULT_RECALL_LIMIT = 5
# A bound on one recall so that a careless limit cannot ask Philia for a reply
# beyond its frame budget.
MAX_RECALL_LIMIT = 100
EVENT_BUFFER_SIZE = 100
DEFAULT_STATUS_LIMIT = 50
EPISODE_NODE_TYPE = "episode"


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
    # The query (recall), the node id (writeback, delete) or a message (error).
    detail: str
    at: datetime


@dataclass(frozen=True)
class RecallOutcome:
    state: MemoryState
    # The memories in the section (blank ones left out), best first.
    memories: tuple[PhiliaMemory, ...]
    section: str


@dataclass(frozen=True)
class WritebackOutcome:
    stored: bool
    node_id: str = ""


@dataclass(frozen=True)
class StatusSnapshot:
    enabled: bool
    writeback: bool
    events: tuple[MemoryEvent, ...]


class MemoryDomainError(Exception):
    """Base of the errors the service reports; messages never carry secrets."""


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


def episode_text(user: str, assistant: str) -> str:
    """``User: …\\nAssistant: …`` with an empty (or blank) side left out."""
    parts = []
    if user.strip():
        parts.append(f"User: {user}")
    if assistant.strip():
        parts.append(f"Assistant: {assistant}")
    return "\n".join(parts)


class MemoryDomain:
    """Recall, Writeback, Delete and Status over one lazily connected Philia client."""

    def __init__(self, settings: Settings, client: PhiliaClient | None = None) -> None:
        self._settings = settings
        self._client: PhiliaClient | None = None
        if settings.memory_enabled:
            assert settings.memory_url is not None and settings.memory_token is not None
            # Lazy: constructing the client opens nothing.
            self._client = client or PhiliaClient(
                settings.memory_url, settings.memory_token, settings.memory_timeout_s
            )
        self._events: deque[MemoryEvent] = deque(maxlen=EVENT_BUFFER_SIZE)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def writeback_enabled(self) -> bool:
        return self.enabled and self._settings.memory_writeback

    async def recall(self, query: str, limit: int = 0) -> RecallOutcome:
        """Memories for ``query`` and their section; Philia faults give ``OFFLINE``."""
        if self._client is None or not query.strip():
            return RecallOutcome(MemoryState.DISABLED, (), "")
        limit = min(limit or DEFAULT_RECALL_LIMIT, MAX_RECALL_LIMIT)
        try:
            found = await self._client.query(query, limit)
        except PhiliaError as exc:
            message = self._safe(f"recall failed: {exc}")
            logger.warning("%s; the turn goes on without memories", message)
            self._record(EventKind.ERROR, message)
            return RecallOutcome(MemoryState.OFFLINE, (), "")
        self._record(EventKind.RECALL, query)
        kept = tuple(m for m in found if m.text.strip())
        if not kept:
            return RecallOutcome(MemoryState.DISABLED, (), "")
        return RecallOutcome(MemoryState.ENABLED, kept, render_section(kept))

    async def writeback(self, user: str, assistant: str) -> WritebackOutcome:
        """Store the turn as an episode, unless memory or writeback is off or it is empty."""
        if self._client is None or not self._settings.memory_writeback:
            return WritebackOutcome(stored=False)
        text = episode_text(user, assistant)
        if not text:
            return WritebackOutcome(stored=False)
        try:
            node_id = await self._client.store(text, EPISODE_NODE_TYPE)
        except PhiliaError as exc:
            raise self._fault("writeback", exc) from None
        self._record(EventKind.WRITEBACK, node_id)
        return WritebackOutcome(stored=True, node_id=node_id)

    async def delete(self, node_id: str) -> bool:
        """Delete one node; whether it existed."""
        if not node_id.strip():
            raise InvalidArgument("node_id is required")
        if self._client is None:
            raise NotConfigured("memory is not configured (ARONA_MEMORY_URL, ARONA_MEMORY_TOKEN)")
        try:
            deleted = await self._client.delete(node_id)
        except PhiliaError as exc:
            raise self._fault("delete", exc) from None
        self._record(EventKind.DELETE, node_id)
        return deleted

    def status(self, limit: int = 0) -> StatusSnapshot:
        """Configuration and the most recent events, newest first."""
        limit = min(limit or DEFAULT_STATUS_LIMIT, EVENT_BUFFER_SIZE)
        newest_first = tuple(reversed(self._events))[:limit]
        return StatusSnapshot(self.enabled, self.writeback_enabled, newest_first)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _fault(self, action: str, exc: PhiliaError) -> MemoryDomainError:
        message = self._safe(f"{action} failed: {exc}")
        logger.warning("%s", message)
        self._record(EventKind.ERROR, message)
        if isinstance(exc, PhiliaTimeout):
            return MemoryTimeout(message)
        return MemoryUnavailable(message)

    def _safe(self, text: str) -> str:
        # Philia errors are already token-free; this is the backstop for status output.
        return self._client.redact(text) if self._client is not None else text

    def _record(self, kind: EventKind, detail: str) -> None:
        self._events.append(MemoryEvent(kind, detail, datetime.now(UTC)))
