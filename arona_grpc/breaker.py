"""The circuit breaker in front of every Philia call (recall, writeback, delete, replay).

:class:`CircuitBreaker` counts consecutive failures. After ``failures`` of them it
*opens*: for ``cooldown_s`` seconds :meth:`CircuitBreaker.admit` refuses every call,
so callers answer at once without touching the network. Once the cooldown has run,
exactly **one** call is let through as a probe (*half-open*); its success closes
the breaker, its failure opens it again for another cooldown. A probe that ends
without a verdict (its caller was cancelled) frees the slot for the next caller.

It holds no tasks and never sleeps: time comes from an injectable monotonic clock
(tests pass their own), and the wall-clock time of the last opening is kept for
Status. Each opening calls ``on_open`` with a one-line reason (the domain records
it as an ``error`` event).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

logger = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    # The cooldown is over: the next call (or the one in flight) is the probe.
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Permit:
    """Leave to make one call; ``probe`` is true for the single half-open trial."""

    probe: bool


# The two possible permits, shared: admitting a call allocates nothing.
_CALL = Permit(probe=False)
_PROBE = Permit(probe=True)


def _wall_now() -> datetime:
    return datetime.now(UTC)


class CircuitBreaker:
    """Consecutive-failure breaker with one half-open probe; see the module docstring."""

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = _wall_now,
        on_open: Callable[[str], None] | None = None,
    ) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("a breaker needs failures >= 1 and a positive cooldown")
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._on_open = on_open
        self._open = False
        self._consecutive = 0
        self._opened_mono = 0.0
        self._probing = False
        self.opened_at: datetime | None = None
        """Wall-clock time of the most recent opening (kept after it closes)."""

    @property
    def state(self) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        if self._probing or self.cooldown_left() == 0.0:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def cooldown_left(self) -> float:
        """Seconds until a probe may run (0 when closed or the cooldown is over)."""
        if not self._open:
            return 0.0
        return max(0.0, self._opened_mono + self._cooldown_s - self._clock())

    def admit(self) -> Permit | None:
        """A permit for one call, or ``None`` when the call must not touch the network."""
        if not self._open:
            return _CALL
        if self._probing or self.cooldown_left() > 0.0:
            return None
        self._probing = True
        return _PROBE

    def success(self, permit: Permit) -> None:
        """The call reached Philia and got a well-formed answer."""
        if permit.probe:
            self._probing = False
        self._consecutive = 0
        if self._open:
            # A success admitted before the opening is as good a sign as the probe's.
            self._open = False
            logger.info("memory breaker closed: Philia answers again")

    def failure(self, permit: Permit) -> None:
        """The call failed against Philia (refused, timed out, broke the protocol)."""
        if permit.probe:
            self._probing = False
            self._trip("memory breaker re-opened: the probe call failed")
            return
        if self._open:
            # A call admitted before the opening fails late: already counted as open.
            return
        self._consecutive += 1
        if self._consecutive >= self._threshold:
            self._trip(f"memory breaker opened after {self._consecutive} consecutive failures")

    def abandon(self, permit: Permit) -> None:
        """The call ended without a verdict (cancelled): free the probe slot."""
        if permit.probe:
            self._probing = False

    def _trip(self, reason: str) -> None:
        self._open = True
        self._consecutive = 0
        self._opened_mono = self._clock()
        self.opened_at = self._wall_clock()
        logger.warning("%s; cooling down for %g s", reason, self._cooldown_s)
        if self._on_open is not None:
            self._on_open(reason)
