"""Whether this process can write its files: each fault said once, and shown while it lasts.

A data directory that stops taking writes (a full disk, a file system remounted read-only,
permissions changed under a running process) fails every write of every turn. Said on each,
it was thousands of ERROR lines a minute and a status that still looked healthy.
:class:`StorageFaults` is one process's record of it, per part (the outbox, the episode index,
the writeback journal):

- the first failed write of a part is one ERROR line naming the part, its file, the reason
  and what it costs; later failures are debug records, and while the fault lasts an ERROR
  line again at most every :data:`STORAGE_LOG_EVERY_S` with how many writes failed since;
- the first write that succeeds again ends the fault with one INFO line, as does
  :meth:`StorageFaults.recheck` (what Status and a metrics scrape call) once a test file can be
  written beside the part's file again, so a fault of a file nothing writes to for a while
  (the outbox, once Philia is back) does not outlive its cause; a part that fails again
  within the period is not said again (nor its end);
- :meth:`StorageFaults.current` is what ``memory.status``, ``/metrics`` and the console show.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)

# While a part keeps failing, at most one ERROR line per this many seconds.
STORAGE_LOG_EVERY_S = 60.0
# A failing part's directory is tried again (recheck) at most this often.
RECHECK_EVERY_S = 5.0


@dataclass(frozen=True)
class StorageFault:
    """A part whose writes fail now."""

    part: str  # "outbox", "episode index", "journal"
    where: str  # its file's name (the full path is in the log line)
    reason: str  # "No space left on device", "database or disk is full"
    since: float  # wall-clock seconds of the first failed write
    failed_writes: int


@dataclass
class _Fault:
    fault: StorageFault
    path: str
    next_line_at: float
    said: bool
    left_out: int = 0
    next_check_at: float = 0.0


def write_error(exc: BaseException) -> str:
    """A write failure's reason, as the operating system or SQLite says it."""
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, sqlite3.Error):
        return str(exc) or type(exc).__name__
    return type(exc).__name__


class StorageFaults:
    """The write faults of one process's files, by part (see the module docstring)."""

    def __init__(
        self,
        every_s: float = STORAGE_LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._every_s = every_s
        self._clock = clock
        self._wall = wall
        self._faults: dict[str, _Fault] = {}
        # When a part may be said to fail again (a fault that comes back soon is not).
        self._quiet_until: dict[str, float] = {}

    def failed(self, part: str, path: str, exc: BaseException, cost: str) -> bool:
        """A write of ``part`` (the file ``path``) failed with ``exc``; ``cost`` says what that
        loses ("episodes ... are lost"). True when this begins a fault that is said."""
        reason = write_error(exc)
        now = self._clock()
        current = self._faults.get(part)
        if current is None:
            name = path.rsplit("/", 1)[-1]
            fault = StorageFault(part, name, reason, self._wall(), 1)
            said = now >= self._quiet_until.get(part, -math.inf)
            self._faults[part] = _Fault(
                fault, path, now + self._every_s, said, 0, now + RECHECK_EVERY_S
            )
            if said:
                self._quiet_until[part] = now + self._every_s
                logger.error("cannot write the %s (%s): %s; %s", part, path, reason, cost)
            else:
                logger.debug("cannot write the %s (%s) again: %s", part, path, reason)
            return said
        current.fault = replace(
            current.fault, reason=reason, failed_writes=current.fault.failed_writes + 1
        )
        if now < current.next_line_at:
            current.left_out += 1
            logger.debug("cannot write the %s (%s): %s", part, path, reason)
            return False
        logger.error(
            "still cannot write the %s (%s): %s (%d failed writes since the last line); %s",
            part,
            path,
            reason,
            current.left_out + 1,
            cost,
        )
        current.left_out = 0
        current.next_line_at = now + self._every_s
        self._quiet_until[part] = current.next_line_at
        return False

    def succeeded(self, part: str) -> None:
        """A write of ``part`` succeeded: the end of its fault, if it had one."""
        if not self._faults:
            return
        ended = self._faults.pop(part, None)
        if ended is not None and ended.said:
            logger.info(
                "the %s (%s) can be written again (%d writes had failed)",
                part,
                ended.path,
                ended.fault.failed_writes,
            )

    def recheck(self) -> None:
        """For each failing part whose file is on disk: write a test file beside it (at most
        every :data:`RECHECK_EVERY_S`); if that works, the fault has ended."""
        if not self._faults:
            return
        now = self._clock()
        for part, fault in list(self._faults.items()):
            if now < fault.next_check_at or not os.path.isabs(fault.path):
                continue
            fault.next_check_at = now + RECHECK_EVERY_S
            if _writable(os.path.dirname(fault.path)):
                self.succeeded(part)

    def failing(self, part: str) -> bool:
        return part in self._faults

    def current(self) -> tuple[StorageFault, ...]:
        """The parts failing now, the longest-failing first."""
        return tuple(
            sorted((f.fault for f in self._faults.values()), key=lambda fault: fault.since)
        )


def _writable(directory: str) -> bool:
    """Whether a file of one page can be written (and removed) in ``directory``."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".arona-write-check-", dir=directory)
    except OSError:
        return False
    try:
        os.write(fd, bytes(4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
