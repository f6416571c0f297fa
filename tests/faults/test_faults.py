"""Fault suite: whatever Philia does, a chat turn answers 200 in bounded time and nothing leaks.

Each fault runs on the real stack (HTTP -> gRPC -> Philia client) against a scripted
Philia on loopback. For each: the faulty turn answers 200 with ``X-Arona-Memory`` as a
user would expect within :data:`BOUND_S`, the next healthy turn gets its memories, and
no task, file descriptor or pending waiter is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.faults.harness import (
    BOUND_S,
    FaultStack,
    Resources,
    assert_nothing_left,
    caller_headroom,
    fault_stack,
)
from tests.support.fake_philia import GREETING, HEARTBEAT_ACK, QUERY, Step

pytestmark = pytest.mark.asyncio

Arrange = Callable[[FaultStack], Awaitable[None]]


async def refused(fs: FaultStack) -> None:
    await fs.raw.refuse()
    await fs.relink()


async def no_upgrade_answer(fs: FaultStack) -> None:
    fs.raw.mode = "silent"
    await fs.relink()


async def upgrade_rejected_401(fs: FaultStack) -> None:
    fs.stack.philia.upgrade_status = 401
    await fs.relink()


def raw_mode(mode: str) -> Arrange:
    async def arrange(fs: FaultStack) -> None:
        fs.raw.mode = mode  # type: ignore[assignment]
        await fs.relink()

    return arrange


def scripted(step: Step) -> Arrange:
    async def arrange(fs: FaultStack) -> None:
        # On the live link: the fault hits a connection that was working a moment ago.
        fs.stack.philia.script(QUERY, step)

    return arrange


async def heal(fs: FaultStack) -> None:
    fs.raw.mode = "pass"
    fs.stack.philia.upgrade_status = None
    await fs.raw.listen()


FAULTS: dict[str, Arrange] = {
    "refused": refused,
    "tcp-accepted-no-upgrade-answer": no_upgrade_answer,
    "upgrade-rejected-401": upgrade_rejected_401,
    "hang-after-handshake": scripted(Step(action="hang")),
    "hang-mid-reply": raw_mode("mid_reply"),
    "close-frame-tcp-left-open": raw_mode("close_keep_tcp"),
    "eof-mid-call": raw_mode("eof"),
    "garbage-frame": scripted(Step(action="garbage")),
    "binary-frame": scripted(Step(action="garbage", garbage=b"\x00\x01")),
    "json-array-frame": scripted(Step(action="garbage", garbage="[1, 2]")),
    "reply-without-results": scripted(Step(result=None)),
    "jsonrpc-error-with-1mb-data": scripted(
        Step(error=(-32603, "handler stalled"), error_data="x" * 1_000_000)
    ),
    "oversize-reply": raw_mode("oversize"),
}


@pytest.mark.parametrize("arrange", FAULTS.values(), ids=FAULTS.keys())
async def test_fault_gives_offline_turn_then_recovers_without_leaks(
    tmp_path: Path, arrange: Arrange
) -> None:
    async with fault_stack(tmp_path) as fs:
        warm = await fs.turn()
        assert (warm.turn.status, warm.turn.memory) == (200, "enabled")
        before = Resources.now()

        await arrange(fs)
        faulty = await fs.turn()
        assert (faulty.turn.status, faulty.turn.memory) == (200, "offline")
        assert faulty.turn.content == "reply to: what tea do I like?"
        assert fs.injected() == ""
        assert faulty.elapsed < BOUND_S

        await heal(fs)
        healthy = await fs.turn()
        assert (healthy.turn.status, healthy.turn.memory) == (200, "enabled")
        assert "I prefer oolong tea" in fs.injected()
        await assert_nothing_left(before, fs.client)


async def test_frames_for_nobody_are_skipped(tmp_path: Path) -> None:
    """Greeting, heartbeat acks, replies with wrong ids and non-JSON-RPC objects."""
    async with fault_stack(tmp_path) as fs:
        await fs.turn()
        before = Resources.now()
        wrong = {"results": [{"text": "NOT YOURS", "score": 0.99, "node_type": "entity"}]}
        fs.stack.philia.script(
            QUERY,
            Step(
                before=[
                    GREETING,
                    HEARTBEAT_ACK,
                    {"jsonrpc": "2.0", "id": "someone-else", "result": wrong},
                    {"jsonrpc": "2.0", "id": 7, "result": wrong},
                    {"unrelated": True},
                ]
            ),
        )
        turn = await fs.turn()
        assert (turn.turn.status, turn.turn.memory) == (200, "enabled")
        assert "I prefer oolong tea" in fs.injected()
        assert "NOT YOURS" not in fs.injected()
        await assert_nothing_left(before, fs.client)


async def test_duplicate_reply_never_answers_the_next_call(tmp_path: Path) -> None:
    async with fault_stack(tmp_path) as fs:
        await fs.turn()
        before = Resources.now()
        upgrades = len(fs.stack.philia.upgrades)
        fs.stack.philia.script(QUERY, Step(repeat=2))
        first = await fs.turn()
        assert first.turn.memory == "enabled"

        fs.stack.philia.memories = [{"text": "I live in Lyon", "score": 0.7, "node_type": "x"}]
        second = await fs.turn("where do I live?")
        assert second.turn.memory == "enabled"
        assert "I live in Lyon" in fs.injected()
        assert "oolong" not in fs.injected()
        assert len(fs.stack.philia.upgrades) == upgrades  # one link throughout
        await assert_nothing_left(before, fs.client)


async def test_late_reply_is_dropped_and_never_answers_another_call(tmp_path: Path) -> None:
    async with fault_stack(tmp_path) as fs:
        await fs.turn()
        before = Resources.now()
        upgrades = len(fs.stack.philia.upgrades)
        answered = fs.stack.philia.answered
        late = asyncio.Event()
        late_result = {"results": [{"text": "LATE ANSWER", "score": 0.9, "node_type": "x"}]}
        # A heartbeat ack first: the link is alive, only this answer is slow.
        fs.stack.philia.script(QUERY, Step(before=[HEARTBEAT_ACK], hold=late, result=late_result))

        slow = await fs.turn()
        assert (slow.turn.memory, fs.injected()) == ("offline", "")
        assert slow.elapsed < BOUND_S

        late.set()
        await asyncio.wait_for(fs.stack.philia.wait_answered(answered + 1), 5)
        nxt = await fs.turn()
        assert nxt.turn.memory == "enabled"
        assert "I prefer oolong tea" in fs.injected()
        assert "LATE ANSWER" not in fs.injected()
        # The live link was kept for everyone else: no reconnect was needed.
        assert len(fs.stack.philia.upgrades) == upgrades
        await assert_nothing_left(before, fs.client)


async def test_flapping_philia_each_turn_tells_the_truth(tmp_path: Path) -> None:
    async with fault_stack(tmp_path) as fs:
        await fs.turn()
        before = Resources.now()
        for _ in range(3):
            fs.raw.mode = "reset"
            await fs.relink()
            down = await fs.turn()
            assert (down.turn.status, down.turn.memory) == (200, "offline")
            assert down.elapsed < BOUND_S
            fs.raw.mode = "pass"
            up = await fs.turn()
            assert (up.turn.status, up.turn.memory) == (200, "enabled")
            assert "I prefer oolong tea" in fs.injected()
        # Failures never ran consecutively, so the breaker never opened.
        assert (await fs.status())["breaker"] == "closed"
        await assert_nothing_left(before, fs.client)


@pytest.mark.timeout(120)  # three 2 s budgets waited out: 7 s, idle or loaded
async def test_breaker_opens_answers_at_once_then_one_probe_closes_it(tmp_path: Path) -> None:
    # A recall budget far above an open-breaker turn's time (about 10 ms; 50 ms on a loaded
    # 2-core box), so "did not wait for the budget" holds with a wide margin.
    async with fault_stack(
        tmp_path,
        memory_breaker_cooldown_s=30.0,
        timeout_s=OPEN_BUDGET_S,
        memory_recall_budget_ms=int(OPEN_BUDGET_S * 1000),
        **caller_headroom(int(OPEN_BUDGET_S * 1000)),
    ) as fs:
        await fs.turn()
        fs.raw.mode = "silent"
        await fs.relink()
        for _ in range(3):
            slow = await fs.turn()
            assert slow.turn.memory == "offline"
        status = await fs.status()
        assert status["breaker"] == "open"
        assert status["breaker_opened_at"] is not None
        assert any(
            e["kind"] == "error"
            and e["detail"] == "memory breaker opened after 3 consecutive failures"
            for e in status["events"]
        )

        accepted = fs.raw.accepted
        fast = [await fs.turn() for _ in range(5)]
        assert {t.turn.memory for t in fast} == {"offline"}
        assert fs.raw.accepted == accepted  # nothing touched the network
        assert max(t.elapsed for t in fast) < OPEN_BUDGET_S / 2

        fs.raw.mode = "pass"
        fs.clock.advance(31.0)
        assert (await fs.status())["breaker"] == "half_open"
        probe = await fs.turn()
        assert probe.turn.memory == "enabled"
        assert (await fs.status())["breaker"] == "closed"


OPEN_BUDGET_S = 2.0
