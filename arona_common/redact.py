"""The one place that makes URLs and free text safe to print.

The Philia token travels on the upgrade URL (``?token=…``), so every log line,
error or status that shows a URL passes it through :func:`redact_url` first.
:func:`redact_text` masks configured secrets in free text wherever one stands whole.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_SECRET_KEYS = frozenset({"token", "access_token", "api_key", "apikey", "key", "password"})
REDACTED = "***"


def redact_url(url: str) -> str:
    """Return ``url`` with credentials and secret-bearing query values masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unprintable url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, REDACTED if k.lower() in _SECRET_KEYS else v) for k, v in pairs], safe="*"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def url_password(url: str | None) -> str | None:
    """The password in ``url``'s credentials, if any (to mask it in free text)."""
    if not url:
        return None
    try:
        return urlsplit(url).password
    except ValueError:
        return None


# What a secret continues into when it is part of a longer word: letters, digits, "_" and "-"
# (the characters of generated tokens, and of names such as all-MiniLM-L6-v2-onnx-int8).
_WORD = r"[\w-]"


def _is_word(char: str) -> bool:
    return char == "-" or char == "_" or char.isalnum()


@functools.lru_cache(maxsize=32)
def _secrets_pattern(secrets: tuple[str, ...]) -> re.Pattern[str] | None:
    """One pattern for ``secrets``, the longest first (a URL before the password in it); a
    secret's end that is a word character must not touch another one."""
    alternatives = []
    for secret in sorted(set(secrets), key=len, reverse=True):
        before = f"(?<!{_WORD})" if _is_word(secret[0]) else ""
        after = f"(?!{_WORD})" if _is_word(secret[-1]) else ""
        alternatives.append(before + re.escape(secret) + after)
    return re.compile("|".join(alternatives)) if alternatives else None


def redact_text(text: str, secrets: tuple[str | None, ...]) -> str:
    """Mask every occurrence of any non-empty secret in free text where it stands whole.

    A secret inside a longer word is not masked: a short token (``x``) would otherwise mask
    every letter ``x`` of every line, garbling it and showing where the token's letters are.
    """
    pattern = _secrets_pattern(tuple(secret for secret in secrets if secret))
    return text if pattern is None else pattern.sub(REDACTED, text)
