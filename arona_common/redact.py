"""The one place that makes URLs safe to print.

The Philia token travels on the upgrade URL (``?token=…``), so every log line,
error or status that shows a URL passes it through :func:`redact_url` first.
"""

from __future__ import annotations

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


def redact_text(text: str, secrets: tuple[str | None, ...]) -> str:
    """Mask every occurrence of any non-empty secret inside free text."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text
