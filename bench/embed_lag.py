"""How long a new memory waits for its vector: ``python -m bench.embed_lag``.

A hybrid store answers a store before it embeds the new memory (``arona_store/server.py``): its
embedding worker embeds what was stored since its last step and stores the vectors, and until
then the memory is found by its words alone. This measures that wait at the benchmark's load.

The store (``arona-gateway store``, hybrid ranking, its own process on 127.0.0.1) holds
:data:`NODES` of the benchmark's episodes with their vectors (:func:`bench.recall_bench.preload`)
and serves :data:`CONCURRENCY` clients, each doing what the gateway does for a memory turn, over
and over: a recall (the corpus questions in turn), then the store of a new episode (a
:mod:`bench.corpus` episode of another seed, numbered so that none is said twice), until
:data:`STORES` stores have been answered or :data:`SECONDS` have passed (``--quick``: fewer). A
thread of this process reads the store's database every :data:`POLL_S` for the vectors added
since its last look; a memory's lag is the time from its store's answer (as the client reads
it) to the first look that finds its vector, so up to :data:`POLL_S` more than the truth. The
first :data:`WARMUP` stores are left out. Once the load ends the run waits, at most
:data:`DRAIN_MAX_S`, for every answered store's vector.

It reports the lag's p50, p99 and max, the time a store takes to be answered, the stores and
recalls answered a second, and how many memories the model embedded a step on average (from the
store's own log line at its stop, "embedded N new memories in M steps"; a step is one hop to the
embedding thread and one write transaction, the model running once per text within it).
Target: the p99 within :data:`TARGET_S`. ``bench.run`` (``make bench``) runs it as its
``embed-lag`` part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import re
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import corpus, recall_bench
from bench.loadgen import percentile
from bench.procs import Proc, clean_env

RESULTS = Path(__file__).parent / "results" / "embed_lag.md"
NODES = 10_000
CONCURRENCY = 32
STORES = 2_000
SECONDS = 30.0
WARMUP = 100
QUICK_STORES, QUICK_SECONDS, QUICK_WARMUP = 200, 10.0, 20
POLL_S = 0.005
DRAIN_MAX_S = 60.0
TARGET_S = 1.0
TOKEN = "bench-embed-lag-token"
STEPS = re.compile(r"embedded (\d+) new memories in (\d+) steps")
# Episodes of another seed than the preloaded ones'.
SEED = corpus.SEED + 36


@dataclass(frozen=True)
class LagResult:
    nodes: int
    concurrency: int
    stores: int
    recalls: int
    elapsed_s: float
    # Seconds from each measured store's answer to its vector, in order of size.
    lags_s: list[float]
    # Seconds each measured store took to be answered (sent → answer read), in order of size.
    store_s: list[float]
    # Measured stores whose vector had not landed within DRAIN_MAX_S of the load's end.
    missing: int
    embedded: int | None
    steps: int | None

    @property
    def per_step(self) -> float | None:
        if not self.steps or self.embedded is None:
            return None
        return self.embedded / self.steps

    def lag_ms(self, q: float) -> float:
        return percentile(self.lags_s, q) * 1000

    def store_ms(self, q: float) -> float:
        return percentile(self.store_s, q) * 1000

    @property
    def met(self) -> bool:
        return self.missing == 0 and bool(self.lags_s) and self.lag_ms(0.99) <= TARGET_S * 1000


class _Landings:
    """Watches the database for new vector rows from a thread: when each node's landed."""

    def __init__(self, db: Path) -> None:
        self._db = db
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="embed-lag-watch", daemon=True)
        with contextlib.closing(sqlite3.connect(db)) as conn:
            last = conn.execute("SELECT coalesce(max(vid), 0) FROM vectors").fetchone()[0]
        self._last = int(last)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _watch(self) -> None:
        conn = sqlite3.connect(self._db, isolation_level=None)
        conn.execute("PRAGMA query_only=1")
        try:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT vid, node_id FROM vectors WHERE vid > ? ORDER BY vid", (self._last,)
                ).fetchall()
                now = time.monotonic()
                for vid, node_id in rows:
                    self.seen.setdefault(node_id, now)
                    self._last = vid
                self._stop.wait(POLL_S)
        finally:
            conn.close()


class _Client:
    """One connection to the store: JSON-RPC requests answered in order."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        request_id = next(self._ids)
        await self._ws.send(
            json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        )
        while True:
            message = json.loads(await asyncio.wait_for(self._ws.recv(), 30))
            if message.get("id") == request_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result


async def _load(
    url: str, stores: int, seconds: float
) -> tuple[list[tuple[str, float, float]], int, float]:
    """CONCURRENCY clients, each a recall then a store, until ``stores`` stores are answered
    or ``seconds`` pass; every store's (node id, answered at, seconds to its answer) in
    order, the recalls, the seconds it took."""
    from websockets.asyncio.client import connect

    texts = iter(
        f"{text} (note {i})" for i, text in enumerate(corpus.episodes(stores + CONCURRENCY, SEED))
    )
    questions = itertools.cycle(corpus.QUERIES)
    answered: list[tuple[str, float, float]] = []
    recalls = 0
    started = time.monotonic()
    deadline = started + seconds

    async def client() -> None:
        nonlocal recalls
        async with connect(f"{url}?token={TOKEN}", proxy=None, open_timeout=30) as ws:
            rpc = _Client(ws)
            await rpc.call("Sync.ConnectHandshake", {"token": TOKEN, "client_type": "bench"})
            while len(answered) < stores and time.monotonic() < deadline:
                await rpc.call("Sync.MemoryQueryRequest", {"query": next(questions), "limit": 5})
                recalls += 1
                sent = time.monotonic()
                stored = await rpc.call("Sync.MemoryStoreRequest", {"text": next(texts)})
                now = time.monotonic()
                answered.append((stored["node_id"], now, now - sent))

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return answered, recalls, time.monotonic() - started


def measure(work: Path, *, nodes: int = NODES, quick: bool = False) -> LagResult:
    """The lag at the benchmark's load (module docstring), on a store written under ``work``."""
    stores, seconds, warmup = (
        (QUICK_STORES, QUICK_SECONDS, QUICK_WARMUP) if quick else (STORES, SECONDS, WARMUP)
    )
    data = work / "embed_lag"
    db = data / "memory.db"
    count = recall_bench.preload(db, nodes, "hybrid")
    env = clean_env(
        {
            "ARONA_DATA_DIR": str(data),
            "ARONA_MEMORY_TOKEN": TOKEN,
            "ARONA_STORE_RANKING": "hybrid",
            "ARONA_LOG_LEVEL": "info",
        }
    )
    argv = [sys.executable, "-m", "gateway_http.cli", "store", "--host", "127.0.0.1", "--port", "0"]
    store = Proc("embed_lag_store", argv, work, env=env)
    try:
        url = store.wait_for(r"embedded memory store on (ws://\S+)", 60).group(1)
        landings = _Landings(db)
        landings.start()
        try:
            answered, recalls, elapsed = asyncio.run(_load(url, stores, seconds))
            measured = answered[warmup:]
            drain_until = time.monotonic() + DRAIN_MAX_S
            while time.monotonic() < drain_until and any(
                node_id not in landings.seen for node_id, _, _ in measured
            ):
                time.sleep(0.05)
        finally:
            landings.stop()
    finally:
        store.stop()
    seen = landings.seen
    lags = sorted(max(0.0, seen[node] - at) for node, at, _ in measured if node in seen)
    found = STEPS.findall(store.log.read_text(errors="replace"))
    embedded, steps = (int(found[-1][0]), int(found[-1][1])) if found else (None, None)
    return LagResult(
        nodes=count,
        concurrency=CONCURRENCY,
        stores=len(answered),
        recalls=recalls,
        elapsed_s=elapsed,
        lags_s=lags,
        store_s=sorted(took for _, _, took in measured),
        missing=sum(node not in seen for node, _, _ in measured),
        embedded=embedded,
        steps=steps,
    )


def table_lines(result: LagResult) -> list[str]:
    """The section of the report: what ran, then the figures."""
    per_step = (
        "— (the store logged no steps)"
        if result.per_step is None
        else f"{result.per_step:.1f} ({result.embedded:,} in {result.steps:,} steps)"
    )
    verdict = "met" if result.met else "**not met**"
    rows = [
        (
            "load",
            f"{result.concurrency} clients, each a recall then a store; {result.stores:,} stores"
            f" and {result.recalls:,} recalls in {result.elapsed_s:.1f} s"
            f" ({result.stores / max(result.elapsed_s, 1e-9):.0f} stores/s)",
        ),
        (
            "store answered → vector stored, p50 / p99 / max",
            f"{result.lag_ms(0.5):.0f} / {result.lag_ms(0.99):.0f} / {result.lag_ms(1.0):.0f} ms"
            f" over {len(result.lags_s):,} stores",
        ),
        (f"p99 ≤ {TARGET_S:.0f} s", verdict),
        (
            "store sent → answered, p50 / p99",
            f"{result.store_ms(0.5):.1f} / {result.store_ms(0.99):.1f} ms",
        ),
        (
            f"stores whose vector had not landed {DRAIN_MAX_S:.0f} s after the load",
            f"{result.missing}",
        ),
        ("memories embedded a step (mean)", per_step),
    ]
    return [
        f"A hybrid store of {result.nodes:,} memories ({POLL_S * 1000:.0f} ms resolution: the"
        " database is read that often for new vectors).",
        "",
        "| measure | this run |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embed_lag", description=__doc__)
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--quick", action="store_true", help="fewer stores, a shorter bound")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="arona-embed-lag-") as tmp:
        result = measure(Path(tmp), nodes=args.nodes, quick=args.quick)
    text = "\n".join(["# A new memory's wait for its vector", "", *table_lines(result)]) + "\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
