"""The memory tools an agent sees: their names, descriptions, input schemas and annotations,
the models their arguments are checked with, and the shape of their results.

The gateway's ``/mcp`` serves them (:mod:`gateway_http.mcp.server`); the stdio bridge lists
them from here when the gateway cannot be reached (:mod:`gateway_http.mcp.bridge`). A result is
JSON twice: ``structured_content`` and the same object as text, for agents that read only text.
A failure is a tool error (``is_error``) whose structured content is ``{"error", "reason"}``
and whose text is the reason, so that an agent reads why and what to do.
"""

from __future__ import annotations

from typing import Annotated, Any

import mcp_types as types
import orjson
import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from gateway_http.chat_request import NonEmpty

SEARCH = "search_memories"
ADD = "add_memory"
LIST = "list_memories"
DELETE = "delete_memory"
FORGET = "forget_memories"
TOOL_NAMES = (SEARCH, ADD, LIST, DELETE, FORGET)

# As a chat turn recalls (gateway_http.turns.RECALL_LIMIT) and at most what memory.recall takes.
SEARCH_DEFAULT = 5
SEARCH_MAX = 100
# A page an agent's context takes in comfortably; memory.list's most.
LIST_DEFAULT = 20
LIST_MAX = 100

INSTRUCTIONS = (
    "Long-term memory of the caller, the same memory its chat turns through this gateway "
    "recall from and write to. Search it before answering questions about the past; add "
    "what the user asks to be remembered; list, delete or forget on the user's request."
)


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SearchArguments(_Arguments):
    query: NonEmpty
    limit: Annotated[StrictInt, Field(ge=1, le=SEARCH_MAX)] = SEARCH_DEFAULT


class AddArguments(_Arguments):
    text: NonEmpty


class ListArguments(_Arguments):
    contains: NonEmpty | None = None
    limit: Annotated[StrictInt, Field(ge=1, le=LIST_MAX)] = LIST_DEFAULT
    before: NonEmpty | None = None


class DeleteArguments(_Arguments):
    node_id: NonEmpty


class ForgetArguments(_Arguments):
    pass


ARGUMENTS: dict[str, type[_Arguments]] = {
    SEARCH: SearchArguments,
    ADD: AddArguments,
    LIST: ListArguments,
    DELETE: DeleteArguments,
    FORGET: ForgetArguments,
}


def _schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = list(required)
    return schema


def _text(description: str) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "description": description}


def _count(description: str, default: int, most: int) -> dict[str, Any]:
    return {
        "type": "integer",
        "minimum": 1,
        "maximum": most,
        "default": default,
        "description": description,
    }


def tool_list() -> list[types.Tool]:
    """The five tools, as ``tools/list`` answers them."""
    return [
        types.Tool(
            name=SEARCH,
            title="Search memories",
            description=(
                "Look up what the user told you before: the memories a chat turn asking "
                "`query` would recall, best first, with their score (0 to 1), node id "
                "(null when the memory store does not name it) and the section a chat turn "
                "would be given. Ask in the user's words, e.g. 'what did I say about the "
                "budget?'. An empty list means nothing relevant is remembered."
            ),
            input_schema=_schema(
                {
                    "query": _text("what to look for, as a question or key words"),
                    "limit": _count("how many memories at most", SEARCH_DEFAULT, SEARCH_MAX),
                },
                ("query",),
            ),
            annotations=types.ToolAnnotations(
                title="Search memories",
                read_only_hint=True,
                destructive_hint=False,
                idempotent_hint=True,
                open_world_hint=False,
            ),
        ),
        types.Tool(
            name=ADD,
            title="Add a memory",
            description=(
                "Remember `text` for the user: later chat turns and searches recall it. Use "
                "it when the user asks you to remember something ('save that my deploy key "
                "rotates on Fridays'); write a self-contained sentence. Returns the new "
                "memory's node id. Adding the same text again soon after returns the same "
                "memory. A '## Relevant Long-Term Memories' section inside the text is cut "
                "out (recalled memories are never stored again)."
            ),
            input_schema=_schema({"text": _text("what to remember")}, ("text",)),
            annotations=types.ToolAnnotations(
                title="Add a memory",
                read_only_hint=False,
                destructive_hint=False,
                idempotent_hint=True,
                open_world_hint=False,
            ),
        ),
        types.Tool(
            name=LIST,
            title="List memories",
            description=(
                "The user's own memories, newest first: node id, a preview of the text and "
                "when it was stored. Pass `contains` to keep those whose preview holds that "
                "text (any case); when `next` is not null, pass it as `before` for the next "
                "page."
            ),
            input_schema=_schema(
                {
                    "contains": _text("only memories whose preview holds this text"),
                    "limit": _count("how many memories per page", LIST_DEFAULT, LIST_MAX),
                    "before": _text("the `next` of the previous page"),
                }
            ),
            annotations=types.ToolAnnotations(
                title="List memories",
                read_only_hint=True,
                destructive_hint=False,
                idempotent_hint=True,
                open_world_hint=False,
            ),
        ),
        types.Tool(
            name=DELETE,
            title="Delete a memory",
            description=(
                "Delete one of the user's own memories by its node id (from list_memories or "
                "search_memories). Another caller's memory is never deleted: the answer is "
                "then deleted=false with a reason."
            ),
            input_schema=_schema({"node_id": _text("the memory's node id")}, ("node_id",)),
            annotations=types.ToolAnnotations(
                title="Delete a memory",
                read_only_hint=False,
                destructive_hint=True,
                idempotent_hint=True,
                open_world_hint=False,
            ),
        ),
        types.Tool(
            name=FORGET,
            title="Forget everything",
            description=(
                "Erase everything remembered of the user: all their memories, and their "
                "stored chat conversations. It cannot be undone: call it only when the user "
                "asks for it explicitly. Returns how many memories and conversations went."
            ),
            input_schema=_schema({}),
            annotations=types.ToolAnnotations(
                title="Forget everything",
                read_only_hint=False,
                destructive_hint=True,
                idempotent_hint=True,
                open_world_hint=False,
            ),
        ),
    ]


class ToolFailure(Exception):
    """A tool call that failed for a reason the agent should read: ``error`` a fixed code,
    ``reason`` a sentence safe to show (never a secret, never a traceback)."""

    def __init__(self, error: str, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


# Validation messages quoted in a tool error, at most.
_MAX_FIELD_ERRORS = 5


def checked_arguments(tool: str, arguments: dict[str, Any] | None) -> _Arguments:
    """``arguments`` checked against ``tool``'s model; :class:`ToolFailure` naming each
    field that is wrong (never its value)."""
    try:
        return ARGUMENTS[tool].model_validate(arguments or {})
    except pydantic.ValidationError as exc:
        problems = [
            f"{'.'.join(str(part) for part in item['loc']) or 'arguments'}: {item['msg']}"
            for item in exc.errors(include_url=False, include_input=False, include_context=False)
        ]
        text = "; ".join(problems[:_MAX_FIELD_ERRORS])
        if len(problems) > _MAX_FIELD_ERRORS:
            text += f"; and {len(problems) - _MAX_FIELD_ERRORS} more"
        raise ToolFailure("invalid_arguments", f"invalid arguments for {tool}: {text}") from None


def result(payload: dict[str, Any]) -> types.CallToolResult:
    """A tool's answer: ``payload`` as structured content and as JSON text."""
    return types.CallToolResult(
        content=[types.TextContent(text=orjson.dumps(payload).decode())],
        structured_content=payload,
    )


def failure(error: str, reason: str) -> types.CallToolResult:
    """A tool error an agent can act on: the reason as text, and ``{"error", "reason"}``."""
    return types.CallToolResult(
        content=[types.TextContent(text=reason)],
        structured_content={"error": error, "reason": reason},
        is_error=True,
    )
