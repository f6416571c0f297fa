"""A run of failures logs a warning per period, not one per failure (:class:`FailureLog`),
on a clock the test moves."""

from __future__ import annotations

import logging

from arona_grpc.failure_log import FailureLog
from tests.support.log_watch import watching


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def levels_and_messages(records: list[logging.LogRecord]) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in records]


def test_a_run_of_failures_is_one_warning_per_period_and_one_line_when_it_ends() -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test.failure_log"), "Thing/Call", 30.0, clock)
    with watching("test.failure_log") as seen:
        log.succeeded()  # nothing failed: nothing to say
        for i in range(5):
            log.failed(f"call failed ({i})")
            clock.now += 1.0
        clock.now += 30.0
        log.failed("call failed (5)")
        log.failed("call failed (6)")
        log.succeeded()
        log.succeeded()
    assert levels_and_messages(seen.at_least(logging.INFO)) == [
        ("WARNING", "call failed (0)"),
        ("WARNING", "call failed (5) (4 more like it since the last warning)"),
        ("INFO", "Thing/Call answers again (1 more failure(s) since the last warning)"),
    ]
    # Nothing is lost for whoever wants every failure: the rest are debug records.
    assert [r.getMessage() for r in seen.records if r.levelno == logging.DEBUG] == [
        "call failed (1)",
        "call failed (2)",
        "call failed (3)",
        "call failed (4)",
        "call failed (6)",
    ]


def test_failures_after_a_recovery_wait_for_the_period_then_are_counted() -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test.failure_log"), "Thing/Call", 30.0, clock)
    with watching("test.failure_log") as seen:
        log.failed("down")
        log.succeeded()
        # Flapping: failing and answering by turns is no reason for a line each time.
        for _ in range(3):
            log.failed("down")
            log.succeeded()
        clock.now += 30.0
        log.failed("down again")
    assert levels_and_messages(seen.at_least(logging.INFO)) == [
        ("WARNING", "down"),
        ("INFO", "Thing/Call answers again"),
        ("WARNING", "down again (3 more like it since the last warning)"),
    ]


def test_a_callers_doing_is_said_at_its_own_level_as_rarely() -> None:
    clock = Clock()
    log = FailureLog(
        logging.getLogger("test.failure_log"), "clients", 10.0, clock, level=logging.INFO
    )
    with watching("test.failure_log") as seen:
        for _ in range(3):
            log.failed("a client went away")
        clock.now += 10.0
        log.failed("a client went away")
    assert levels_and_messages(seen.at_least(logging.INFO)) == [
        ("INFO", "a client went away"),
        ("INFO", "a client went away (2 more like it since the last line)"),
    ]
