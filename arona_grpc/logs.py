"""Request ids and the log format, shared by both processes.

A request id travels in the context variable :data:`REQUEST_ID`: the HTTP layer sets it
for each request (the client's ``X-Request-Id`` when it is sane, otherwise a new one),
sends it to the gRPC service as ``x-request-id`` metadata, and the servicer sets it
again for the RPC, so both processes' log lines about one turn carry the same id.
Tasks started during a request (the background writeback) inherit it with their context.

:func:`configure_logging` is called once by the entry point: it installs a
:class:`RequestIdFilter` on the root handler and either the text format or, with
``ARONA_LOG_FORMAT=json``, :class:`JsonFormatter` (one JSON object per line). Both
formatters mask the configured secrets in the finished line as a backstop: nothing logs
them on purpose.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
import time
from collections.abc import Iterable

import orjson

from arona_common.redact import redact_text

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "arona_request_id", default=None
)
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def new_request_id() -> str:
    """A fresh request id: 32 hex digits."""
    return secrets.token_hex(16)


def sane_request_id(value: str | None) -> str | None:
    """``value`` when it is a usable request id (1 to 128 printable ASCII characters)."""
    if value and len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable():
        return value
    return None


def request_id_or_new(value: str | None) -> str:
    """The client's request id when it is sane, otherwise a new one (never an error)."""
    return sane_request_id(value) or new_request_id()


class RequestIdFilter(logging.Filter):
    """Puts the current request id (or ``None``) on every record as ``request_id``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """The plain format, with ``[request_id]`` after the logger name when there is one."""

    def __init__(self, secret_values: Iterable[str | None] = ()) -> None:
        super().__init__(TEXT_FORMAT)
        self._secrets = tuple(s for s in secret_values if s)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        if request_id:
            prefix = f" {record.name}: "
            line = line.replace(prefix, f" {record.name} [{request_id}]: ", 1)
        return redact_text(line, self._secrets)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, ``request_id``
    (and ``exception`` with the traceback when there is one)."""

    def __init__(self, secret_values: Iterable[str | None] = ()) -> None:
        super().__init__()
        self._secrets = tuple(s for s in secret_values if s)

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _rfc3339_ms(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact_text(record.getMessage(), self._secrets),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            entry["exception"] = redact_text(self.formatException(record.exc_info), self._secrets)
        return orjson.dumps(entry).decode()


def _rfc3339_ms(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def configure_logging(
    level: str, log_format: str = "text", secret_values: Iterable[str | None] = ()
) -> None:
    """Configure the root logger once, at the entry point."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    formatter: logging.Formatter
    if log_format == "json":
        formatter = JsonFormatter(secret_values)
    else:
        formatter = TextFormatter(secret_values)
    handler.setFormatter(formatter)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
