"""CircuitBreaker: opening after consecutive failures, cooldown, one half-open probe."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from arona_grpc.breaker import BreakerState, CircuitBreaker, Permit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, openings: list[str] | None = None) -> CircuitBreaker:
    return CircuitBreaker(
        3,
        5.0,
        clock=clock,
        wall_clock=lambda: datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        on_open=openings.append if openings is not None else None,
    )


def state(b: CircuitBreaker) -> BreakerState:
    # Read afresh each time: the state moves with the calls in between.
    return b.state


def fail(b: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        permit = b.admit()
        assert permit is not None
        b.failure(permit)


def test_opens_after_the_threshold_of_consecutive_failures_only() -> None:
    clock, openings = Clock(), list[str]()
    b = breaker(clock, openings)
    fail(b, 2)
    ok = b.admit()
    assert ok is not None
    b.success(ok)  # resets the count
    fail(b, 2)
    assert state(b) is BreakerState.CLOSED and b.opened_at is None
    fail(b, 1)
    assert state(b) is BreakerState.OPEN
    assert b.opened_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert openings == ["memory breaker opened after 3 consecutive failures"]
    assert b.admit() is None
    assert b.cooldown_left() == pytest.approx(5.0)


def test_after_the_cooldown_exactly_one_probe_and_its_success_closes() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    clock.now += 4.9
    assert b.admit() is None
    clock.now += 0.2
    assert state(b) is BreakerState.HALF_OPEN
    probe = b.admit()
    assert probe == Permit(probe=True)
    assert [b.admit() for _ in range(5)] == [None] * 5  # one probe at a time
    b.success(probe)
    assert state(b) is BreakerState.CLOSED
    assert b.admit() == Permit(probe=False)


def test_failed_probe_reopens_for_another_cooldown_and_is_recorded() -> None:
    clock, openings = Clock(), list[str]()
    b = breaker(clock, openings)
    fail(b, 3)
    clock.now += 5.0
    probe = b.admit()
    assert probe is not None
    b.failure(probe)
    assert state(b) is BreakerState.OPEN
    assert openings[-1] == "memory breaker re-opened: the probe call failed"
    assert len(openings) == 2
    assert b.admit() is None
    clock.now += 5.0
    assert b.admit() == Permit(probe=True)


def test_an_abandoned_probe_frees_the_slot() -> None:
    clock = Clock()
    b = breaker(clock)
    fail(b, 3)
    clock.now += 5.0
    probe = b.admit()
    assert probe is not None
    assert b.admit() is None
    b.abandon(probe)
    assert b.admit() == Permit(probe=True)


def test_late_failures_of_calls_admitted_before_the_opening_do_not_reopen() -> None:
    clock, openings = Clock(), list[str]()
    b = breaker(clock, openings)
    early = [b.admit() for _ in range(10)]
    for permit in early:
        assert permit is not None
        b.failure(permit)
    assert openings == ["memory breaker opened after 3 consecutive failures"]


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0, 5.0)
    with pytest.raises(ValueError):
        CircuitBreaker(3, 0.0)
