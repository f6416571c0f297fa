"""The memory section a recall injects, and its fencing: rendering memories as the section
(header, one ``- [score] text`` line each, continuation lines indented), capping it to
:data:`~arona_grpc.service.model.MAX_SECTION_CHARS`, cutting any section out of a turn's text,
and the episode text a turn is stored as.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from arona_grpc.philia import PhiliaMemory
from arona_grpc.service.model import ELLIPSIS, MAX_MEMORY_CHARS, MAX_SECTION_CHARS, SECTION_HEADER
from arona_grpc.sizes import compose_episode

logger = logging.getLogger(__name__)


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


def cap_memories(
    memories: Iterable[PhiliaMemory],
    max_chars: int = MAX_SECTION_CHARS,
    max_memory_chars: int = MAX_MEMORY_CHARS,
) -> tuple[PhiliaMemory, ...]:
    """The memories that fit one section of at most ``max_chars`` characters.

    Blank memories are left out; a text longer than ``max_memory_chars`` is cut and
    ends with ``…``; then the lowest score is dropped (the later one on a tie) until
    the rendered section fits. The order of the survivors is kept.
    """
    return capped_section(memories, max_chars, max_memory_chars)[0]


def capped_section(
    memories: Iterable[PhiliaMemory], max_chars: int, max_memory_chars: int
) -> tuple[tuple[PhiliaMemory, ...], str]:
    """:func:`cap_memories` and the section it renders, rendered once when it fits."""
    kept: list[PhiliaMemory] = []
    for memory in memories:
        text = memory.text.strip()
        if not text:
            continue
        if len(text) > max_memory_chars:
            text = text[: max_memory_chars - len(ELLIPSIS)].rstrip() + ELLIPSIS
        if text != memory.text:
            memory = PhiliaMemory(
                text=text, score=memory.score, node_type=memory.node_type, node_id=memory.node_id
            )
        kept.append(memory)
    section = render_section(kept)
    while kept and len(section) > max_chars:
        lowest = min(range(len(kept)), key=lambda i: (kept[i].score, -i))
        del kept[lowest]
        section = render_section(kept)
    return tuple(kept), section


# An injected section inside a turn's text: the header line, then its bullets and their
# indented continuation lines (the shape render_section gives it).
_SECTION_BLOCK = re.compile(
    r"^[ \t]*" + re.escape(SECTION_HEADER) + r"[^\n]*(?:\n(?:- \[|  )[^\n]*)*\n?", re.MULTILINE
)
_BLANK_RUN = re.compile(r"\n{3,}")


def without_memory_section(text: str) -> str:
    """``text`` without any injected memory section (header, bullets, indented lines).

    An episode must never contain recalled memories: stored again, they would be recalled
    as new ones, nesting sections turn after turn (the ``echo`` model's replies carry the
    section it received). Text without a section is returned unchanged.
    """
    if SECTION_HEADER not in text:
        return text
    return _BLANK_RUN.sub("\n\n", _SECTION_BLOCK.sub("", text)).strip()


def episode_text(user: str, assistant: str) -> str:
    """``User: …\\nAssistant: …`` with an empty (or blank) side left out.

    Injected memory sections are removed from both sides first.
    """
    return compose_episode(without_memory_section(user), without_memory_section(assistant))
