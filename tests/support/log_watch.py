"""Every log record of some loggers, as they are emitted, for tests that await them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator


class LogWatch(logging.Handler):
    """Keeps the records of the watched loggers (all levels) and wakes waiters."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._changed.set()

    def at_least(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= level]

    def matching(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]

    async def wait_for(
        self, done: Callable[[list[logging.LogRecord]], bool], timeout_s: float = 10.0
    ) -> None:
        async with asyncio.timeout(timeout_s):
            while not done(self.records):
                self._changed.clear()
                await self._changed.wait()


@contextlib.contextmanager
def watching(*names: str) -> Iterator[LogWatch]:
    """Watch ``names`` at every level for the block (their levels are restored after)."""
    watch = LogWatch()
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.DEBUG)
        log.addHandler(watch)
    try:
        yield watch
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.removeHandler(watch)
            log.setLevel(level)
