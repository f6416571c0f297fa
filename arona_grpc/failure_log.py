"""A warning for a run of failures, not one per failure.

Some calls run on every chat turn (the HTTP layer's ``Recall`` and ``Writeback``, the
outbox making room while Philia is down): during an outage they fail on every turn, and a
warning each would flood the log. :class:`FailureLog` says it once, then at most once per
period with a count of what it left out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

# While the same thing keeps failing, at most one warning per this many seconds.
FAILURE_LOG_EVERY_S = 30.0


class FailureLog:
    """Logs a run of failures of one call (``what``) without flooding the log.

    The first failure is a warning; later ones are warnings again only once
    ``every_s`` has passed since the last warning (saying how many were left out),
    and debug records in between. The first success after a warning is logged at
    info level with the failures left out since it. A success costs one attribute
    read when nothing failed. ``level`` is the level of what is said instead of a
    warning, for events that are the callers' doing, not a fault (INFO).
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        every_s: float = FAILURE_LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        *,
        level: int = logging.WARNING,
    ) -> None:
        self._log = log
        self._level = level
        self._what = what
        self._every_s = every_s
        self._clock = clock
        self._next_warning_at = -math.inf
        self._left_out = 0  # failures logged at debug level only, since the last warning
        self._warned = False  # a warning not yet followed by a success

    def failed(self, message: str) -> None:
        now = self._clock()
        if now < self._next_warning_at:
            self._left_out += 1
            self._log.debug("%s", message)
            return
        if self._left_out:
            self._log.log(
                self._level,
                "%s (%d more like it since the last %s)",
                message,
                self._left_out,
                "warning" if self._level == logging.WARNING else "line",
            )
        else:
            self._log.log(self._level, "%s", message)
        self._left_out = 0
        self._next_warning_at = now + self._every_s
        self._warned = True

    def succeeded(self) -> None:
        if not self._warned:
            return
        self._warned = False
        left_out, self._left_out = self._left_out, 0
        more = f" ({left_out} more failure(s) since the last warning)" if left_out else ""
        self._log.info("%s answers again%s", self._what, more)
