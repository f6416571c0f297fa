"""The import file's format: one JSON object a line, each a conversation or a single turn.

A **conversation** is an OpenAI chat as a request carries it, with times::

    {"messages": [...], "user": "bob", "conversation_id": "c-1", "time": "2023-05-08T13:56:00Z"}

Each run of ``user`` messages and the ``assistant`` messages answering it is one turn, stored
as one episode the way a chat turn is written back (the user's text, the reply's text);
``system``, ``developer``, ``tool`` and ``function`` messages are skipped, and so are turns
with no text on either side. A message may carry its own ``time``: a turn happened at the
time of its first user message that has one, else of its first reply that has one, else at
the line's ``time``, else now.

A **turn** is a chat completion as the OpenAI API logs it, its request and its response::

    {"request": {"messages": [...], "user": "bob"}, "response": {"created": 1683554160,
     "choices": [{"message": {"role": "assistant", "content": "Noted!"}}]}}

one episode: the request's last user message and the response's first choice, at the
line's ``time``, else the response's ``created``, else now; as a chat turn is written back, a
response that calls tools is a step of a tool loop and no episode (the line of the loop's final
answer is), and one calling the function the request forced stores the call's arguments
(gateway_http.tool_loops).

A time is RFC 3339 with a time zone (``"2023-05-08T13:56:00Z"``, ``"…+02:00"``) or POSIX
seconds; the memory service's rule applies (not before 1970, not in the future). ``user`` is
OpenAI's end-user field, as in a chat request: it narrows ``--user`` (``<principal>/<user>``,
the scope a chat of that principal with that ``user`` has) or, without ``--user``, names the
scope itself. ``conversation_id`` is optional and only shown in reports. Anything wrong
makes the whole line bad, with the reason, before any of its turns is sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from arona_grpc.scopes import scope_error
from arona_grpc.service import MAX_FUTURE_SKEW_S
from gateway_http.auth import Principal, memory_scope
from gateway_http.chat_request import user_error, validate_messages
from gateway_http.errors import GatewayError
from gateway_http.messages import message_text
from gateway_http.tool_loops import stored_answer

# Roles whose messages carry no part of a turn's episode.
_SKIPPED_ROLES = frozenset({"system", "developer", "tool", "function"})
_TIME_EXAMPLE = '"2023-05-08T13:56:00Z"'
# A turn's text in bytes at most: its Writeback must stay under gRPC's 4 MiB message limit.
# (The service keeps each side to ARONA_MEMORY_MAX_EPISODE_CHARS anyway.)
MAX_TURN_BYTES = 3 << 20


class BadLine(ValueError):
    """Why a line cannot be imported (the message is the reason shown)."""


@dataclass(frozen=True)
class Turn:
    """One episode to write back."""

    user: str
    assistant: str
    # POSIX seconds; None: now.
    occurred_at: float | None
    # Stable across runs for the same line and destination: the progress file's key and
    # the episode id the memory service knows it by.
    key: str


@dataclass(frozen=True)
class ImportLine:
    turns: tuple[Turn, ...]
    # The memory scope of its turns ("" for the shared pool).
    scope: str
    conversation_id: str | None = None


def line_digest(destination: str, raw: bytes) -> str:
    """The identity of one line's content imported into one destination."""
    return hashlib.sha256(destination.encode() + b"\n" + raw).hexdigest()[:32]


def parse_line(
    raw: bytes, *, principal: str | None, destination: str, now: float | None = None
) -> ImportLine:
    """One line of the import file as the turns it holds; :class:`BadLine` says why not."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        raise BadLine("not UTF-8 text") from None
    except RecursionError:
        # The parser recurses once a level (as the store's JSON-RPC fallback parser does); the
        # HTTP surfaces' parser refuses such a body too (orjson: more than 1,024 levels).
        raise BadLine(
            "nested too deeply (more than about 1,000 arrays and objects within one another)"
        ) from None
    except ValueError as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        column = f" (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise BadLine(f"not JSON: {reason}{column}") from None
    if not isinstance(record, dict):
        raise BadLine("a line must be a JSON object")
    now = time.time() if now is None else now
    conversation_id = record.get("conversation_id")
    if conversation_id is not None and not (isinstance(conversation_id, str) and conversation_id):
        raise BadLine("'conversation_id' must be a non-empty string")
    line_time = _time(record.get("time"), "time", now)
    # A logged step of a tool loop: a line of no episode, and not a bad one.
    step = False
    if "messages" in record:
        user = record.get("user")
        pairs = _conversation(record["messages"], line_time, now)
    elif "request" in record or "response" in record:
        user, pair, step = _completion(record, line_time, now)
        pairs = [pair] if pair is not None else []
    else:
        raise BadLine(
            "a line needs 'messages' (a conversation) or 'request' and 'response' (a turn)"
        )
    problem = user_error(user)
    if problem is not None:
        raise BadLine(problem)
    if not pairs and not step:
        raise BadLine("no user or assistant text to import")
    for i, (user_text, reply, _) in enumerate(pairs):
        try:
            size = len(user_text.encode()) + len(reply.encode())
        except UnicodeEncodeError as exc:
            raise BadLine(
                f"turn {i + 1} holds a lone surrogate ({exc.object[exc.start]!r}), "
                "which is not text"
            ) from None
        if size > MAX_TURN_BYTES:
            raise BadLine(
                f"turn {i + 1} is too large to send ({size:,} bytes of text; at most "
                f"{MAX_TURN_BYTES:,})"
            )
    scope = memory_scope(Principal(principal), user) if principal else (user or "")
    problem = scope_error(scope) if scope else None
    if problem is not None:
        # The memory service would refuse it (a line's user alone is a principal).
        raise BadLine(f"'user' cannot be a memory scope: {problem}")
    digest = line_digest(destination, raw)
    turns = tuple(
        Turn(user_text, reply, at, f"{digest}:{i}")
        for i, (user_text, reply, at) in enumerate(pairs)
    )
    return ImportLine(turns, scope or "", conversation_id)


def _conversation(
    messages: Any, line_time: float | None, now: float
) -> list[tuple[str, str, float | None]]:
    _messages(messages, "messages")
    pairs: list[tuple[str, str, float | None]] = []
    asked: list[str] = []
    answered: list[str] = []
    asked_at: float | None = None
    answered_at: float | None = None

    def close() -> None:
        nonlocal asked_at, answered_at
        user, reply = "\n".join(asked), "\n".join(answered)
        if user.strip() or reply.strip():
            at = asked_at if asked_at is not None else answered_at
            pairs.append((user, reply, at if at is not None else line_time))
        asked.clear()
        answered.clear()
        asked_at = answered_at = None

    for i, message in enumerate(messages):
        role = message["role"]
        if role in _SKIPPED_ROLES:
            continue
        at = _time(message.get("time"), f"messages[{i}].time", now)
        text = message_text(message)
        if role == "user":
            if answered:
                close()
            if text.strip():
                asked.append(text)
            if asked_at is None:
                asked_at = at
        else:
            if text.strip():
                answered.append(text)
            if answered_at is None:
                answered_at = at
    close()
    return pairs


def _completion(
    record: dict[str, Any], line_time: float | None, now: float
) -> tuple[Any, tuple[str, str, float | None] | None, bool]:
    """The line's ``user``, its turn (None: none), and whether it is a step of a tool loop."""
    request, response = record.get("request"), record.get("response")
    if not isinstance(request, dict):
        raise BadLine("'request' must be a chat completion request (an object)")
    if not isinstance(response, dict):
        raise BadLine("'response' must be a chat completion (an object)")
    messages = request.get("messages")
    _messages(messages, "request.messages")
    assert isinstance(messages, list)
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadLine("'response.choices' must be a non-empty array of choices")
    reply = choices[0].get("message")
    _messages([reply], "response.choices[0].message", single=True)
    assert isinstance(reply, dict)
    if reply.get("role") != "assistant":
        raise BadLine("'response.choices[0].message.role' must be assistant")
    at = line_time
    if at is None:
        at = _time(response.get("created"), "response.created", now)
    user = record["user"] if "user" in record else request.get("user")
    asked = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    user_text = message_text(asked) if asked is not None else ""
    reply_text = stored_answer(request, reply)
    if reply_text is None:
        # A step of a tool loop: the line of its final answer holds the turn.
        return user, None, True
    if not (user_text.strip() or reply_text.strip()):
        return user, None, False
    return user, (user_text, reply_text, at), False


def _messages(messages: Any, where: str, *, single: bool = False) -> None:
    """OpenAI chat messages, as a chat request must have them (the same checks and words);
    ``single``: ``messages`` holds one message, named ``where``."""
    try:
        validate_messages(messages)
    except GatewayError as exc:
        named = "'messages[0]" if single else "'messages"
        raise BadLine(exc.message.replace(named, f"'{where}", 1)) from None


def _time(value: Any, where: str, now: float) -> float | None:
    """A time of the file as POSIX seconds (None when absent), checked as the memory service
    checks ``occurred_at``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise BadLine(f"'{where}' must be an RFC 3339 time ({_TIME_EXAMPLE}) or seconds since 1970")
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip())
        except ValueError:
            raise BadLine(
                f"'{where}' is not an RFC 3339 time ({_TIME_EXAMPLE}): {value[:40]!r}"
            ) from None
        if parsed.tzinfo is None:
            raise BadLine(f"'{where}' needs a time zone ({_TIME_EXAMPLE}): {value[:40]!r}")
        seconds = parsed.timestamp()
    else:
        seconds = float(value)
        if not math.isfinite(seconds):
            raise BadLine(f"'{where}' must be a finite number of seconds")
    # The memory service's rule for occurred_at, checked here so that a line it would refuse
    # half-way is bad before any of its turns is sent.
    if seconds < 0:
        raise BadLine(f"'{where}' is before 1970-01-01T00:00:00Z")
    if seconds > now + MAX_FUTURE_SKEW_S:
        raise BadLine(
            f"'{where}' is in the future (more than {MAX_FUTURE_SKEW_S:.0f} s from now): {value!r}"
        )
    return min(seconds, now)
