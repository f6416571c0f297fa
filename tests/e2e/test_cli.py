"""The ``arona-gateway`` command line, run as real processes.

A split deployment (store, ``serve --only grpc``, ``serve --only http``) is
three processes talking over loopback, exactly as across machines.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import jwt
import pytest

# Up to 12 s a test on a loaded 2-core box.
pytestmark = pytest.mark.timeout(180)

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
SECRET = "a-jwt-secret-for-the-cli-tests-0123456789abcdef"
TOKEN = "memory-token-for-the-split-test"


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(data_dir), ARONA_LOG_LEVEL="info", **extra)
    return env


@asynccontextmanager
async def _process(args: list[str], env: dict[str, str], ready: str) -> AsyncIterator[str]:
    """Start ``arona-gateway ARGS``; yield the first output line matching ``ready``."""
    process = await asyncio.create_subprocess_exec(
        COMMAND, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert process.stdout is not None
    seen: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:

        async def wait_ready() -> str:
            assert process.stdout is not None
            while True:
                raw = await process.stdout.readline()
                assert raw, f"{args} exited early:\n" + "\n".join(seen)
                line = raw.decode().rstrip()
                seen.append(line)
                if re.search(ready, line):
                    return line

        line = await asyncio.wait_for(wait_ready(), 60)
        # Keep draining the output so the child never blocks on a full pipe.
        drain = asyncio.create_task(_drain(process, seen))
        yield line
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
        if drain is not None:
            await drain
    output = "\n".join(seen)
    assert process.returncode == 0, output
    assert "Traceback" not in output


async def _drain(process: asyncio.subprocess.Process, seen: list[str]) -> None:
    assert process.stdout is not None
    async for raw in process.stdout:
        seen.append(raw.decode().rstrip())


@pytest.mark.asyncio
async def test_split_deployment_remembers_across_three_processes(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        store_line = await stack.enter_async_context(
            _process(
                ["store", "--port", "0"],
                _env(tmp_path / "store", ARONA_MEMORY_TOKEN=TOKEN),
                r"embedded memory store on ws://",
            )
        )
        store_url = re.search(r"(ws://127\.0\.0\.1:\d+/ws)", store_line)
        assert store_url and TOKEN not in store_line
        grpc_line = await stack.enter_async_context(
            _process(
                ["serve", "--only", "grpc"],
                _env(
                    tmp_path / "grpc",
                    ARONA_MEMORY_URL=store_url.group(1),
                    ARONA_MEMORY_TOKEN=TOKEN,
                    ARONA_GRPC_PORT="0",
                ),
                r"serving on 127\.0\.0\.1:\d+",
            )
        )
        grpc_target = re.search(r"serving on (127\.0\.0\.1:\d+)", grpc_line)
        assert grpc_target
        http_line = await stack.enter_async_context(
            _process(
                ["serve", "--only", "http"],
                _env(
                    tmp_path / "http",
                    ARONA_GRPC_TARGET=grpc_target.group(1),
                    ARONA_HTTP_PORT="0",
                    ARONA_JWT_SECRET=SECRET,
                ),
                r"serving on http://",
            )
        )
        http_url = re.search(r"serving on (http://127\.0\.0\.1:\d+)", http_line)
        assert http_url
        base = http_url.group(1)
        auth = {
            "Authorization": "Bearer "
            + jwt.encode({"sub": "ops", "exp": 2_000_000_000}, SECRET, algorithm="HS256")
        }
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            first = await client.post(
                "/v1/chat/completions",
                json={"model": "echo", "messages": [{"role": "user", "content": "I live in Lyon"}]},
            )
            assert first.status_code == 200
            for _ in range(200):  # another process: poll memory.status, bounded
                status = (
                    await client.post(
                        "/api/rpc",
                        headers=auth,
                        json={"jsonrpc": "2.0", "id": 1, "method": "memory.status"},
                    )
                ).json()["result"]
                if any(e["kind"] == "writeback" for e in status["events"]):
                    break
                await asyncio.sleep(0.05)
            second = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "echo",
                    "messages": [{"role": "user", "content": "Where do I live?"}],
                },
            )
            assert second.headers["X-Arona-Memory"] == "enabled"
            assert "User: I live in Lyon" in second.json()["choices"][0]["message"]["content"]
            ready = await client.get("/readyz")
            assert ready.status_code == 200


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_token_mints_a_jwt_for_the_configured_secret(tmp_path: Path) -> None:
    result = _run(
        ["token", "--sub", "alice", "--ttl", "120"], _env(tmp_path, ARONA_JWT_SECRET=SECRET)
    )
    assert result.returncode == 0, result.stderr
    claims = jwt.decode(result.stdout.strip(), SECRET, algorithms=["HS256"])
    assert claims["sub"] == "alice"
    assert 0 < claims["exp"] - claims["iat"] <= 120
    assert "role" not in claims


def test_token_admin_mints_an_admin_jwt(tmp_path: Path) -> None:
    result = _run(["token", "--sub", "ops", "--admin"], _env(tmp_path, ARONA_JWT_SECRET=SECRET))
    assert result.returncode == 0, result.stderr
    claims = jwt.decode(result.stdout.strip(), SECRET, algorithms=["HS256"])
    assert (claims["sub"], claims["role"]) == ("ops", "admin")


@pytest.mark.parametrize(
    ("args", "extra", "message"),
    [
        (["token", "--sub", "alice"], {}, "ARONA_JWT_SECRET is not set"),
        (["serve"], {"ARONA_JWT_SECRET": "too-short"}, "ARONA_JWT_SECRET must be at least 32"),
        (["serve"], {"ARONA_HTTP_PORT": "80x"}, "ARONA_HTTP_PORT must be a port number"),
        (["serve"], {"ARONA_MEMORY_TIMEOUT_S": "-1"}, "ARONA_MEMORY_TIMEOUT_S must be"),
        (["serve"], {"ARONA_UPSTREAM_URL": "ftp://x"}, "ARONA_UPSTREAM_URL must be"),
        (["serve"], {"ARONA_MEMORY_SCOPE": "team"}, "ARONA_MEMORY_SCOPE must be 'shared' or"),
    ],
)
def test_bad_configuration_is_one_clear_line(
    tmp_path: Path, args: list[str], extra: dict[str, str], message: str
) -> None:
    result = _run(args, _env(tmp_path, **extra))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("arona-gateway: error: ")
    assert message in lines[-1]
    assert "Traceback" not in result.stderr
    assert "too-short" not in result.stderr


def test_a_busy_port_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(["serve", "--only", "http"], _env(tmp_path, ARONA_HTTP_PORT=str(port)))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["up"], ["serve", "--only", "grpc"]])
def test_a_busy_grpc_port_is_one_line(tmp_path: Path, args: list[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = _env(tmp_path, ARONA_GRPC_PORT=str(port), ARONA_HTTP_PORT="0")
        env["ARONA_LOG_LEVEL"] = "warning"
        result = _run(args, env)
    assert result.returncode == 2
    # gRPC's own log line (its C core's, on stderr) is not printed before ours.
    assert result.stderr.strip().splitlines() == [
        f"arona-gateway: error: cannot listen for gRPC on 127.0.0.1:{port}: address already in use"
    ]


def test_forget_names_the_address_it_could_not_reach(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        result = _run(
            ["forget", "--anonymous"], _env(tmp_path, ARONA_GRPC_TARGET=f"127.0.0.1:{port}")
        )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"arona-gateway: error: cannot reach the memory service at 127.0.0.1:{port} (is "
        "`arona-gateway up` or `serve` running there? ARONA_GRPC_TARGET names it); nothing "
        "was forgotten"
    )


def test_writeback_must_be_exactly_true_or_false(tmp_path: Path) -> None:
    result = _run(
        ["token", "--sub", "a"],
        _env(tmp_path, ARONA_JWT_SECRET=SECRET, ARONA_MEMORY_WRITEBACK="yes"),
    )
    assert result.returncode == 0
    assert "ARONA_MEMORY_WRITEBACK must be exactly 'true' or 'false'" in result.stderr
