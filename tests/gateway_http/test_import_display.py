"""What ``arona-gateway import --check`` shows while it reads a file: lines checked, valid and
bad, never episodes (it stores none)."""

from __future__ import annotations

import io

from gateway_http.importing.display import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_check_on_a_terminal_counts_valid_and_bad_lines() -> None:
    out, clock = io.StringIO(), Clock()
    shown = Progress(out, 4, tty=True, checking=True, clock=clock)
    for bad in (False, True, False, False):
        clock.now += 0.5
        if bad:
            shown.say("history.jsonl:2: a line must be a JSON object")
        shown.line_done(bad=bad)
    shown.finish()
    frames = out.getvalue().split("\r\x1b[K")
    assert "history.jsonl:2: a line must be a JSON object\n" in frames
    assert frames[-1] == "checking [" + "█" * 28 + "] 4/4 lines (100%), 3 valid, 1 bad, 2 lines/s\n"
    assert "episode" not in out.getvalue()
    assert "importing" not in out.getvalue()


def test_a_check_in_a_log_prints_check_lines() -> None:
    out, clock = io.StringIO(), Clock()
    shown = Progress(out, 2, tty=False, checking=True, clock=clock)
    clock.now = 1.0
    shown.line_done(bad=True)
    clock.now = 2.0
    shown.line_done()
    assert out.getvalue().splitlines() == [
        "check: 1/2 lines (50%), 0 valid, 1 bad, 1 lines/s, 0:01 left",
        "check: 2/2 lines (100%), 1 valid, 1 bad, 1 lines/s",
    ]
