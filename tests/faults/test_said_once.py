"""Faults said once, clearly: what an operator reads in the log of a real ``serve``.

A client that goes away mid-body is its own doing: one INFO line, never an ERROR or a
traceback, and the next request is served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.faults.served import level_of, served

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello"}]}


async def send_part_of_a_body(url: str, path: str) -> None:
    """A POST that promises 1,000 body bytes, sends 9 and closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    writer.write(head.encode() + b'{"model":')
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_a_client_gone_mid_body_is_one_info_line(tmp_path: Path) -> None:
    async with served(tmp_path) as gateway:
        await send_part_of_a_body(gateway.url, "/v1/chat/completions")
        [line] = await gateway.wait_for("the request body ended")
        # More of them within the period are counted, not each said.
        for path in ("/api/rpc", "/v1/conversations", "/v1/chat/completions"):
            await send_part_of_a_body(gateway.url, path)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            reply = await client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200
    assert level_of(line) == "INFO"
    assert line.endswith(
        "POST /v1/chat/completions: the request body ended after 9 of 1000 bytes (the client "
        "went away, or sent it too slowly); the request was dropped"
    )
    assert gateway.matching("the request body ended") == [line]
    assert not [x for x in gateway.log if level_of(x) in ("ERROR", "CRITICAL")], gateway.log
    assert "Traceback" not in "\n".join(gateway.log)
