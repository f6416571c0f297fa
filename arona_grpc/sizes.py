"""Sizes decided once for what goes to Philia: an episode's sides and a recall question.

Philia takes frames of at most about 1 MiB (the embedded store refuses anything over
:data:`~arona_grpc.philia.MAX_REQUEST_BYTES` with close code 1009), so nothing a client
sends may turn into a bigger request. Two caps, enforced by the service before any call:

- **an episode side** (``ARONA_MEMORY_MAX_EPISODE_CHARS``, default 32,000):
  the user text and the assistant text are each kept to that many characters; a longer side
  keeps its beginning and its end, with a visible marker between them
  (``[… 412,345 characters omitted …]``) saying how much was left out;
- **a recall question** (``ARONA_MEMORY_MAX_QUERY_CHARS``, default 4,000): a
  longer question is recalled by its last part (where a long message usually asks).

The defaults fit the frame whatever the text: a character takes at most 12 bytes in a frame
(an astral character written as two ``\\uXXXX`` escapes, when a lone surrogate sends the frame
through the standard ``json`` encoder), so two sides of 32,000 characters take at most
768,000 bytes plus their envelope. Larger configured caps are still safe: a request that might
not fit is encoded and measured, and shortened further until it does.
"""

from __future__ import annotations

from typing import Any

from arona_grpc.philia import MAX_REQUEST_BYTES, QUERY_METHOD, STORE_METHOD, request_bytes

# The most bytes one character can take in a frame (see the module docstring).
MAX_BYTES_PER_CHAR = 12
# Generous room for a frame's envelope beyond its text: jsonrpc, id, method, the other params.
_ENVELOPE_BYTES = 512
_MARKER = "\n[\u2026 {:,} characters omitted \u2026]\n"


def shortened(text: str, max_chars: int) -> str:
    """``text`` itself when it has at most ``max_chars`` characters; else its first and last
    parts (``max_chars`` in all) with a marker between them naming what was left out."""
    if len(text) <= max_chars:
        return text
    head = (max_chars + 1) // 2
    tail = max_chars - head
    marker = _MARKER.format(len(text) - max_chars)
    return text[:head] + marker + (text[-tail:] if tail else "")


def last_part(text: str, max_chars: int) -> str:
    """The last ``max_chars`` characters of ``text`` (all of it when shorter)."""
    return text if len(text) <= max_chars else text[-max_chars:]


def _fits_for_sure(text: str, params_chars: int = 0) -> bool:
    # Cheap bound first: most requests never need to be encoded to be measured.
    worst = (len(text) + params_chars) * MAX_BYTES_PER_CHAR + _ENVELOPE_BYTES
    return worst <= MAX_REQUEST_BYTES


def fitted_episode(user: str, assistant: str, node_type: str, max_side_chars: int) -> str:
    """``User: …\\nAssistant: …`` (an empty side left out) with each side at most
    ``max_side_chars`` characters (:func:`shortened`), and the store request it makes no
    larger than Philia's frame budget (shortened further if the text needs it)."""
    cap = max(1, min(max_side_chars, max(len(user), len(assistant))))
    while True:
        text = compose_episode(shortened(user, cap), shortened(assistant, cap))
        if _fits_for_sure(text, len(node_type)):
            return text
        size = request_bytes(STORE_METHOD, {"text": text, "node_type": node_type})
        if size <= MAX_REQUEST_BYTES or cap == 1:
            return text
        cap = max(1, min(cap - 1, int(cap * MAX_REQUEST_BYTES / size * 0.9)))


def fitted_query(query: str, max_chars: int, params: dict[str, Any]) -> str:
    """The last ``max_chars`` characters of ``query``, fewer if the recall request with
    ``params`` (its other parameters) would not fit Philia's frame budget."""
    cap = max(1, min(max_chars, len(query)))
    extra = sum(len(str(v)) for v in params.values())
    while True:
        part = last_part(query, cap)
        if _fits_for_sure(part, extra):
            return part
        size = request_bytes(QUERY_METHOD, {"query": part, **params})
        if size <= MAX_REQUEST_BYTES or cap == 1:
            return part
        cap = max(1, min(cap - 1, int(cap * MAX_REQUEST_BYTES / size * 0.9)))


def compose_episode(user: str, assistant: str) -> str:
    """``User: …\\nAssistant: …`` with an empty (or blank) side left out."""
    parts = []
    if user.strip():
        parts.append(f"User: {user}")
    if assistant.strip():
        parts.append(f"Assistant: {assistant}")
    return "\n".join(parts)
