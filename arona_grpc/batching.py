"""The one writer of each side of an ``Exchange`` stream.

A gRPC stream takes one write at a time, and a write cancelled halfway cancels the whole
stream, so on either side (the HTTP layer's calls, the service's replies) nobody writes but a
:class:`BatchWriter`'s task: callers add to the side's next message and say when it should go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class BatchWriter:
    """Writes a side's batched messages: at once after :meth:`kick`, or after :meth:`linger`
    with the next kick or within ``linger_s``.

    ``write_batch`` writes what is batched and says whether it wrote anything (False ends the
    round, as does a write that failed: it says so itself). ``lingering`` says whether what is
    left after a round may still wait for the next kick. Nothing is written while :attr:`open`
    is False.
    """

    def __init__(
        self,
        write_batch: Callable[[], Awaitable[bool]],
        lingering: Callable[[], bool],
        linger_s: float,
        *,
        open: bool,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._write_batch = write_batch
        self._lingering = lingering
        self._linger_s = linger_s
        self.open = open
        # Something waiting must be written now, not only with the next kick.
        self._urgent = False
        self._task: asyncio.Task[None] | None = None
        # The timer that kicks when nothing else does.
        self._timer: asyncio.TimerHandle | None = None

    def kick(self) -> None:
        """Write what is waiting now (and whatever lingers, with it)."""
        self._urgent = True
        if self._task is None and self.open:
            self._task = self._loop.create_task(self._flush())

    def linger(self) -> None:
        """Write what is waiting with the next kick, or within ``linger_s``."""
        if self._task is None and self._timer is None and self.open:
            self._timer = self._loop.call_later(self._linger_s, self.kick)

    async def drain(self) -> None:
        """Return once nothing is being written."""
        while self._task is not None:
            await self._task

    def close(self) -> None:
        """Write nothing more: the stream is over."""
        self.open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            while self._urgent:
                self._urgent = False
                if not await self._write_batch():
                    break
        finally:
            self._task = None
        if self._lingering():
            # What came during the write and may wait: it goes with the next kick.
            self.linger()
