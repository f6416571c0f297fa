"""The load generator, run as its own process: ``python -m bench.loadgen http|recall …``.

``http`` drives one HTTP/1.1 endpoint over ``--concurrency`` keep-alive connections, each a
bare asyncio protocol with the C ``httptools`` response parser and precomputed request bytes,
so the client costs far less per turn than anything it measures (the harness checks this by
pointing it at the zero-latency upstream directly). ``recall`` calls the gRPC
``MemoryService.Recall`` the same way. Both run a warm-up first, then at most ``--turns`` turns
or ``--max-seconds`` (whichever ends first), and print one JSON object: latency percentiles,
turns/s, time to first body byte (the first streamed event), and every failure counted
(non-200, a missing or wrong ``X-Arona-Memory`` header, a broken connection).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson

from bench import responses
from bench.corpus import QUERIES
from bench.passthrough import embeddings_body
from bench.procs import cpu_ns


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    errors: int = 0
    wrong_header: int = 0
    error_samples: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)

    def summary(self, elapsed: float, capped: bool, raw: bool = False) -> dict[str, Any]:
        lat = sorted(self.latencies)
        first = sorted(self.firsts)
        samples = {"latencies_s": self.latencies, "firsts_s": self.firsts} if raw else {}
        return {
            **samples,
            "turns": len(lat) + self.errors,
            "ok": len(lat),
            "errors": self.errors,
            "wrong_header": self.wrong_header,
            "error_samples": self.error_samples,
            "elapsed_s": round(elapsed, 3),
            "capped": capped,
            "turns_per_s": round(len(lat) / elapsed, 1) if elapsed > 0 else 0.0,
            "p50_ms": round(percentile(lat, 0.50) * 1000, 3),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 3),
            "ttft_p50_ms": round(percentile(first, 0.50) * 1000, 3),
            "ttft_p99_ms": round(percentile(first, 0.99) * 1000, 3),
        }


@dataclass
class _Reply:
    status: int
    memory: str | None
    first_body: float
    done: float


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[_Reply] | None = None
        self._memory: str | None = None
        self._first = 0.0
        self._status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)
            if self._transport is not None:
                self._transport.close()

    def on_message_begin(self) -> None:
        self._memory = None
        self._first = 0.0

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-arona-memory":
            self._memory = value.decode()

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self._first:
            self._first = time.perf_counter()

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(_Reply(self._status, self._memory, self._first or now, now))

    async def request(self, payload: bytes) -> _Reply:
        if self._transport is None:
            raise ConnectionError("not connected")
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(payload)
        return await self._waiter

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def create_conversations(args: argparse.Namespace) -> list[str]:
    """``--conversations`` fresh conversations (made before the clock starts)."""
    import urllib.request

    ids = []
    for _ in range(args.conversations):
        request = urllib.request.Request(
            f"http://{args.host}:{args.port}/v1/conversations",
            data=b"{}",
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            ids.append(orjson.loads(response.read())["id"])
    return ids


def build_requests(args: argparse.Namespace) -> list[bytes]:
    """One request per query, or per query and conversation (taken in turn)."""
    requests = []
    conversations: list[str | None] = list(create_conversations(args)) or [None]
    pairs = [
        (query, conversations[i % len(conversations)])
        for i, query in enumerate(QUERIES * max(1, len(conversations) // len(QUERIES) + 1))
    ][: max(len(QUERIES), len(conversations))]
    for query, conversation in pairs:
        body: dict[str, Any] = {
            "model": args.model,
            "messages": [{"role": "user", "content": query}],
        }
        if args.body == "embeddings":
            body = embeddings_body(args.model, query)
        elif args.body == "responses":
            body = responses.request_body(args.model, query)
        if conversation is not None:
            body["conversation_id"] = conversation
        if args.stream:
            body["stream"] = True
        if args.memory_field != "omit":
            body["memory"] = args.memory_field == "true"
        raw = orjson.dumps(body)
        head = (
            f"POST {args.path} HTTP/1.1\r\nHost: {args.host}:{args.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
        )
        if args.api_key:
            head += f"Authorization: Bearer {args.api_key}\r\n"
        requests.append(head.encode() + b"\r\n" + raw)
    return requests


async def _drive_with(
    args: argparse.Namespace, one_turn: Callable[[int, int, Stats], Awaitable[None]]
) -> dict[str, Any]:
    """:func:`_drive` with the command line's numbers."""
    return await _drive(
        args.concurrency,
        args.warmup,
        args.turns,
        args.max_seconds,
        one_turn,
        args.raw,
        {
            "cpu_ns": args.cpu_pids,
            "store_cpu_ns": args.store_cpu_pids,
            "database_cpu_ns": args.database_cpu_pids,
        },
    )


async def _drive(
    concurrency: int,
    warmup: int,
    turns: int,
    max_seconds: float,
    one_turn: Callable[[int, int, Stats], Awaitable[None]],
    raw: bool = False,
    cpu_pids: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Warm up, then run up to ``turns`` turns on ``concurrency`` workers, bounded in time;
    ``raw`` adds every latency (seconds) to the summary, for pooling several runs.

    For each ``key: pids`` of ``cpu_pids`` (pids given), the summary's ``key`` is the CPU
    time those processes spent while the measured turns ran (warm-up and connecting left out;
    None without ``/proc``)."""
    measured = {key: pids for key, pids in (cpu_pids or {}).items() if pids}

    async def run(count: int, stats: Stats, deadline: float) -> bool:
        counter = itertools.count()
        capped = False

        async def worker(slot: int) -> None:
            nonlocal capped
            for i in counter:
                if i >= count:
                    return
                if time.perf_counter() > deadline:
                    capped = True
                    return
                await one_turn(slot, i, stats)

        await asyncio.gather(*(worker(slot) for slot in range(concurrency)))
        return capped

    await run(warmup, Stats(), time.perf_counter() + max_seconds)
    stats = Stats()
    cpu_before = {key: cpu_ns(pids) for key, pids in measured.items()}
    started = time.perf_counter()
    capped = await run(turns, stats, started + max_seconds)
    elapsed = time.perf_counter() - started
    cpu_after = {key: cpu_ns(pids) for key, pids in measured.items()}
    summary = stats.summary(elapsed, capped, raw)
    for key, before in cpu_before.items():
        after = cpu_after[key]
        summary[key] = after - before if before is not None and after is not None else None
    return summary


async def http_main(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    requests = build_requests(args)
    conns: list[_Connection] = []
    for _ in range(args.concurrency):
        _, conn = await loop.create_connection(_Connection, args.host, args.port)
        conns.append(conn)
    expect = None if args.expect_memory == "any" else args.expect_memory

    async def one_turn(slot: int, i: int, stats: Stats) -> None:
        conn = conns[slot]
        started = time.perf_counter()
        try:
            reply = await asyncio.wait_for(conn.request(requests[i % len(requests)]), 30.0)
        except (OSError, TimeoutError, httptools.HttpParserError) as exc:
            stats.fail(type(exc).__name__)
            # A broken connection is replaced so one failure does not end the run.
            conn.close()
            _, conns[slot] = await loop.create_connection(_Connection, args.host, args.port)
            return
        if reply.status != 200:
            stats.fail(f"HTTP {reply.status}")
            return
        if expect is not None and reply.memory != expect:
            stats.wrong_header += 1
            if len(stats.error_samples) < 5:
                stats.error_samples.append(f"X-Arona-Memory: {reply.memory}")
            return
        stats.latencies.append(reply.done - started)
        stats.firsts.append(reply.first_body - started)

    try:
        return await _drive_with(args, one_turn)
    finally:
        for conn in conns:
            conn.close()


async def recall_main(args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
    from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc

    requests = [pb.RecallRequest(query=q, limit=5) for q in QUERIES]
    async with grpc.aio.insecure_channel(args.target) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)

        async def one_turn(slot: int, i: int, stats: Stats) -> None:
            started = time.perf_counter()
            try:
                reply = await stub.Recall(requests[i % len(requests)], timeout=30.0)
            except grpc.aio.AioRpcError as exc:
                stats.fail(exc.code().name)
                return
            done = time.perf_counter()
            if reply.state != pb.MEMORY_STATE_ENABLED or not reply.memories:
                stats.wrong_header += 1
                return
            stats.latencies.append(done - started)
            stats.firsts.append(done - started)

        return await _drive_with(args, one_turn)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen")
    sub = parser.add_subparsers(dest="kind", required=True)
    for kind in ("http", "recall"):
        p = sub.add_parser(kind)
        p.add_argument("--concurrency", type=int, default=1)
        p.add_argument("--turns", type=int, default=2000)
        p.add_argument("--warmup", type=int, default=200)
        p.add_argument("--max-seconds", type=float, default=60.0)
        p.add_argument("--raw", action="store_true", help="include every latency")
        p.add_argument(
            "--cpu-pids",
            type=lambda text: [int(pid) for pid in text.split(",") if pid],
            default=[],
            help="comma-separated pids whose CPU time over the measured turns to report",
        )
        p.add_argument(
            "--store-cpu-pids",
            type=lambda text: [int(pid) for pid in text.split(",") if pid],
            default=[],
            help="the same for the memory store's processes (reported as store_cpu_ns)",
        )
        p.add_argument(
            "--database-cpu-pids",
            type=lambda text: [int(pid) for pid in text.split(",") if pid],
            default=[],
            help="the same for the store's database server (reported as database_cpu_ns)",
        )
    http = sub.choices["http"]
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, required=True)
    http.add_argument("--path", default="/v1/chat/completions")
    http.add_argument("--model", default="bench-model")
    http.add_argument("--stream", action="store_true")
    http.add_argument(
        "--body",
        choices=("chat", "embeddings", "responses"),
        default="chat",
        help="what each request asks: a chat turn, an embedding of the same text, or a "
        "Responses turn",
    )
    http.add_argument("--memory-field", choices=("true", "false", "omit"), default="omit")
    http.add_argument(
        "--expect-memory", choices=("enabled", "disabled", "offline", "any"), default="any"
    )
    http.add_argument("--api-key", default="")
    http.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="send each turn with a conversation_id, taking this many conversations in turn",
    )
    recall = sub.choices["recall"]
    recall.add_argument("--target", required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from bench.loop import run

    args = _parser().parse_args(argv)
    result = run(http_main(args) if args.kind == "http" else recall_main(args))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
