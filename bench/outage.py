"""The store-outage row of the benchmark: chat turns while the memory store is down, and after.

Its own processes on 127.0.0.1: the embedded store (lexical ranking) on a fixed port and one
gateway (``arona-gateway serve``, the echo model). Chat turns arrive at :data:`RATE` a second
(``--quick``: :data:`QUICK_RATE`) from :data:`CONCURRENCY` clients (paced, so the arrival rate
is known) while the store is killed
with SIGKILL for :data:`OUTAGE_S` and started again on the same database. ``/metrics`` is
read every :data:`SAMPLE_S` for the outbox's depth, bytes and replayed episodes; at the end
every answered turn is looked for in the store's own database file.

It reports the turns answered a second during the outage, while the outbox replays and once it
is empty, the outbox's peak
(episodes and bytes), how fast the replay stored the backlog once it began, as a multiple of
the rate episodes arrived during the outage (the turns answered a second then), and the
answered turns the store never got (must be 0). Every loop is bounded in turns and in seconds.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.paced import PacedTurns, stored_user_texts
from bench.procs import Proc, clean_env, free_port

# What a full run offers: under what two cores serve with memory on once the store is back
# (the lexical store with its context index: about 180 memory turns a second at 10,000
# memories, fewer as the outage's backlog grows the store), or the outbox never empties and
# the replay is not measured (200 a second, before 2026-12-02 11:00, no longer emptied it).
RATE = 100.0
CONCURRENCY = 16
OUTAGE_S = 60.0
BEFORE_S = 5.0
AFTER_S = 20.0
# --quick: the same steps, short, and at a rate any machine serves with memory on (200 memory
# turns a second on a loaded 2-core machine can be more than it serves once the store is back,
# and then the outbox never empties: the quick run checks the steps, not the machine).
QUICK_OUTAGE_S, QUICK_BEFORE_S, QUICK_AFTER_S = 5.0, 2.0, 5.0
QUICK_RATE = 40.0
SAMPLE_S = 0.1
# The outbox drains in seconds; the store gets every answered turn within this (bounds).
DRAIN_MAX_S = 300.0
STORED_MAX_S = 120.0
TOKEN = "bench-outage-token"


@dataclass
class OutageResult:
    rate: float
    outage_s: float
    answered: int
    failed: int
    during_turns_per_s: float
    # While the outbox replayed (from the store's return until it was empty), and after.
    replaying_turns_per_s: float | None
    after_turns_per_s: float
    peak_depth: int
    peak_bytes: int
    # From the store's return to an empty outbox (the breaker's cooldown included), and the
    # episodes the replay stored a second from its first to its last.
    drain_s: float | None
    replay_per_s: float | None
    lost: int

    @property
    def replay_multiple(self) -> float | None:
        """The replay rate as a multiple of the rate episodes arrived during the outage (the
        turns answered a second then: each answered turn is an episode to keep)."""
        if self.replay_per_s is None or self.during_turns_per_s <= 0:
            return None
        return self.replay_per_s / self.during_turns_per_s


def _per_s(load: PacedTurns, start: float, end: float) -> float:
    """Turns answered a second from ``start`` to ``end``."""
    return load.answered_between(start, end) / max(end - start, 1e-9)


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        found = re.match(r"^(arona_outbox_\w+) (\S+)$", line)
        if found:
            samples[found.group(1)] = float(found.group(2))
    return samples


def _start_store(work: Path, port: int, name: str) -> Proc:
    # The lexical ranking: this row measures the outbox, not the store's intake. With the
    # hybrid one every stored episode is embedded first, and on a 2-core box that bounds any
    # writeback, replayed or not (bench/README.md has the figure).
    env = clean_env(
        {
            "ARONA_DATA_DIR": str(work / "store"),
            "ARONA_MEMORY_TOKEN": TOKEN,
            "ARONA_STORE_RANKING": "lexical",
        }
    )
    argv = [sys.executable, "-m", "gateway_http.cli", "store", "--port", str(port)]
    store = Proc(name, argv, work, env=env)
    store.wait_for(r"embedded memory store on ws://", 60)
    return store


def measure(work: Path, *, quick: bool) -> OutageResult:
    """The store-outage row (module docstring); ``quick``: a 5 s outage."""
    outage_s, before_s, after_s = (
        (QUICK_OUTAGE_S, QUICK_BEFORE_S, QUICK_AFTER_S) if quick else (OUTAGE_S, BEFORE_S, AFTER_S)
    )
    rate = QUICK_RATE if quick else RATE
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[Proc] = []
    stop_turns: Callable[[], None] | None = None
    try:
        store = _start_store(work, port, "outage_store")
        procs.append(store)
        env = clean_env(
            {
                "ARONA_DATA_DIR": str(work / "gateway"),
                "ARONA_HTTP_PORT": "0",
                "ARONA_GRPC_PORT": "0",
                "ARONA_MEMORY_URL": f"ws://127.0.0.1:{port}/ws",
                "ARONA_MEMORY_TOKEN": TOKEN,
                "ARONA_LOG_LEVEL": "info",
            }
        )
        serve = [sys.executable, "-m", "gateway_http.cli", "serve"]
        gateway = Proc("outage_gateway", serve, work, env)
        procs.append(gateway)
        url = gateway.wait_for(r"serving on (http://[^\s,]+)", 60).group(1)
        gateway.wait_for(r"Application startup complete", 60)

        total_s = before_s + outage_s + after_s + DRAIN_MAX_S
        load = PacedTurns(rate, CONCURRENCY, int(rate * total_s), prefix="outage")
        load.point_at(url)
        stop_turns = load.start_thread()
        time.sleep(before_s)

        store.popen.kill()
        store.popen.wait(30)
        down = time.monotonic()
        peak_depth = peak_bytes = 0.0
        while time.monotonic() - down < outage_s:
            sample = _metrics(url)
            peak_depth = max(peak_depth, sample.get("arona_outbox_depth", 0.0))
            peak_bytes = max(peak_bytes, sample.get("arona_outbox_bytes", 0.0))
            time.sleep(SAMPLE_S)
        up_again = time.monotonic()
        during = _per_s(load, down, up_again)
        # Counted before the store is back: nothing can have been replayed yet. (Read after
        # its start, a replay that began at once, or even ended, before that first sample
        # was never seen.)
        replayed_before = _metrics(url).get("arona_outbox_replayed_total", 0.0)
        procs.append(_start_store(work, port, "outage_store_again"))
        back = time.monotonic()

        # The replay: from the last sample before its first stored episode (at the latest
        # the store's return) until the outbox is empty.
        first: tuple[float, float] | None = None
        drained: tuple[float, float] | None = None
        last_before = back
        while time.monotonic() - back < DRAIN_MAX_S:
            sample = _metrics(url)
            now = time.monotonic()
            replayed = sample.get("arona_outbox_replayed_total", 0.0)
            peak_depth = max(peak_depth, sample.get("arona_outbox_depth", 0.0))
            peak_bytes = max(peak_bytes, sample.get("arona_outbox_bytes", 0.0))
            if first is None:
                if replayed > replayed_before:
                    first = (last_before, replayed_before)
                else:
                    last_before = now
            if first is not None and sample.get("arona_outbox_depth", 0.0) == 0:
                drained = (now, replayed)
                break
            time.sleep(SAMPLE_S)
        settled = drained[0] if drained is not None else time.monotonic()
        replaying = _per_s(load, back, settled) if drained is not None else None
        time.sleep(after_s)
        after = _per_s(load, settled, time.monotonic())
        stop_turns()
        stop_turns = None

        answered = load.words
        db = work / "store" / "memory.db"
        deadline = time.monotonic() + STORED_MAX_S
        missing = answered - stored_user_texts(db)
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)
            missing = answered - stored_user_texts(db)

        replay_per_s = drain_s = None
        if drained is not None and first is not None:
            drain_s = drained[0] - back
            replay_per_s = (drained[1] - first[1]) / max(drained[0] - first[0], SAMPLE_S)
        return OutageResult(
            rate=rate,
            outage_s=outage_s,
            answered=len(answered),
            failed=load.failed,
            during_turns_per_s=during,
            replaying_turns_per_s=replaying,
            after_turns_per_s=after,
            peak_depth=int(peak_depth),
            peak_bytes=int(peak_bytes),
            drain_s=drain_s,
            replay_per_s=replay_per_s,
            lost=len(missing),
        )
    finally:
        if stop_turns is not None:
            stop_turns()
        for proc in reversed(procs):
            proc.stop()


def table_lines(result: OutageResult) -> list[str]:
    """The outage section of the report."""
    multiple = result.replay_multiple
    rows = [
        ("turns offered", f"{result.rate:.0f}/s from {CONCURRENCY} clients"),
        ("store down (SIGKILL), then started again", f"{result.outage_s:.0f} s"),
        ("turns answered a second while it was down", f"{result.during_turns_per_s:.0f}"),
        (
            "turns answered a second while the outbox replayed",
            "—" if result.replaying_turns_per_s is None else f"{result.replaying_turns_per_s:.0f}",
        ),
        ("turns answered a second after the outbox was empty", f"{result.after_turns_per_s:.0f}"),
        (
            "outbox at its peak",
            f"{result.peak_depth:,} episodes, {result.peak_bytes / 2**20:.2f} MiB",
        ),
        (
            "outbox empty after the store came back",
            "not within the bound" if result.drain_s is None else f"{result.drain_s:.1f} s",
        ),
        (
            "replay rate (episodes stored a second, first to last)",
            "—"
            if result.replay_per_s is None or multiple is None
            else f"{result.replay_per_s:,.0f}/s = {multiple:.1f}× the rate episodes arrived",
        ),
        (
            "answered turns the store never got (must be 0)",
            f"{result.lost} of {result.answered:,}" + (" — met" if result.lost == 0 else ""),
        ),
    ]
    lines = ["| measure | this run |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += [
        "",
        "The replay time includes the breaker's cooldown (5 s by default) before its probe; "
        f"{result.failed} turns failed (non-200 or connection errors).",
    ]
    return lines
