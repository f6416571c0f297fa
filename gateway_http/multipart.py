"""One text field of a ``multipart/form-data`` body, read and replaced without touching the rest.

An upload route (``/v1/audio/transcriptions``) is routed by its ``model`` form field, and an
alias is sent under the backend's own name for it; every other byte of the body (the file, the
other fields, each part's headers) goes upstream as the client sent it, so the body is never
decoded and encoded again: the field's value is found between its part's headers and the next
delimiter (RFC 7578), and only those bytes are replaced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The boundary parameter of a Content-Type, quoted or not (RFC 2046: at most 70 characters).
_BOUNDARY = re.compile(r';\s*boundary=(?:"([^"]{1,70})"|([^";\s]{1,70}))', re.IGNORECASE)
# A part's form-data name: `name=` as a parameter of its own, never the end of `filename=`.
_NAME = re.compile(
    rb'^content-disposition:\s*form-data\s*;(?:[^\r\n]*;)?\s*name="([^"\r\n]*)"',
    re.IGNORECASE | re.MULTILINE,
)
_CRLF = b"\r\n"
_HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True, slots=True)
class Field:
    """Where a field's value lies in a body: ``body[start:end]``."""

    start: int
    end: int


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` Content-Type; None for any other type."""
    kind, _, _ = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    found = _BOUNDARY.search(content_type)
    if found is None:
        return None
    return (found.group(1) or found.group(2)).encode("latin-1")


def find_field(body: bytes, boundary: bytes, name: str) -> Field | None:
    """The first part named ``name`` of a multipart body; None when there is none (or the
    body is not well-formed up to it)."""
    delimiter = b"--" + boundary
    wanted = name.encode()
    position = body.find(delimiter)
    while position != -1:
        start = position + len(delimiter)
        if body.startswith(b"--", start) or not body.startswith(_CRLF, start):
            return None
        head_start = start + len(_CRLF)
        head_end = body.find(_HEAD_END, head_start)
        if head_end == -1:
            return None
        value_start = head_end + len(_HEAD_END)
        following = body.find(_CRLF + delimiter, value_start)
        if following == -1:
            return None
        named = _NAME.search(body, head_start, head_end + len(_CRLF))
        if named is not None and named.group(1) == wanted:
            return Field(value_start, following)
        position = following + len(_CRLF)
    return None


def replaced(body: bytes, field: Field, value: str) -> bytes:
    """``body`` with ``field``'s value replaced by ``value``."""
    return body[: field.start] + value.encode() + body[field.end :]
