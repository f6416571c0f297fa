"""The MCP row of the benchmark: ``search_memories`` over Streamable HTTP against a gRPC
``Recall``, at concurrency 1: ``python -m bench.mcp_search`` (or ``--parts mcp``).

Its own processes on 127.0.0.1: the embedded store (lexical ranking) preloaded with
:data:`NODES` corpus episodes, and one gateway (``arona-gateway serve``, shared scope, an API
key) whose gRPC and HTTP ports are known. From this process, one call at a time, the corpus
queries in turn:

- **gRPC Recall**: the ``MemoryService/Recall`` an internal service calls (limit 5), on one
  grpc.aio channel: what memory costs below the HTTP layer;
- **MCP search, on the wire**: ``tools/call search_memories`` as any MCP client sends it over
  Streamable HTTP, one POST with the bearer on one kept-alive connection: the gateway's MCP
  surface, its authentication, the SDK's server, and that same ``Recall`` inside;
- **MCP search, official client**: the same call through the MCP SDK's ``ClientSession`` (its
  own validation and framing included), shown for what an agent on the SDK sees.

The three run in rounds that take turns (:data:`ROUNDS`), so a noisy moment of the machine is
shared. The target: the MCP search's p50 on the wire within 1.5× the gRPC Recall's. Every
loop is bounded in calls and in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import httpx2
import orjson
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from bench import corpus, recall_bench
from bench.loadgen import percentile
from bench.procs import Proc, clean_env, free_port, wait_http

NODES = 10_000
CALLS = 2_000
QUICK_CALLS = 200
ROUNDS = 4
WARMUP = 50
# A bound on the whole measurement, whatever the machine.
MAX_S = 600.0
TARGET = 1.5
TOKEN = "bench-mcp-store-token"
KEY = "bench-mcp-key-0123456789abcdef"
SCOPE = "key:bench"
_HEADERS = {
    "Authorization": f"Bearer {KEY}",
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
}
_LEGACY = {"MCP-Protocol-Version": "2025-11-25"}
# The per-request revision: its routing headers, and its envelope in the params' _meta.
_MODERN = {
    "MCP-Protocol-Version": "2026-07-28",
    "Mcp-Method": "tools/call",
    "Mcp-Name": "search_memories",
}
_ENVELOPE = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


@dataclass(frozen=True)
class Measured:
    name: str
    calls: int
    p50_ms: float
    p99_ms: float
    failures: int


@dataclass(frozen=True)
class McpResult:
    nodes: int
    rows: tuple[Measured, ...]

    def row(self, name: str) -> Measured:
        return next(row for row in self.rows if row.name == name)

    @property
    def ratio(self) -> float:
        grpc_p50 = self.row(GRPC).p50_ms
        return self.row(WIRE).p50_ms / grpc_p50 if grpc_p50 > 0 else float("inf")


GRPC = "gRPC Recall (limit 5)"
WIRE = "MCP search_memories, one POST (2025-11-25)"
MODERN = "MCP search_memories, one POST (2026-07-28)"
SDK = "MCP search_memories, SDK ClientSession"


def _body(i: int, query: str, *, modern: bool = False) -> bytes:
    params: dict[str, object] = {"name": "search_memories", "arguments": {"query": query}}
    if modern:
        params["_meta"] = _ENVELOPE
    return orjson.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": params})


async def _measure(grpc_target: str, mcp_url: str, calls: int) -> tuple[Measured, ...]:
    queries = corpus.QUERIES
    times: dict[str, list[float]] = {GRPC: [], WIRE: [], MODERN: [], SDK: []}
    failures = dict.fromkeys(times, 0)
    async with (
        grpc.aio.insecure_channel(grpc_target) as channel,
        httpx.AsyncClient(headers=_HEADERS, timeout=30.0) as http,
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=30.0) as http2,
        streamable_http_client(mcp_url, http_client=http2) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        stub = pb_grpc.MemoryServiceStub(channel)

        async def by_grpc(i: int) -> bool:
            query = queries[i % len(queries)]
            reply = await stub.Recall(pb.RecallRequest(query=query, limit=5, scope=SCOPE))
            return reply.state == pb.MEMORY_STATE_ENABLED

        async def on_the_wire(i: int, modern: bool = False) -> bool:
            response = await http.post(
                mcp_url,
                content=_body(i, queries[i % len(queries)], modern=modern),
                headers=_MODERN if modern else _LEGACY,
            )
            answer = orjson.loads(response.content)
            return response.status_code == 200 and not answer["result"].get("isError")

        async def per_request(i: int) -> bool:
            return await on_the_wire(i, modern=True)

        async def by_sdk(i: int) -> bool:
            result = await session.call_tool(
                "search_memories", {"query": queries[i % len(queries)]}
            )
            return not result.is_error

        ways: dict[str, Callable[[int], Awaitable[bool]]] = {
            GRPC: by_grpc,
            WIRE: on_the_wire,
            MODERN: per_request,
            SDK: by_sdk,
        }
        for way in ways.values():
            for i in range(WARMUP):
                await way(i)
        started = time.monotonic()
        per_round = max(1, calls // ROUNDS)
        for round_ in range(ROUNDS):
            order = list(ways.items())
            if round_ % 2:
                order.reverse()
            for name, way in order:
                for i in range(per_round):
                    if time.monotonic() - started > MAX_S:
                        break
                    began = time.perf_counter()
                    ok = await way(round_ * per_round + i)
                    times[name].append(time.perf_counter() - began)
                    failures[name] += not ok
    return tuple(
        Measured(
            name,
            len(times[name]),
            percentile(sorted(times[name]), 0.50) * 1000,
            percentile(sorted(times[name]), 0.99) * 1000,
            failures[name],
        )
        for name in (GRPC, WIRE, MODERN, SDK)
    )


def measure(work: Path, *, quick: bool, nodes: int = NODES) -> McpResult:
    """The MCP row (module docstring) over a store of ``nodes`` episodes; ``quick``:
    :data:`QUICK_CALLS` calls each."""
    work.mkdir(parents=True, exist_ok=True)
    nodes = recall_bench.preload(work / "store" / "memory.db", nodes, "lexical")
    store_port, grpc_port, http_port = free_port(), free_port(), free_port()
    procs: list[Proc] = []
    try:
        store_env = clean_env(
            {
                "ARONA_DATA_DIR": str(work / "store"),
                "ARONA_MEMORY_TOKEN": TOKEN,
                "ARONA_STORE_RANKING": "lexical",
            }
        )
        store_argv = [sys.executable, "-m", "gateway_http.cli", "store", "--port"]
        store = Proc("mcp_store", [*store_argv, str(store_port)], work, store_env)
        procs.append(store)
        store.wait_for(r"embedded memory store on ws://", 60)
        env = clean_env(
            {
                "ARONA_DATA_DIR": str(work / "gateway"),
                "ARONA_HTTP_PORT": str(http_port),
                "ARONA_GRPC_PORT": str(grpc_port),
                "ARONA_MEMORY_URL": f"ws://127.0.0.1:{store_port}/ws",
                "ARONA_MEMORY_TOKEN": TOKEN,
                "ARONA_API_KEYS": f"bench={KEY}",
                "ARONA_LOG_LEVEL": "warning",
            }
        )
        gateway = Proc(
            "mcp_gateway", [sys.executable, "-m", "gateway_http.cli", "serve"], work, env
        )
        procs.append(gateway)
        wait_http(http_port, "/readyz", 60, gateway)
        rows = asyncio.run(
            _measure(
                f"127.0.0.1:{grpc_port}",
                f"http://127.0.0.1:{http_port}/mcp",
                QUICK_CALLS if quick else CALLS,
            )
        )
        return McpResult(nodes, rows)
    finally:
        for proc in reversed(procs):
            proc.stop()


def table_lines(result: McpResult) -> list[str]:
    grpc_p50 = result.row(GRPC).p50_ms
    lines = [
        f"{result.nodes:,} memories in the store (lexical ranking), c=1, one call at a time.",
        "",
        "| call | calls | p50 ms | p99 ms | p50 ÷ gRPC Recall | failures |",
        "|---|---|---|---|---|---|",
    ]
    for row in result.rows:
        ratio = row.p50_ms / grpc_p50 if grpc_p50 > 0 else float("inf")
        lines.append(
            f"| {row.name} | {row.calls} | {row.p50_ms:.3f} | {row.p99_ms:.3f} | "
            f"{ratio:.2f}× | {row.failures} |"
        )
    return lines


def target_row(result: McpResult) -> tuple[str, str, bool]:
    """``(target, this run, met)`` for the Targets table."""
    wire, grpc_row = result.row(WIRE), result.row(GRPC)
    return (
        f"search_memories over Streamable HTTP p50 ≤ {TARGET:.1f} × a gRPC Recall's, c=1",
        f"{result.ratio:.2f}× ({wire.p50_ms:.3f} ms vs {grpc_row.p50_ms:.3f} ms)",
        result.ratio <= TARGET and wire.failures == 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mcp_search", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CALLS} calls each")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="arona-bench-mcp-") as work:
        result = measure(Path(work), quick=args.quick)
    print("\n".join(table_lines(result)))
    name, value, met = target_row(result)
    print(f"\n{name}: {value} — {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
