"""Validation of a chat request, shared by REST and ``chat.send``.

A request is checked field by field on the raw JSON object so that every
unknown OpenAI field is forwarded upstream untouched; a client mistake is a
:class:`~gateway_http.errors.GatewayError` of kind BAD_INPUT naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from arona_grpc.scopes import user_error as _scope_user_error
from gateway_http.errors import bad_input

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES = frozenset(get_args(Role))
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


def _sane_user(value: str) -> str:
    problem = user_error(value)
    if problem is not None:
        raise ValueError(problem)
    return value


NonEmpty = Annotated[StrictStr, Field(min_length=1)]
# The OpenAI `user` field: bounded, printable.
User = Annotated[StrictStr, AfterValidator(_sane_user)]


class ChatOptions(BaseModel):
    """The optional fields of a chat request the gateway checks, alike on REST and in
    ``chat.send`` (whose params model extends this one)."""

    temperature: StrictFloat | StrictInt | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    conversation_id: NonEmpty | None = None
    memory: StrictBool | None = None
    # The OpenAI `user` field: narrows the caller's memory scope.
    user: User | None = None


_OPTIONS = tuple(ChatOptions.model_fields)


class ChatMessage(BaseModel):
    """A message as :func:`validate_messages` takes it (its published schema)."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(ChatOptions):
    """``POST /v1/chat/completions``: what :func:`split_body` takes, as published in
    ``/openapi.json``. Any other field is forwarded upstream untouched."""

    model_config = ConfigDict(extra="allow")
    model: NonEmpty
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: StrictBool | None = None


def _options_problem(exc: ValidationError) -> str:
    """The first option refused, named, and why (never the value)."""
    first = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    # The options are flat: the field is the first part (the rest names a union's member).
    return f"'{first['loc'][0]}': {first['msg']}"


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
    try:
        options = ChatOptions.model_validate({k: body[k] for k in _OPTIONS if k in body})
    except ValidationError as exc:
        raise bad_input(_options_problem(exc)) from None
    upstream = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
    return upstream, options.memory, options.conversation_id
