"""Metrics across processes and request ids in both processes' logs, with real processes.

A split deployment (the embedded store, ``serve --only grpc``, ``serve --only http``) runs
as separate ``arona-gateway`` processes on loopback. Two HTTP processes sharing one
``PROMETHEUS_MULTIPROC_DIR`` are what ``serve --workers 2`` runs: each ``/metrics`` shows
the totals of both.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

# Up to 17 s a test on a loaded 2-core box.
pytestmark = pytest.mark.timeout(240)

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
JWT_SECRET = "a-jwt-secret-for-the-observability-tests-0123456789"
MEMORY_TOKEN = "memory-token-for-the-observability-test"
API_KEY = "sk-observability-api-key-0123"
UPSTREAM_KEY = "sk-upstream-key-never-logged-4567"
GRPC_TOKEN = "grpc-bearer-token-never-logged-89"
SECRETS = (JWT_SECRET, MEMORY_TOKEN, API_KEY, UPSTREAM_KEY, GRPC_TOKEN)


@dataclass
class Proc:
    ready: str
    lines: list[str] = field(default_factory=list)


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ARONA_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update({"ARONA_DATA_DIR": str(data_dir), "ARONA_LOG_LEVEL": "info", **extra})
    return env


@asynccontextmanager
async def _process(args: list[str], env: dict[str, str], ready: str) -> AsyncIterator[Proc]:
    """Run ``arona-gateway ARGS`` until the block ends; its output lines stay in ``lines``."""
    process = await asyncio.create_subprocess_exec(
        COMMAND, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert process.stdout is not None
    proc = Proc("")
    drain: asyncio.Task[None] | None = None
    try:

        async def wait_ready() -> str:
            assert process.stdout is not None
            while True:
                raw = await process.stdout.readline()
                assert raw, f"{args} exited early:\n" + "\n".join(proc.lines)
                line = raw.decode().rstrip()
                proc.lines.append(line)
                if re.search(ready, line):
                    return line

        proc.ready = await asyncio.wait_for(wait_ready(), 60)
        drain = asyncio.create_task(_drain(process, proc.lines))
        yield proc
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
        if drain is not None:
            await drain
    assert process.returncode == 0, "\n".join(proc.lines)


async def _drain(process: asyncio.subprocess.Process, lines: list[str]) -> None:
    assert process.stdout is not None
    async for raw in process.stdout:
        lines.append(raw.decode().rstrip())


async def _store(stack: AsyncExitStack, data_dir: Path) -> str:
    proc = await stack.enter_async_context(
        _process(
            ["store", "--port", "0"],
            _env(data_dir, ARONA_MEMORY_TOKEN=MEMORY_TOKEN),
            r"embedded memory store on ws://",
        )
    )
    url = re.search(r"(ws://127\.0\.0\.1:\d+/ws)", proc.ready)
    assert url
    return url.group(1)


async def _grpc(stack: AsyncExitStack, data_dir: Path, store_url: str, **extra: str) -> Proc:
    return await stack.enter_async_context(
        _process(
            ["serve", "--only", "grpc"],
            _env(
                data_dir,
                ARONA_MEMORY_URL=store_url,
                ARONA_MEMORY_TOKEN=MEMORY_TOKEN,
                ARONA_GRPC_PORT="0",
                ARONA_GRPC_METRICS_PORT="0",
                **extra,
            ),
            r"serving on 127\.0\.0\.1:\d+",
        )
    )


async def _http(
    stack: AsyncExitStack, data_dir: Path, grpc: Proc, **extra: str
) -> tuple[str, Proc]:
    target = re.search(r"serving on (127\.0\.0\.1:\d+)", grpc.ready)
    assert target
    proc = await stack.enter_async_context(
        _process(
            ["serve", "--only", "http"],
            _env(
                data_dir,
                ARONA_GRPC_TARGET=target.group(1),
                ARONA_HTTP_PORT="0",
                ARONA_JWT_SECRET=JWT_SECRET,
                **extra,
            ),
            r"serving on http://",
        )
    )
    url = re.search(r"serving on (http://127\.0\.0\.1:\d+)", proc.ready)
    assert url
    return url.group(1), proc


def _grpc_metrics_url(grpc: Proc) -> str:
    for line in grpc.lines:
        found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", line)
        if found:
            return found.group(1)
    raise AssertionError("the gRPC service did not say where its metrics are")


def _totals(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> labels -> value."""
    totals: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            totals.setdefault(sample.name, {})[labels] = sample.value
    return totals


def _sum(totals: dict[str, Any], name: str, **labels: str) -> float:
    return sum(
        value
        for key, value in totals.get(name, {}).items()
        if all((k, v) in key for k, v in labels.items())
    )


async def _turn(client: httpx.AsyncClient, text: str, *, stream: bool = False) -> httpx.Response:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "echo", "stream": stream, "messages": [{"role": "user", "content": text}]},
    )
    assert response.status_code == 200, response.text
    return response


@pytest.mark.asyncio
async def test_two_http_processes_share_their_metrics(tmp_path: Path) -> None:
    shared = tmp_path / "prometheus"
    shared.mkdir()
    multiproc = {"PROMETHEUS_MULTIPROC_DIR": str(shared)}
    async with AsyncExitStack() as stack:
        store_url = await _store(stack, tmp_path / "store")
        # The gRPC service writes into the same directory: its metrics must stay its own.
        grpc = await _grpc(stack, tmp_path / "grpc", store_url, **multiproc)
        async with AsyncExitStack() as workers:
            first, _ = await _http(workers, tmp_path / "http", grpc, **multiproc)
            second, _ = await _http(stack, tmp_path / "http", grpc, **multiproc)
            async with (
                httpx.AsyncClient(base_url=first, timeout=30) as a,
                httpx.AsyncClient(base_url=second, timeout=30) as b,
            ):
                for i in range(2):
                    await _turn(a, f"first worker turn {i}")
                for i in range(3):
                    await _turn(b, f"second worker turn {i}", stream=True)
                for client in (a, b):
                    _check_worker_totals(_totals((await client.get("/metrics")).text))
                grpc_totals = _totals((await a.get(_grpc_metrics_url(grpc))).text)
        # The first worker has stopped: what it counted still counts.
        async with httpx.AsyncClient(base_url=second, timeout=30) as b:
            _check_worker_totals(_totals((await b.get("/metrics")).text))
    # One Philia query per turn, whatever its outcome (a first connection that a loaded machine
    # holds up past its timeout is an error, and still one call).
    assert _sum(grpc_totals, "arona_philia_calls_total", method="query") == 5
    assert _sum(grpc_totals, "arona_philia_call_seconds_count", method="query") == 5
    assert not [n for n in grpc_totals if n.startswith("arona_turn")]
    assert _sum(grpc_totals, "arona_memory_breaker_state", state="closed") == 1


def _check_worker_totals(totals: dict[str, Any]) -> None:
    assert _sum(totals, "arona_turns_total", surface="rest", outcome="ok") == 2
    assert _sum(totals, "arona_turns_total", surface="rest_stream", outcome="ok") == 3
    assert _sum(totals, "arona_turns_total") == 5
    assert _sum(totals, "arona_turn_overhead_seconds_count", surface="rest") == 2
    assert _sum(totals, "arona_turn_overhead_seconds_count", surface="rest_stream") == 3
    assert _sum(totals, "arona_recall_seconds_count") == 5
    assert _sum(totals, "arona_upstream_first_byte_seconds_count") == 5
    assert _sum(totals, "arona_upstream_attempts_total", backend="echo", outcome="answered") == 5
    assert _sum(totals, "arona_upstream_attempts_total") == 5
    assert not [n for n in totals if n.startswith(("arona_philia", "arona_outbox"))]


@pytest.mark.asyncio
async def test_a_request_id_is_in_both_processes_json_logs_and_no_secret_is(
    tmp_path: Path,
) -> None:
    logs = {"ARONA_LOG_FORMAT": "json", "ARONA_LOG_LEVEL": "debug", "ARONA_GRPC_TOKEN": GRPC_TOKEN}
    request_id = "trace-42/abc.DEF"
    async with AsyncExitStack() as stack:
        store_url = await _store(stack, tmp_path / "store")
        grpc = await _grpc(stack, tmp_path / "grpc", store_url, **logs)
        base, http = await _http(
            stack,
            tmp_path / "http",
            grpc,
            ARONA_API_KEYS=API_KEY,
            ARONA_UPSTREAM_API_KEY=UPSTREAM_KEY,
            **logs,
        )
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "echo", "messages": [{"role": "user", "content": "hello there"}]},
                headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": request_id},
            )
            assert response.status_code == 200
            assert response.headers["X-Request-Id"] == request_id
            refused = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert refused.status_code == 401
            # Another request carries another id (a line matched on "401" in its text was
            # a loop id's digits, not this request's).
            assert refused.headers["X-Request-Id"] not in ("", request_id)
    # Both processes have stopped: every line they wrote is in.
    grpc_records = _json_records(grpc.lines)
    http_records = _json_records(http.lines)
    # The service's lines about this turn: its recall and its writeback (and what happened
    # on the way, such as the first connection to Philia).
    mine = [r for r in grpc_records if r["request_id"] == request_id]
    servicer = {r["message"].split(":")[0] for r in mine if r["logger"] == "arona_grpc.servicer"}
    assert servicer == {"Recall", "Writeback"}
    mine = [r for r in http_records if r["request_id"] == request_id]
    [turn] = [r for r in mine if r["logger"] == "gateway_http.metrics"]
    assert (turn["level"], turn["message"]) == ("debug", "chat turn on rest: memory disabled, ok")
    output = "\n".join(grpc.lines + http.lines)
    for secret in SECRETS:
        assert secret not in output


def _json_records(lines: list[str]) -> list[dict[str, Any]]:
    """Every log line parsed: one JSON object each, with the documented fields."""
    records = []
    for line in lines:
        record = json.loads(line)
        assert set(record) >= {"time", "level", "logger", "message", "request_id"}, line
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"])
        records.append(record)
    assert records
    return records


@pytest.mark.asyncio
async def test_serve_workers_two_shows_every_workers_turns_on_each_scrape(tmp_path: Path) -> None:
    data_dir = tmp_path / "gateway"
    async with AsyncExitStack() as stack:
        store_url = await _store(stack, tmp_path / "store")
        proc = await stack.enter_async_context(
            _process(
                ["serve", "--workers", "2"],
                _env(
                    data_dir,
                    ARONA_MEMORY_URL=store_url,
                    ARONA_MEMORY_TOKEN=MEMORY_TOKEN,
                    ARONA_HTTP_PORT="0",
                    ARONA_GRPC_PORT="0",
                    ARONA_GRPC_METRICS_PORT="0",
                ),
                r"serving on http://\S+ \(2 HTTP workers\)",
            )
        )
        url = re.search(r"serving on (http://127\.0\.0\.1:\d+)", proc.ready)
        assert url
        turns = 12
        # A new connection per request, so the kernel hands them to either worker.
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url.group(1), timeout=30, limits=fresh) as client:
            await asyncio.gather(*(_turn(client, f"turn number {i}") for i in range(turns)))
            for _ in range(6):
                totals = _totals((await client.get("/metrics")).text)
                assert _sum(totals, "arona_turns_total", surface="rest", outcome="ok") == turns
                assert _sum(totals, "arona_recall_seconds_count") == turns
                assert not [n for n in totals if n.startswith("arona_philia")]
            grpc_totals = _totals((await client.get(_grpc_metrics_url(proc))).text)
        assert _sum(grpc_totals, "arona_philia_calls_total", method="query") == turns
        # Every process wrote its own file into the run's directory: two workers, one service.
        [run_dir] = (data_dir / "metrics").iterdir()
        per_process = {}
        for path in run_dir.glob("counter_*.db"):
            [family] = [
                f for f in MultiProcessCollector.merge([str(path)]) if f.name == "arona_turns"
            ] or [None]
            per_process[path.name] = sum(s.value for s in family.samples) if family else None
        workers = [n for n in per_process.values() if n is not None]
        assert len(workers) == 2 and sum(workers) == turns, per_process
