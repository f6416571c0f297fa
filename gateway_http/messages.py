"""Chat messages as the turn pipeline reads them: their text, the last user question (and what
of it an episode keeps), and the memory section the gateway injects (its header, the roles it
may have, where it goes, whether a message is one, finding one in a text).
"""

from __future__ import annotations

import re
from typing import Any

MEMORY_SECTION_HEADER = "## Relevant Long-Term Memories"
# The roles an injected section may have (a backend's ``memory_role``; ``system`` by default).
SECTION_ROLES = ("system", "developer", "user")
# ARONA_MEMORY_PLACEMENT's other value (arona_grpc.config.MEMORY_PLACEMENTS): after the
# client's leading system/developer messages, which then keep their bytes and their place.
PLACEMENT_AFTER_SYSTEM = "after_system"
# What an episode's user side says of a message that has parts but no text (a photo sent
# alone): one marker per part, so the reply stored beside it is not a reply to nothing.
_PART_MARKERS = {
    "image_url": "[image]",
    "input_image": "[image]",
    "input_audio": "[audio]",
    "file": "[file]",
}


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


def last_user_message(messages: list[Any]) -> dict[str, Any] | None:
    """The last ``user`` message that is not an injected memory section (None: there is none)."""
    for message in reversed(messages):
        if (
            isinstance(message, dict)
            and message.get("role") == "user"
            and not is_memory_section(message)
        ):
            return message
    return None


def last_user_text(messages: list[Any]) -> str:
    """The text of the last ``user`` message (``""`` when there is none): what is recalled for.

    An injected section sent as a ``user`` message (a backend's ``memory_role``) is not the
    user's question.
    """
    return message_text(last_user_message(messages))


def stored_user_text(message: Any) -> str:
    """What an episode keeps of the user's message: its text; for a message with parts but no
    text (a photo alone), a marker per part (``[image]``, ``[audio]``, ``[file]``), never
    the part itself."""
    text = message_text(message)
    if text.strip() or not isinstance(message, dict):
        return text
    content = message.get("content")
    if not isinstance(content, list):
        return text
    markers = [
        _PART_MARKERS.get(str(part.get("type")), "[attachment]")
        for part in content
        if isinstance(part, dict) and part.get("type") != "text"
    ]
    return " ".join(markers)


def section_index(messages: list[Any], placement: str) -> int:
    """Where the section goes in ``messages``: 0 (``first``), or after the leading ``system``
    and ``developer`` messages (``after_system``), so that the client's prompt prefix stays
    byte-identical and a provider's prompt cache keeps matching it."""
    if placement != PLACEMENT_AFTER_SYSTEM:
        return 0
    index = 0
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            break
        index += 1
    return index


# A whole injected section, exactly as the gRPC service renders it: the header line, then
# one or more ``- [score] text`` bullets, each memory's own further lines indented by two.
_INJECTED_SECTION = re.compile(
    re.escape(MEMORY_SECTION_HEADER) + r"(?:\n(?:- \[-?\d+\.\d\d\] [^\n]*|  [^\n]*))+\n?"
)


def is_memory_section(message: Any) -> bool:
    """Whether ``message`` is a memory section the gateway injected: a message in one of the
    roles a section may have (:data:`SECTION_ROLES`), anywhere in the context, whose whole
    text is one rendered section, nothing before or after it.

    A turn that carries one already gets no second one. Anything else that mentions the
    header (a user quoting it among words of their own, an assistant's echo of an earlier
    section in the stored history, a longer system prompt) is not the gateway's section.
    """
    return (
        isinstance(message, dict)
        and message.get("role") in SECTION_ROLES
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
