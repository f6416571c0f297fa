"""What an import shows while it runs: a progress bar on a terminal, plain lines otherwise.

On a terminal the bar is redrawn in place (at most :data:`REDRAW_S` apart); bad lines are
printed above it as they are found. Anywhere else (a log file, a pipe, CI) a plain progress
line is printed at each tenth of the lines and at least every :data:`EVERY_S` seconds, so a
log shows progress without a line per turn.

``--check`` stores nothing, so its progress counts lines, valid and bad, instead of episodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

REDRAW_S = 0.1
EVERY_S = 15.0
BAR_WIDTH = 28


class Progress:
    """Counts and shows an import's progress on ``out`` (its standard error)."""

    def __init__(
        self,
        out: TextIO,
        total_lines: int,
        *,
        tty: bool | None = None,
        checking: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._out = out
        self._tty = out.isatty() if tty is None else tty
        self._checking = checking
        self._clock = clock
        self.total = total_lines
        self.lines = 0
        self.episodes = 0
        self.bad = 0
        self._started = clock()
        self._shown_at = -1e9
        self._next_tenth = 1
        self._drawn = False

    def line_done(self, episodes: int = 0, *, bad: bool = False) -> None:
        """One more line dealt with (imported, skipped, checked or ``bad``), with the episodes
        it stored."""
        self.lines += 1
        self.episodes += episodes
        self.bad += bad
        now = self._clock()
        if self._tty:
            if now - self._shown_at >= REDRAW_S or self.lines == self.total:
                self._draw(now)
            return
        tenth_reached = self.total and self.lines * 10 >= self._next_tenth * self.total
        if tenth_reached or now - self._shown_at >= EVERY_S:
            while self.total and self.lines * 10 >= self._next_tenth * self.total:
                self._next_tenth += 1
            self._shown_at = now
            label = "check" if self._checking else "import"
            self._out.write(f"{label}: {self._status(now)}\n")
            self._out.flush()

    def say(self, text: str) -> None:
        """A line of its own (a bad line's report), above the bar on a terminal."""
        if self._tty and self._drawn:
            self._out.write("\r\x1b[K")
            self._drawn = False
        self._out.write(text + "\n")
        if self._tty:
            self._draw(self._clock())
        else:
            self._out.flush()

    def finish(self) -> None:
        """Leave the bar as it ended, on a line of its own."""
        if self._tty and self._drawn:
            self._draw(self._clock())
            self._out.write("\n")
            self._out.flush()
            self._drawn = False

    def _draw(self, now: float) -> None:
        share = self.lines / self.total if self.total else 1.0
        filled = round(share * BAR_WIDTH)
        bar = "█" * filled + "·" * (BAR_WIDTH - filled)
        label = "checking" if self._checking else "importing"
        self._out.write(f"\r\x1b[K{label} [{bar}] {self._status(now)}")
        self._out.flush()
        self._shown_at = now
        self._drawn = True

    def _status(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        share = self.lines / self.total if self.total else 1.0
        text = f"{self.lines:,}/{self.total:,} lines ({share:.0%}), "
        if self._checking:
            text += (
                f"{self.lines - self.bad:,} valid, {self.bad:,} bad, "
                f"{self.lines / elapsed:,.0f} lines/s"
            )
        else:
            text += f"{self.episodes:,} episodes, {self.episodes / elapsed:,.0f} episodes/s"
        if 0 < self.lines < self.total:
            left = elapsed * (self.total - self.lines) / self.lines
            text += f", {_duration(left)} left"
        return text


def _duration(seconds: float) -> str:
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"
