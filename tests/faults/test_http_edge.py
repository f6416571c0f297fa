"""The HTTP edge against hostile and broken clients, over the real stack's uvicorn.

Raw sockets on 127.0.0.1 send what no well-behaved client would: a header block over its
limit, a head or a body trickled a byte at a time, a connection that never sends anything.
Each is answered (431, 408) or closed within ten times its configured bound, and a request
that keeps within the limits still works, a body sent in the same packet as its head
included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.e2e.stack import ASK_TEXT, JWT_SECRET, Stack, running_stack
from tests.support.served import served

pytestmark = pytest.mark.asyncio

# The bounds the tests configure, and ten times each as the wall-clock allowance.
TIMEOUT_S = 0.5
BOUND_S = 10 * TIMEOUT_S
# How many bytes a trickling client sends at most (one every TRICKLE_S): it would go on
# well past the bound.
TRICKLE_BYTES = 400
TRICKLE_S = 0.05

JSON = {"Content-Type": "application/json"}
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": ASK_TEXT}]})


async def connect(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = urlsplit(stack.base_url)
    assert url.hostname is not None and url.port is not None
    return await asyncio.open_connection(url.hostname, url.port)


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}{extra}\r\n\r\n"
    ).encode()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := await reader.read(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def trickle(writer: asyncio.StreamWriter, byte: bytes = b"a") -> None:
    """Send one byte every TRICKLE_S, TRICKLE_BYTES at most, until the server closes."""
    for _ in range(TRICKLE_BYTES):
        try:
            writer.write(byte)
            await writer.drain()
        except (ConnectionError, OSError):
            return
        await asyncio.sleep(TRICKLE_S)


async def answered_while_trickling(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, byte: bytes = b"a"
) -> tuple[bytes, float]:
    """What the server answers while the client trickles, and how long until it closed."""
    started = time.monotonic()
    sender = asyncio.create_task(trickle(writer, byte))
    try:
        answer = await asyncio.wait_for(read_all(reader), BOUND_S * 2)
    finally:
        sender.cancel()
        writer.close()
    return answer, time.monotonic() - started


def status_and_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error: dict[str, Any] = orjson.loads(body)["error"]
    return status, error


def gateway_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith(("gateway_http", "uvicorn"))
    ]


async def test_a_header_block_over_the_limit_is_431_and_one_within_it_is_answered(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path, memory=False, http_max_header_bytes=8192) as stack:
        within = await stack.http.get("/healthz", headers={"X-Padding": "p" * 7000})
        assert within.status_code == 200
        reader, writer = await connect(stack)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Padding: " + b"p" * 200_000)
        answer = await asyncio.wait_for(read_all(reader), BOUND_S)
        writer.close()
        status, error = status_and_error(answer)
        assert status == 431
        assert error["code"] == "request_header_too_large"
        assert "8192 bytes" in error["message"]
        assert b"connection: close" in answer.lower()


async def test_a_body_arriving_with_its_head_in_one_packet_is_not_counted_as_header(
    tmp_path: Path,
) -> None:
    # 200 KB of message behind a small head: far more than the header limit in one send.
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]})
    async with running_stack(tmp_path, memory=False, http_max_header_bytes=4096) as stack:
        reader, writer = await connect(stack)
        writer.write(post_head("/v1/chat/completions", len(body), "\r\nConnection: close") + body)
        answer = await asyncio.wait_for(read_all(reader), BOUND_S)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert len(stack.upstream.chat_requests) == 1


async def test_a_trickled_head_is_408_within_its_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_stack(tmp_path, memory=False, http_header_timeout_s=TIMEOUT_S) as stack:
        reader, writer = await connect(stack)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Slow: ")
        answer, elapsed = await answered_while_trickling(reader, writer)
        status, error = status_and_error(answer)
        assert (status, error["code"]) == (408, "request_timeout")
        assert "head" in error["message"]
        assert elapsed < BOUND_S
        assert gateway_errors(caplog) == []


async def test_a_trickled_body_is_408_within_its_bound_and_never_reaches_upstream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_stack(tmp_path, memory=False, http_body_timeout_s=TIMEOUT_S) as stack:
        reader, writer = await connect(stack)
        writer.write(post_head("/v1/chat/completions", len(CHAT)) + CHAT[:10])
        answer, elapsed = await answered_while_trickling(reader, writer, b" ")
        status, error = status_and_error(answer)
        assert (status, error["code"]) == (408, "request_timeout")
        assert "body" in error["message"]
        # A REST answer like any other: it says memory did nothing.
        assert b"\r\nx-arona-memory: disabled\r\n" in answer.partition(b"\r\n\r\n")[0]
        assert elapsed < BOUND_S
        assert stack.upstream.chat_requests == []
        # The stalled request is a client's doing: no error (or traceback) in the log.
        assert gateway_errors(caplog) == []
        # The gateway goes on answering.
        healthy = await stack.http.post("/v1/chat/completions", content=CHAT, headers=JSON)
        assert healthy.status_code == 200


async def test_a_trickled_json_rpc_body_is_408(tmp_path: Path) -> None:
    async with running_stack(tmp_path, memory=False, http_body_timeout_s=TIMEOUT_S) as stack:
        reader, writer = await connect(stack)
        request = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "memory.status"})
        writer.write(post_head("/api/rpc", len(request) + 100) + request)
        answer, elapsed = await answered_while_trickling(reader, writer, b" ")
        assert status_and_error(answer)[0] == 408
        assert b"x-arona-memory" not in answer.lower()
        assert elapsed < BOUND_S


@pytest.mark.parametrize("after_a_request", [False, True])
async def test_an_idle_connection_is_closed_within_its_bound(
    tmp_path: Path, after_a_request: bool
) -> None:
    async with running_stack(tmp_path, memory=False, http_keepalive_s=TIMEOUT_S) as stack:
        reader, writer = await connect(stack)
        if after_a_request:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
            assert head.startswith(b"HTTP/1.1 200 ")
            assert b"connection: close" not in head.lower()
            await reader.readexactly(len(b'{"status":"ok"}'))
        started = time.monotonic()
        left = await asyncio.wait_for(read_all(reader), BOUND_S * 2)
        writer.close()
        assert left == b""  # closed without a word: nothing was asked
        assert time.monotonic() - started < BOUND_S


async def test_a_connection_kept_alive_serves_several_requests_within_the_limits(
    tmp_path: Path,
) -> None:
    # The head counter and the timers start again for each request on one connection.
    async with running_stack(
        tmp_path, memory=False, http_max_header_bytes=2048, http_header_timeout_s=TIMEOUT_S
    ) as stack:
        reader, writer = await connect(stack)
        for _ in range(5):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Pad: " + b"p" * 1500)
            writer.write(b"\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
            assert head.startswith(b"HTTP/1.1 200 ")
            await reader.readexactly(len(b'{"status":"ok"}'))
        writer.close()


# --- over a real `arona-gateway serve` process: what the limits spare its memory ----------------

HUGE_HEADER = 8 * 1024 * 1024
HUGE_FRAME = 15 * 1024 * 1024
CLIENTS = 4
SOCKETS = 10
# What the process may grow by, all clients together; one huge header or frame buffered
# would be more than this on its own.
GROWTH_BOUND = 6 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def warm_up(url: str) -> None:
    """Requests of each kind first, so what they allocate once is not counted as growth."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(3):
            assert (await client.get("/healthz")).status_code == 200
            chat = await client.post(
                "/v1/chat/completions", content=CHAT.replace(b'"m"', b'"echo"'), headers=JSON
            )
            assert chat.status_code == 200
    ws_url = url.replace("http://", "ws://") + "/api/rpc"
    for _ in range(3):
        async with ws_connect(ws_url, proxy=None) as ws:
            await ws.send('{"jsonrpc": "2.0", "id": 1, "method": "memory.status"}')
            assert orjson.loads(await ws.recv())["error"]["code"] == -32005


async def send_huge_header(url: str) -> bytes:
    """A request whose header block is HUGE_HEADER bytes, sent while reading the answer."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    reader, writer = await asyncio.open_connection(host, port)

    async def send() -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Huge: ")
        piece = b"h" * 65536
        try:
            for _ in range(HUGE_HEADER // len(piece)):
                writer.write(piece)
                await writer.drain()
        except (ConnectionError, OSError):
            return

    sender = asyncio.create_task(send())
    try:
        return await asyncio.wait_for(read_all(reader), 60)
    finally:
        await sender
        writer.close()


async def test_huge_headers_are_431_and_the_process_does_not_hold_them(tmp_path: Path) -> None:
    async with served(tmp_path, env={"ARONA_JWT_SECRET": JWT_SECRET}) as gateway:
        url, pid = gateway.url, gateway.process.pid
        await warm_up(url)
        before = rss_bytes(pid)
        answers = await asyncio.gather(*(send_huge_header(url) for _ in range(CLIENTS)))
        grown = rss_bytes(pid) - before
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert grown < GROWTH_BOUND, f"grew by {grown / 2**20:.1f} MiB"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/healthz")).status_code == 200


async def test_a_huge_websocket_frame_is_refused_before_auth_and_before_it_is_read(
    tmp_path: Path,
) -> None:
    frame = "f" * HUGE_FRAME
    async with served(tmp_path, env={"ARONA_JWT_SECRET": JWT_SECRET}) as gateway:
        url, pid = gateway.url, gateway.process.pid
        await warm_up(url)
        before = rss_bytes(pid)
        ws_url = url.replace("http://", "ws://") + "/api/rpc"  # no token: not authenticated

        async def one() -> int | None:
            async with ws_connect(ws_url, proxy=None, max_size=None) as ws:
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(frame)
                with contextlib.suppress(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 60)
                assert ws.close_code is not None
                return ws.close_code

        codes = await asyncio.gather(*(one() for _ in range(SOCKETS)))
        grown = rss_bytes(pid) - before
        assert codes == [1009] * SOCKETS  # message too big
        assert grown < GROWTH_BOUND, f"grew by {grown / 2**20:.1f} MiB"
