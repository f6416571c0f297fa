"""The gateway in front of a fault-injecting Philia, and the leak check of the fault suite.

:func:`fault_stack` runs the real stack (:func:`tests.e2e.stack.running_stack`) with
its memory URL pointing at a :class:`RawPhilia` front that pipes to the stack's
scripted :class:`FakePhilia` until a test switches it to a fault. :class:`Resources`
counts what a fault could leak: asyncio tasks, open file descriptors and the Philia
client's pending waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arona_grpc.philia import PhiliaClient
from tests.e2e.stack import Stack, Turn, running_stack
from tests.support.raw_philia import RawPhilia

ASK_TEXT = "what tea do I like?"
OOLONG = {"text": "I prefer oolong tea", "score": 0.83, "node_type": "entity"}
# The recall budget is also what a healthy turn after a fault has to reconnect and recall
# in: about 55 ms for the whole turn with two busy loops on a 2-core box, so 1 s leaves a
# margin of eighteen (0.4 s once ran out on a loaded machine).
BUDGET_MS = 1000
TIMEOUT_S = 1.25
# A faulty turn answers within the recall budget plus the hops: 0.1 s when Philia's fault
# shows at once, 1.01 s when the turn waits out the budget (both idle and with two busy
# loops on a 2-core box). The bound is twelve times the slower.
BOUND_S = 12.0


def caller_headroom(budget_ms: int) -> dict[str, Any]:
    """Overrides giving the HTTP layer a recall deadline of twice the service's budget.

    For tests where the service's own budget must end a hanging recall and count it against
    the breaker. With one budget for both layers the service gives up only 50 ms before its
    caller's deadline (``DEADLINE_MARGIN_S``); on a loaded box the caller's deadline can win,
    the service's recall is then cancelled, which abandons the call instead of failing it,
    and the breaker does not move (a probe leaves it half open).
    """
    return {"http_overrides": {"memory_recall_budget_ms": 2 * budget_ms}}


class FakeClock:
    """A monotonic clock a test can move forward (to skip the breaker's cooldown)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@dataclass
class TimedTurn:
    turn: Turn
    started: float
    elapsed: float


@dataclass
class FaultStack:
    stack: Stack
    raw: RawPhilia
    clock: FakeClock = field(default_factory=FakeClock)

    @property
    def client(self) -> PhiliaClient:
        assert self.stack.grpc is not None
        client = self.stack.grpc.domain.client
        assert client is not None
        return client

    async def turn(self, text: str = ASK_TEXT, surface: str = "rest") -> TimedTurn:
        started = time.monotonic()
        turn = await self.stack.turn(surface, [{"role": "user", "content": text}])
        return TimedTurn(turn, started, time.monotonic() - started)

    def injected(self) -> str:
        """The system section the upstream received on the last turn ("" if none)."""
        messages = self.stack.upstream.last_body["messages"]
        first = messages[0]
        return str(first["content"]) if first["role"] == "system" else ""

    async def relink(self) -> None:
        """Drop the current Philia link so the next call meets the fault from its start."""
        await self.client.disconnect()
        await self.raw.wait_all_closed()

    async def status(self) -> dict[str, Any]:
        reply = await self.stack.rpc("memory.status")
        result: dict[str, Any] = reply["result"]
        return result


@contextlib.asynccontextmanager
async def fault_stack(tmp_path: Path, **overrides: Any) -> AsyncIterator[FaultStack]:
    clock = FakeClock()
    fields: dict[str, Any] = {
        "timeout_s": TIMEOUT_S,
        "memory_recall_budget_ms": BUDGET_MS,
        "memory_writeback": False,
        "clock": clock,
        **overrides,
    }
    async with RawPhilia() as raw, running_stack(tmp_path, memory_url=raw.url, **fields) as stack:
        raw.backend_port = stack.philia.port
        stack.philia.memories = [dict(OOLONG)]
        yield FaultStack(stack, raw, clock)


@dataclass(frozen=True)
class Resources:
    tasks: int
    fds: int

    @classmethod
    def now(cls) -> Resources:
        return cls(len(asyncio.all_tasks()), len(os.listdir("/proc/self/fd")))


async def assert_nothing_left(
    before: Resources, client: PhiliaClient, *, slack: int = 0, within_s: float = 3.0
) -> None:
    """No pending waiter now; tasks and descriptors back to ``before`` (+ ``slack``).

    Tasks that are ending and sockets that are closing get ``within_s`` to do so: the
    check awaits the running tasks (bounded) rather than sleeping.
    """
    assert client.pending_calls == 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        now = Resources.now()
        if now.tasks <= before.tasks + slack and now.fds <= before.fds + slack:
            return
        left = deadline - loop.time()
        if left <= 0:
            names = sorted(_describe(t) for t in asyncio.all_tasks())
            raise AssertionError(f"left behind: before {before}, now {now}; tasks: {names}")
        others = asyncio.all_tasks() - {asyncio.current_task()}
        await asyncio.wait(others, timeout=min(left, 0.1), return_when=asyncio.FIRST_COMPLETED)


def _describe(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    name: Callable[[], str] | str = getattr(coro, "__qualname__", repr(coro))
    return str(name)
