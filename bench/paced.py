"""Chat turns at a steady rate from a fixed number of clients, and what the store got of them.

Shared by the store-outage row of the benchmark (:mod:`bench.outage`) and the fault suite
(``tests/faults``): :class:`PacedTurns` drives echo-model turns against a gateway and keeps
every answered one; :func:`stored_user_texts` reads the embedded store's own database file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def stored_user_texts(db: Path) -> set[str]:
    """The user side of every episode in the store's database, read from the file."""
    if not db.exists():
        return set()
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        rows = conn.execute("SELECT text FROM nodes").fetchall()
    users = set()
    for (text,) in rows:
        found = re.match(r"User: (\S+)", str(text))
        if found:
            users.add(found.group(1))
    return users


@dataclass
class PacedTurns:
    """Chat turns from ``concurrency`` clients at ``rate`` turns a second in all.

    Each turn says a word of its own (``<prefix>-<run>-<n>``). :attr:`answered` keeps, for
    every turn answered 200, its word and when it was answered. While :attr:`up` is clear (the
    gateway was killed) the clients wait for it instead of calling. Bounded: at most
    ``max_turns`` turns, and none after ``stop`` is set. A synchronous caller runs it in a
    thread of its own (:meth:`start_thread`).
    """

    rate: float
    concurrency: int
    max_turns: int
    url: str = ""
    prefix: str = "fact"
    up: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    answered: list[tuple[float, str]] = field(default_factory=list)
    failed: int = 0
    offline: int = 0
    _answer: asyncio.Condition = field(default_factory=asyncio.Condition)
    _next_slot: float = 0.0
    _counter: itertools.count[int] = field(default_factory=itertools.count)
    _run: str = field(default_factory=lambda: os.urandom(3).hex())

    def point_at(self, url: str) -> None:
        self.url = url
        self.up.set()

    def answered_between(self, start: float, end: float) -> int:
        return sum(1 for at, _ in list(self.answered) if start <= at < end)

    def start_thread(self) -> Callable[[], None]:
        """Run the turns in a thread with a loop of its own; the function that stops them
        (and waits for the thread)."""
        loops: list[asyncio.AbstractEventLoop] = []
        ready = threading.Event()

        async def main() -> None:
            loops.append(asyncio.get_running_loop())
            ready.set()
            await self.run()

        thread = threading.Thread(target=asyncio.run, args=(main(),), name="paced-turns")
        thread.daemon = True
        thread.start()
        ready.wait(60)

        def stop() -> None:
            if loops and thread.is_alive():
                loops[0].call_soon_threadsafe(self.stop.set)
            thread.join(120)

        return stop

    async def wait_answered(self, count: int, within_s: float) -> None:
        """Until ``count`` turns have been answered in all (at most ``within_s``)."""
        async with self._answer:
            await asyncio.wait_for(
                self._answer.wait_for(lambda: len(self.answered) >= count), within_s
            )

    @property
    def words(self) -> set[str]:
        return {word for _, word in self.answered}

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.concurrency)))

    async def _paced(self) -> None:
        # One slot every 1/rate seconds, shared by the clients: slots missed while every
        # client was busy are caught up, at most a second's worth (not a whole outage's).
        now = time.monotonic()
        slot = max(now - 1.0, self._next_slot)
        self._next_slot = slot + 1 / self.rate
        if slot > now:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), slot - now)

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            n = next(self._counter)
            if n >= self.max_turns:
                return
            await self._paced()
            if self.stop.is_set():
                return
            if not self.up.is_set():
                waiting = asyncio.ensure_future(self.up.wait())
                stopping = asyncio.ensure_future(self.stop.wait())
                await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                stopping.cancel()
                continue
            word = f"{self.prefix}-{self._run}-{n:07d}"
            try:
                response = await client.post(
                    f"{self.url}/v1/chat/completions",
                    json={"model": "echo", "messages": [{"role": "user", "content": word}]},
                )
            except httpx.TransportError:
                self.failed += 1
                continue
            if response.status_code == 200:
                if response.headers.get("x-arona-memory") == "offline":
                    self.offline += 1
                async with self._answer:
                    self.answered.append((time.monotonic(), word))
                    self._answer.notify_all()
            else:
                self.failed += 1
