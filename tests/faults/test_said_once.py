"""Faults said once, clearly: what an operator reads in the log of a real ``serve``.

A client that goes away mid-body is its own doing: one INFO line, never an ERROR or a
traceback, and the next request is served. A PostgreSQL that goes away under a running
``serve --workers 2`` is one WARNING in each of its three processes, no asyncpg traceback,
what needs it answers 503 and what does not goes on; one INFO line each when it is back.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_philia import FakePhilia
from tests.support.postgres import PgCluster, pg_cluster
from tests.support.served import level_of, served

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


@pytest.fixture
def own_cluster() -> Iterator[PgCluster]:
    with pg_cluster() as cluster:
        yield cluster


async def test_a_lost_database_is_one_warning_per_process(
    tmp_path: Path, own_cluster: PgCluster
) -> None:
    url = own_cluster.create_database()
    token = "philia-token-for-the-outage"
    async with FakePhilia(token=token) as philia:
        philia.memories = [{"text": "I like oolong", "score": 0.8, "node_type": "entity"}]
        env = {"ARONA_DATABASE_URL": url, "ARONA_MEMORY_URL": philia.url}
        env["ARONA_MEMORY_TOKEN"] = token
        async with (
            served(tmp_path, "--workers", "2", env=env) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            conversation = (await client.post("/v1/conversations", json={})).json()["id"]
            in_it = {**CHAT, "conversation_id": conversation}
            assert (await client.post("/v1/chat/completions", json=in_it)).status_code == 200
            before = len(gateway.log)

            await asyncio.to_thread(own_cluster.stop, "fast")
            for _ in range(20):
                # Fresh connections: both workers meet the outage.
                async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as fresh:
                    needs_it = await fresh.post("/v1/chat/completions", json=in_it)
                    assert needs_it.status_code == 503
                    assert needs_it.json()["error"]["code"] == "database_unavailable"
                    listed = await fresh.get("/v1/conversations")
                    assert listed.status_code == 503
                    assert (await fresh.post("/v1/chat/completions", json=CHAT)).status_code == 200
            # The gRPC service's process meets it too (its outbox looks at the table every
            # 2 s): each of the three says it once.
            warnings = await gateway.wait_for("is unavailable", 3)

            await asyncio.to_thread(own_cluster.start)
            back = None
            for _ in range(20):
                async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as fresh:
                    back = await fresh.post("/v1/chat/completions", json=in_it)
            assert back is not None and back.status_code == 200
            await gateway.wait_for("answers again", 3)
    assert [level_of(line) for line in warnings] == ["WARNING"] * 3
    assert all(
        re.search(r"the database at postgresql://\S+ is unavailable \(\w+", line)
        and "what needs it answers 503 database_unavailable" in line
        for line in warnings
    ), warnings
    # From the outage to the stop: those three lines, nothing else above INFO.
    since = gateway.log[before:]
    noisy = [line for line in since if level_of(line) in ("WARNING", "ERROR", "CRITICAL")]
    assert noisy == warnings, noisy
    assert "Traceback" not in "\n".join(gateway.log)
    assert not gateway.matching("asyncpg")
