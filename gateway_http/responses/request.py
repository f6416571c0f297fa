"""A Responses request as the gateway reads it: its own fields checked, the user's text that
memory recalls for, and the memory section put in ``instructions``.

Everything else in the body (``previous_response_id``, ``store``, ``tools``, ``reasoning``,
``input`` items of any kind) goes upstream untouched: only ``memory`` is the gateway's, and
``instructions`` gets the section ahead of the client's own.

The section goes in ``instructions`` because the Responses API does not carry a response's
``instructions`` over to the next one chained to it by ``previous_response_id``: each request
of a chain holds one section, its own, and sections never pile up in the chained context.
"""

from __future__ import annotations

import re
from typing import Any

from gateway_http.chat_request import user_error
from gateway_http.errors import bad_input
from gateway_http.messages import MEMORY_SECTION_HEADER, is_memory_section

# The gateway's own field: read here, never forwarded.
MEMORY_FIELD = "memory"
# Roles whose message items are instructions to the model (the chat's system messages).
_INSTRUCTING_ROLES = ("system", "developer")
# An injected section anywhere in a text: its header on a line of its own, then at least one
# `- [score] text` bullet (the shape the memory service renders).
_HELD_SECTION = re.compile(
    r"(?:^|\n)" + re.escape(MEMORY_SECTION_HEADER) + r"[ \t]*\n- \[-?\d+\.\d\d\] "
)


def split_body(body: Any) -> tuple[dict[str, Any], bool | None]:
    """Check a Responses body; return (the body for upstream, the ``memory`` field).

    Only what the gateway reads is checked (``model``, ``input``, ``instructions``,
    ``stream``, ``memory``, ``user``): the rest is the upstream's to judge.
    """
    if not isinstance(body, dict):
        raise bad_input("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_input("'model' must be a non-empty string")
    # Left out, it is the upstream's to judge (a prompt or an earlier response may stand in);
    # given, it is a string or items (null included, as OpenAI refuses it).
    if "input" in body and not isinstance(body["input"], str | list):
        raise bad_input("'input' must be a string or an array of input items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_input("'instructions' must be a string or null")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_input("'stream' must be a boolean")
    memory = body.get(MEMORY_FIELD)
    if memory is not None and not isinstance(memory, bool):
        raise bad_input(f"'{MEMORY_FIELD}': Input should be a valid boolean")
    problem = user_error(body.get("user"))
    if problem is not None:
        raise bad_input(problem)
    if MEMORY_FIELD not in body:
        return body, None
    return {k: v for k, v in body.items() if k != MEMORY_FIELD}, memory


def item_text(item: Any) -> str:
    """The text of one input message item: its string ``content``, or its text parts
    (``input_text``, ``output_text``, ``text``) joined by ``\\n``; ``""`` for anything else."""
    if not isinstance(item, dict):
        return ""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") in ("input_text", "output_text", "text")
        and isinstance(part.get("text"), str)
    )


def is_message(item: Any) -> bool:
    """Whether an input item is a message (``type`` ``message``, or none with a ``role``)."""
    return (
        isinstance(item, dict)
        and item.get("type", "message") == "message"
        and isinstance(item.get("role"), str)
    )


def user_text(body: dict[str, Any]) -> str:
    """What memory recalls for: a string ``input``, or the text of the last ``user`` message
    item (``""`` when there is none: a tool result sent back, an image alone)."""
    given = body.get("input")
    if isinstance(given, str):
        return given
    if isinstance(given, list):
        for item in reversed(given):
            if is_message(item) and item["role"] == "user":
                return item_text(item)
    return ""


def holds_section(body: dict[str, Any]) -> bool:
    """Whether the request already carries an injected section: in its ``instructions``, or
    as a system (developer) message item that is exactly one. Then none is added."""
    instructions = body.get("instructions")
    if isinstance(instructions, str) and _HELD_SECTION.search(instructions) is not None:
        return True
    given = body.get("input")
    if not isinstance(given, list):
        return False
    return any(
        is_message(item)
        and item["role"] in _INSTRUCTING_ROLES
        and is_memory_section({"role": "system", "content": item_text(item)})
        for item in given
    )


# An injected section at the start of a text (as with_section puts it), whole: its header,
# its bullets and their indented continuation lines.
_LEADING_SECTION = re.compile(
    re.escape(MEMORY_SECTION_HEADER) + r"(?:\n(?:- \[-?\d+\.\d\d\] [^\n]*|  [^\n]*))+"
)


def split_section(instructions: str) -> tuple[str, str]:
    """``instructions`` as (the injected section they start with, or "", and the rest)."""
    found = _LEADING_SECTION.match(instructions)
    if found is None:
        return "", instructions
    return found.group(), instructions[found.end() :].removeprefix("\n\n")


def with_section(body: dict[str, Any], section: str) -> dict[str, Any]:
    """``body`` with ``section`` ahead of its own ``instructions`` (kept, after a blank line);
    a shallow copy, the caller's body untouched."""
    own = body.get("instructions")
    instructions = f"{section}\n\n{own}" if isinstance(own, str) and own else section
    return {**body, "instructions": instructions}
