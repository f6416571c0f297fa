"""What conversations look like on the wire, shared by REST and JSON-RPC, and
the one translation of conversation lookup failures into gateway errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from arona_common.database import DatabaseUnavailable
from gateway_http.conversations import (
    PAGE_DEFAULT_MESSAGES,
    PAGE_MAX_MESSAGES,
    Conversation,
    ConversationForbidden,
    ConversationNotFound,
    ConversationStore,
    parse_cursor,
)
from gateway_http.errors import ErrorKind, GatewayError, bad_input

logger = logging.getLogger(__name__)

# The error of a page size out of range or not a number (REST and JSON-RPC alike).
LIMIT_ERROR = f"'limit' must be an integer from 1 to {PAGE_MAX_MESSAGES}"


def rfc3339_ms(at: datetime) -> str:
    """``2026-01-01T00:00:00.000Z``: RFC 3339, UTC, milliseconds."""
    at = at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def conversation_view(conversation: Conversation) -> dict[str, Any]:
    return {
        "id": conversation.id,
        "object": "conversation",
        "title": conversation.title,
        "created_at": rfc3339_ms(conversation.created_at),
        "updated_at": rfc3339_ms(conversation.updated_at),
    }


async def conversation_with_messages(
    conversations: ConversationStore,
    conversation: Conversation,
    limit: int = PAGE_DEFAULT_MESSAGES,
    before: str | None = None,
) -> dict[str, Any]:
    """A conversation and a page of its messages: the most recent ``limit`` (before the
    cursor ``before``), ``has_more`` and the cursor of older ones (``first_id``)."""
    if not 1 <= limit <= PAGE_MAX_MESSAGES:
        raise bad_input(LIMIT_ERROR)
    try:
        key = parse_cursor(before)
    except ValueError as exc:
        raise bad_input(str(exc)) from None
    page = await conversations.page(conversation.id, limit, key)
    return {
        **conversation_view(conversation),
        "messages": page.messages,
        "has_more": page.has_more,
        "first_id": page.first_id,
    }


def database_unavailable() -> GatewayError:
    """503 ``database_unavailable`` (JSON-RPC ``-32000``): what needs the database while it
    does not answer."""
    return GatewayError(
        ErrorKind.UNAVAILABLE, "the database is unavailable", "database_unavailable"
    )


@contextmanager
def conversation_errors() -> Iterator[None]:
    """Unknown id -> 404 ``conversation_not_found``; another owner's -> 403; the database
    unreachable -> 503 ``database_unavailable``."""
    try:
        yield
    except DatabaseUnavailable:
        # The outage is said once, by arona_common.database.
        raise database_unavailable() from None
    except ConversationNotFound:
        raise GatewayError(
            ErrorKind.NOT_FOUND, "conversation not found", "conversation_not_found"
        ) from None
    except ConversationForbidden:
        raise GatewayError(
            ErrorKind.FORBIDDEN, "conversation belongs to another user", "conversation_forbidden"
        ) from None
