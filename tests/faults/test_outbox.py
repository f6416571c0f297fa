"""No writeback is lost: episodes Philia could not take wait in the outbox and replay in order.

Chat level: real turns through the gateway while Philia is refused, then back (all
episodes stored once each, in order), and across a restart of the gRPC service with
episodes still queued (the rest stored after the restart).
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from arona_grpc.service import MemoryDomain, WritebackOutcome
from tests.e2e.stack import running_stack
from tests.faults.harness import FaultStack, fault_stack
from tests.support.fake_philia import STORE, Step
from tests.support.log_watch import watching
from tests.support.raw_philia import closed_port

pytestmark = pytest.mark.asyncio

N = 6
# These tests are about the outbox, not the recall budget. Once Philia is back, the next turn's
# recall is the breaker's probe and must reconnect to Philia within its budget: on a loaded
# machine that took longer than a 0.4 s budget once, the probe failed, the breaker
# re-opened for its 30 s and the replay never started. A recall that fails at once (Philia
# refused) does not wait for any budget, so a long one changes nothing else here.
OUTBOX_BUDGET = {"memory_recall_budget_ms": 10_000}
# The occurred_at property Philia receives.
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"


class Writebacks:
    """Counts finished Writeback calls in the domain, so a test can await them."""

    def __init__(self, domain: MemoryDomain, monkeypatch: pytest.MonkeyPatch) -> None:
        original = domain.writeback
        self.done = 0
        self._changed = asyncio.Condition()

        async def counted(
            user: str,
            assistant: str,
            scope: str = "",
            episode_id: str = "",
            occurred_at: float | None = None,
        ) -> WritebackOutcome:
            try:
                return await original(user, assistant, scope, episode_id, occurred_at)
            finally:
                async with self._changed:
                    self.done += 1
                    self._changed.notify_all()

        monkeypatch.setattr(domain, "writeback", counted)

    async def wait(self, count: int) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.done >= count), 10)


def episode(i: int) -> str:
    return f"User: turn {i}\nAssistant: reply to: turn {i}"


def domain_of(fs: FaultStack) -> MemoryDomain:
    assert fs.stack.grpc is not None
    return fs.stack.grpc.domain


async def turns_while_down(fs: FaultStack, writebacks: Writebacks, count: int) -> None:
    for i in range(1, count + 1):
        turn = await fs.turn(f"turn {i}")
        assert (turn.turn.status, turn.turn.memory) == (200, "offline")
        # One at a time, as a user chats: the episode is queued before the next turn.
        await writebacks.wait(i)


async def test_down_for_n_turns_then_back_stores_all_in_order_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str | None
) -> None:
    async with fault_stack(
        tmp_path,
        memory_writeback=True,
        memory_breaker_cooldown_s=30.0,
        database_url=backend,
        **OUTBOX_BUDGET,
    ) as fs:
        writebacks = Writebacks(domain_of(fs), monkeypatch)
        await fs.raw.refuse()
        await turns_while_down(fs, writebacks, N)
        status = await fs.status()
        assert (status["outbox_depth"], status["outbox_dropped"]) == (N, 0)
        assert status["breaker"] == "open"
        assert fs.stack.philia.stored == []

        # Philia is back; after the cooldown the next turn's recall is the probe, and its
        # success starts the replay. That turn's own episode lines up behind the queue.
        await fs.raw.listen()
        fs.clock.advance(31.0)
        back = await fs.turn(f"turn {N + 1}")
        assert back.turn.memory == "enabled"
        await asyncio.wait_for(fs.stack.philia.wait_frames(STORE, N + 1), 10)
        await writebacks.wait(N + 1)

        texts = [s["text"] for s in fs.stack.philia.stored]
        assert texts == [episode(i) for i in range(1, N + 2)]
        status = await fs.status()
        assert (status["outbox_depth"], status["breaker"]) == (0, "closed")
        stored_events = [e for e in status["events"] if e["kind"] == "writeback"]
        assert len(stored_events) == N + 1


async def test_an_outage_is_a_few_log_lines_not_one_per_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = 20
    async with fault_stack(
        tmp_path, memory_writeback=True, memory_breaker_cooldown_s=30.0, **OUTBOX_BUDGET
    ) as fs:
        writebacks = Writebacks(domain_of(fs), monkeypatch)
        await fs.raw.refuse()
        with watching("gateway_http", "arona_grpc") as seen:
            http_failures = seen.matching

            def heard_of(count: int) -> Callable[[object], bool]:
                return lambda _: len(http_failures("writeback failed (")) == count

            for i in range(1, turns + 1):
                turn = await fs.turn(f"turn {i}")
                assert (turn.turn.status, turn.turn.memory) == (200, "offline")
                await writebacks.wait(i)
                # The HTTP layer has heard of this episode's fate too.
                await seen.wait_for(heard_of(i))
                if i == 5:
                    warnings_after_five = len(seen.at_least(logging.WARNING))
            # Fifteen more turns of the same outage add no warning.
            assert len(seen.at_least(logging.WARNING)) == warnings_after_five
            [http_warning] = [
                r for r in seen.at_least(logging.WARNING) if r.name.startswith("gateway_http")
            ]
            # It says the episode was kept, not lost.
            assert "queued in the outbox" in http_warning.getMessage()

            await fs.raw.listen()
            fs.clock.advance(31.0)
            back = await fs.turn(f"turn {turns + 1}")
            assert back.turn.memory == "enabled"
            await seen.wait_for(lambda _: bool(http_failures("Writeback answers again")))
        [recovered] = http_failures("Writeback answers again")
        assert recovered.levelno == logging.INFO
        assert f"({turns - 1} more failure(s) since the last warning)" in recovered.getMessage()
        await asyncio.wait_for(fs.stack.philia.wait_frames(STORE, turns + 1), 10)


async def test_restart_with_a_non_empty_outbox_stores_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str | None
) -> None:
    async with fault_stack(
        tmp_path,
        memory_writeback=True,
        memory_breaker_cooldown_s=30.0,
        database_url=backend,
        **OUTBOX_BUDGET,
    ) as fs:
        writebacks = Writebacks(domain_of(fs), monkeypatch)
        await fs.raw.refuse()
        await turns_while_down(fs, writebacks, N)

        # Philia comes back: the replay sends the queued episodes as one batch, and Philia
        # stores all of them but the third, on which it stalls; the service is then stopped
        # (its grace runs out on the stalled replay).
        fs.stack.philia.script(STORE, Step(), Step(), Step(action="hang"))
        await fs.raw.listen()
        fs.clock.advance(31.0)
        await fs.stack.turn("rest", [{"role": "user", "content": "hello"}], memory=True)
        await asyncio.wait_for(fs.stack.philia.wait_stored(N - 1), 10)
        before = [s["text"] for s in fs.stack.philia.stored]
        assert before[: N - 1] == [episode(i) for i in range(1, N + 1) if i != 3]

    assert (tmp_path / "outbox.db").exists() == (backend is None)
    hello = "User: hello\nAssistant: reply to: hello"
    # Next start: a fresh Philia (nothing stored yet) and the same data directory.
    async with running_stack(tmp_path, memory_writeback=True, database_url=backend) as stack:
        # The stalled episode, then the "hello" turn's own unless it went with the batch.
        rest = [episode(3)] + ([] if hello in before else [hello])
        await asyncio.wait_for(stack.philia.wait_stored(len(rest)), 10)
    texts = [s["text"] for s in stack.philia.stored]
    assert texts == rest
    if backend is None:
        with contextlib.closing(sqlite3.connect(tmp_path / "outbox.db")) as db:
            assert db.execute("SELECT COUNT(*) FROM episodes").fetchone() == (0,)
    else:
        conn = await asyncpg.connect(backend)
        try:
            assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
        finally:
            await conn.close()


@pytest.mark.timeout(120)  # the shutdown grace is waited out: 6 s, idle or loaded
async def test_shutdown_keeps_an_in_flight_writeback_for_the_next_start(
    tmp_path: Path, backend: str | None
) -> None:
    """The stop order of the command line: HTTP drains its writebacks, then gRPC stops."""
    # A long RPC timeout: the store is still waiting when the shutdown begins.
    async with running_stack(
        tmp_path, memory_writeback=True, timeout_s=30.0, database_url=backend
    ) as stack:
        stack.philia.script(STORE, Step(action="hang"))
        turn = await stack.turn("rest", [{"role": "user", "content": "keep me"}])
        assert turn.status == 200
        await asyncio.wait_for(stack.philia.wait_frames(STORE), 5)
        # Leaving the block stops HTTP (the writeback's grace runs out on the hang),
        # then the gRPC service, which keeps the episode in the outbox.

    async with running_stack(tmp_path, memory_writeback=True, database_url=backend) as stack:
        await asyncio.wait_for(stack.philia.wait_frames(STORE), 10)
    assert [s["text"] for s in stack.philia.stored] == [
        "User: keep me\nAssistant: reply to: keep me"
    ]


async def test_a_turn_answered_while_the_grpc_service_is_down_is_sent_at_the_next_start(
    tmp_path: Path,
) -> None:
    """The writeback journal: the service never got the episode, the HTTP layer keeps it,
    and sends it with the time of its turn (not the time of the next start)."""
    async with running_stack(
        tmp_path, memory_writeback=True, grpc_target=f"127.0.0.1:{closed_port()}"
    ) as stack:
        before = int(time.time())
        turn = await stack.turn("rest", [{"role": "user", "content": "keep me too"}])
        answered = time.time()
        assert (turn.status, turn.memory) == (200, "offline")
        # Leaving the block drains the writeback, which fails: nobody took the episode.
    assert stack.philia.frames_of(STORE) == []

    async with running_stack(tmp_path, memory_writeback=True) as stack:
        await asyncio.wait_for(stack.philia.wait_stored(1), 10)
    [stored] = stack.philia.stored
    assert stored["text"] == "User: keep me too\nAssistant: reply to: keep me too"
    sent = calendar.timegm(time.strptime(stored["properties"]["occurred_at"], RFC3339))
    assert before <= sent <= answered
