"""A file that cannot be written is said once per fault (:class:`StorageFaults`), on a clock
the test moves, and its fault ends with the first write that works again."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from arona_common.storage import StorageFaults
from tests.support.log_watch import watching

FULL = OSError(28, "No space left on device")
COST = "episodes are lost"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def said(seen: list[logging.LogRecord]) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in seen if r.levelno >= logging.INFO]


def test_a_fault_is_one_error_then_one_a_period_then_one_line_when_it_ends() -> None:
    clock = Clock()
    storage = StorageFaults(60.0, clock, wall=lambda: 1_700_000_000.0)
    with watching("arona_common.storage") as seen:
        assert storage.failed("outbox", "/data/outbox.db", FULL, COST)
        for _ in range(99):
            clock.now += 0.1
            assert not storage.failed("outbox", "/data/outbox.db", FULL, COST)
        [fault] = storage.current()
        assert (fault.part, fault.where, fault.reason, fault.failed_writes) == (
            "outbox",
            "outbox.db",
            "No space left on device",
            100,
        )
        clock.now += 60.0
        storage.failed("outbox", "/data/outbox.db", sqlite3.OperationalError("disk I/O"), COST)
        storage.succeeded("outbox")
        storage.succeeded("outbox")
    assert said(seen.records) == [
        ("ERROR", "cannot write the outbox (/data/outbox.db): No space left on device; " + COST),
        (
            "ERROR",
            "still cannot write the outbox (/data/outbox.db): disk I/O (100 failed writes since "
            "the last line); " + COST,
        ),
        ("INFO", "the outbox (/data/outbox.db) can be written again (101 writes had failed)"),
    ]
    assert storage.current() == ()


def test_a_fault_that_comes_back_within_the_period_is_not_said_again() -> None:
    clock = Clock()
    storage = StorageFaults(60.0, clock)
    with watching("arona_common.storage") as seen:
        storage.failed("journal", "/data/journal.log", FULL, COST)
        storage.succeeded("journal")
        for _ in range(5):  # flapping
            clock.now += 1.0
            assert not storage.failed("journal", "/data/journal.log", FULL, COST)
            storage.succeeded("journal")
        clock.now += 60.0
        assert storage.failed("journal", "/data/journal.log", FULL, COST)
    assert [level for level, _ in said(seen.records)] == ["ERROR", "INFO", "ERROR"]


def test_recheck_ends_a_fault_once_its_directory_takes_a_file(tmp_path: Path) -> None:
    clock = Clock()
    storage = StorageFaults(60.0, clock)
    gone = tmp_path / "gone"  # the directory is missing: no test file can be written there
    storage.failed("outbox", str(gone / "outbox.db"), FULL, COST)
    storage.failed("outbox table", "table outbox at postgresql://db", FULL, COST)
    clock.now += 5.0
    storage.recheck()
    assert [f.part for f in storage.current()] == ["outbox", "outbox table"]
    gone.mkdir()
    clock.now += 1.0
    storage.recheck()  # tried again at most every 5 s
    assert storage.failing("outbox")
    clock.now += 5.0
    storage.recheck()
    # Only files on disk are tried; nothing is left behind in the directory.
    assert [f.part for f in storage.current()] == ["outbox table"]
    assert list(gone.iterdir()) == []
