"""Validation of a chat request, shared by REST and ``chat.send``.

A request is checked field by field on the raw JSON object so that every
unknown OpenAI field is forwarded upstream untouched; a client mistake is a
:class:`~gateway_http.errors.GatewayError` of kind BAD_INPUT naming the field.
"""

from __future__ import annotations

from typing import Any

from arona_grpc.scopes import user_error as _scope_user_error
from gateway_http.errors import bad_input

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# The gateway's own fields: read here, never forwarded upstream.
GATEWAY_FIELDS = ("memory", "conversation_id")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_input("'messages' must be a non-empty array of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_input(f"'messages[{i}]' must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_input(f"'messages[{i}].role' must be one of {', '.join(sorted(ROLES))}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise bad_input(f"'messages[{i}].content' must be a string or an array of parts")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise bad_input(f"'messages[{i}].content' parts must be objects")
    return messages


def user_error(user: Any) -> str | None:
    """Why an OpenAI ``user`` value is refused, or None when it is fine (or absent)."""
    if user is None:
        return None
    if not isinstance(user, str):
        return "'user' must be a string"
    problem = _scope_user_error(user)
    return None if problem is None else f"'user' {problem}"


def split_body(body: Any) -> tuple[dict[str, Any], bool | None, str | None]:
    """Validate an OpenAI chat body; return (body for upstream, memory, conversation_id).

    The ``user`` field is checked here and forwarded upstream with the rest.
    """
    if not isinstance(body, dict):
        raise bad_input("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_input("'model' must be a non-empty string")
    validate_messages(body.get("messages"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_input("'stream' must be a boolean")
    memory = body.get("memory")
    if memory is not None and not isinstance(memory, bool):
        raise bad_input("'memory' must be true, false or null")
    conversation_id = body.get("conversation_id")
    if conversation_id is not None and (
        not isinstance(conversation_id, str) or not conversation_id
    ):
        raise bad_input("'conversation_id' must be a non-empty string or null")
    problem = user_error(body.get("user"))
    if problem is not None:
        raise bad_input(problem)
    upstream = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
    return upstream, memory, conversation_id
