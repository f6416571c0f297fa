"""Chat messages as the turn pipeline reads them: their text, the last user question, and the
memory section the gateway injects (its header, whether a message is one, finding one in a text).
"""

from __future__ import annotations

import re
from typing import Any

MEMORY_SECTION_HEADER = "## Relevant Long-Term Memories"


def message_text(message: Any) -> str:
    """The text of one chat message: string content, or the ``text`` parts of a content list
    joined by ``\\n``; anything else is ``""``."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def last_user_text(messages: list[Any]) -> str:
    """The text of the last ``user`` message (``""`` when there is none)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message)
    return ""


# A whole injected section, exactly as the gRPC service renders it: the header line, then
# one or more ``- [score] text`` bullets, each memory's own further lines indented by two.
_INJECTED_SECTION = re.compile(
    re.escape(MEMORY_SECTION_HEADER) + r"(?:\n(?:- \[-?\d+\.\d\d\] [^\n]*|  [^\n]*))+\n?"
)


def is_memory_section(message: Any) -> bool:
    """Whether ``message`` is a memory section the gateway injected: a ``system`` message
    whose whole text is one rendered section, nothing before or after it.

    A turn that carries one already gets no second one. Anything else that mentions the
    header (a user quoting it, an assistant's echo of an earlier section in the stored
    history, a longer system prompt) is not the gateway's section.
    """
    return (
        isinstance(message, dict)
        and message.get("role") == "system"
        and _INJECTED_SECTION.fullmatch(message_text(message)) is not None
    )


def memory_section(text: str) -> str | None:
    """The ``## Relevant Long-Term Memories`` section inside ``text``, verbatim, or ``None``.

    The section runs from its header to the next heading of the same or a higher level (memory
    lines can never start one: their continuation lines are indented) or the end of the text.
    """
    lines = text.split("\n")
    for start, line in enumerate(lines):
        if line.rstrip() == MEMORY_SECTION_HEADER:
            end = start + 1
            while end < len(lines) and not lines[end].startswith(("# ", "## ")):
                end += 1
            return "\n".join(lines[start:end]).rstrip()
    return None


def without_injected_sections(text: str) -> str:
    """``text`` without any section shaped as the gateway renders one (the header, its
    bullets and their indented lines), as the memory service fences what it stores."""
    return _INJECTED_SECTION.sub("", text)
