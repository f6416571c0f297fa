"""Several replicas on one PostgreSQL database, as real processes.

One Philia (a scripted one that honours ``node_type_filter`` and counts every store, behind
a front that can refuse connections), one PostgreSQL database, two ``serve --only grpc`` and
two ``serve --only http``, each HTTP replica on its own gRPC replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from gateway_http.auth import mint_token
from tests.e2e.scoped import TOKEN_TTL_S
from tests.support.fake_philia import FakePhilia
from tests.support.raw_philia import RawPhilia

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
TOKEN = "replica-philia-token"
SECRET = "a-jwt-secret-for-the-replica-tests-0123456789"
# Minted at collection: valid for the whole suite however long it takes (scoped.TOKEN_TTL_S).
ALICE = mint_token(SECRET, "alice", TOKEN_TTL_S)
BOB = mint_token(SECRET, "bob", TOKEN_TTL_S)
ADMIN = mint_token(SECRET, "ops", TOKEN_TTL_S, admin=True)
OUTAGE_TURNS = 100


@dataclass
class Replica:
    name: str
    process: asyncio.subprocess.Process
    address: str
    log: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None


async def _start(name: str, args: list[str], env: dict[str, str], ready: str) -> Replica:
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    log: list[str] = []
    address = ""
    while True:
        raw = await asyncio.wait_for(process.stderr.readline(), 60)
        assert raw, f"{name} exited early:\n" + "\n".join(log)
        line = raw.decode().rstrip()
        log.append(line)
        found = re.search(r"serving on (\S+)", line)
        if found:
            address = found.group(1)
        if re.search(ready, line) and address:
            break
    replica = Replica(name, process, address, log)
    replica.drain = asyncio.create_task(_drain(process, log))
    return replica


async def _drain(process: asyncio.subprocess.Process, log: list[str]) -> None:
    assert process.stderr is not None
    async for raw in process.stderr:
        log.append(raw.decode().rstrip())


async def _stop(replica: Replica, sig: int = signal.SIGTERM) -> None:
    if replica.process.returncode is None:
        replica.process.send_signal(sig)
    await asyncio.wait_for(replica.process.wait(), 60)
    if replica.drain is not None:
        await replica.drain


@dataclass
class Cluster:
    philia: FakePhilia
    front: RawPhilia
    database_url: str
    grpc: list[Replica]
    http: list[Replica]

    async def outbox_texts(self) -> list[str]:
        conn = await asyncpg.connect(self.database_url)
        try:
            return [str(r[0]) for r in await conn.fetch("SELECT text FROM outbox ORDER BY seq")]
        finally:
            await conn.close()

    async def outbox_depth(self) -> int:
        conn = await asyncpg.connect(self.database_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM outbox"))
        finally:
            await conn.close()

    async def wait_writebacks(self, client: httpx.AsyncClient, count: int) -> None:
        """Until the gRPC replicas have recorded ``count`` stored episodes in all (another
        process: asked through memory.status, bounded)."""
        seen = 0
        for _ in range(200):
            seen = 0
            for replica in self.http:
                reply = await client.post(
                    f"{replica.address}/api/rpc",
                    headers={"Authorization": f"Bearer {ADMIN}"},
                    json={"jsonrpc": "2.0", "id": 1, "method": "memory.status"},
                )
                events = reply.json()["result"]["events"]
                seen += sum(e["kind"] == "writeback" for e in events)
            if seen >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{seen} writebacks, not {count}")

    async def down(self) -> None:
        await self.front.refuse()
        self.front.drop_all()
        await self.front.wait_all_closed()


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, database_url: str) -> AsyncIterator[Cluster]:
    async with (
        FakePhilia(token=TOKEN, filtering=True) as philia,
        RawPhilia(backend_port=philia.port) as front,
    ):
        base = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
        base.update(
            ARONA_DATABASE_URL=database_url,
            ARONA_MEMORY_URL=front.url,
            ARONA_MEMORY_TOKEN=TOKEN,
            ARONA_MEMORY_SCOPE="user",
            ARONA_JWT_SECRET=SECRET,
            ARONA_MEMORY_TIMEOUT_S="2",
            ARONA_MEMORY_BREAKER_COOLDOWN_S="0.5",
            ARONA_MEMORY_OUTBOX_CLAIM_S="2",
            ARONA_LOG_LEVEL="info",
        )
        grpc: list[Replica] = []
        http: list[Replica] = []
        try:
            for i in range(2):
                env = {**base, "ARONA_DATA_DIR": str(tmp_path / f"grpc{i}"), "ARONA_GRPC_PORT": "0"}
                grpc.append(
                    await _start(f"grpc{i}", ["serve", "--only", "grpc"], env, "serving on")
                )
            for i in range(2):
                env = {
                    **base,
                    "ARONA_DATA_DIR": str(tmp_path / f"http{i}"),
                    "ARONA_HTTP_PORT": "0",
                    "ARONA_GRPC_TARGET": grpc[i].address,
                }
                http.append(
                    await _start(
                        f"http{i}",
                        ["serve", "--only", "http"],
                        env,
                        "Application startup complete",
                    )
                )
            yield Cluster(philia, front, database_url, grpc, http)
        finally:
            for replica in [*http, *grpc]:
                await _stop(replica)
        for replica in [*http, *grpc]:
            assert "Traceback" not in "\n".join(replica.log), replica.name


async def _turn(
    client: httpx.AsyncClient, replica: Replica, token: str, text: str, **extra: Any
) -> httpx.Response:
    return await client.post(
        f"{replica.address}/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": "echo", "messages": [{"role": "user", "content": text}], **extra},
    )


async def test_replicas_share_conversations_scopes_and_the_outbox(
    tmp_path: Path, database_url: str
) -> None:
    async with cluster(tmp_path, database_url) as c, httpx.AsyncClient(timeout=30) as client:
        one, two = c.http

        # A conversation created on one HTTP replica continues on the other.
        created = await client.post(
            f"{one.address}/v1/conversations", headers={"Authorization": f"Bearer {ALICE}"}
        )
        conversation = created.json()["id"]
        first = await _turn(
            client, one, ALICE, "hello from one", conversation_id=conversation, memory=False
        )
        assert first.status_code == 200
        second = await _turn(
            client, two, ALICE, "hello from two", conversation_id=conversation, memory=False
        )
        assert second.status_code == 200
        history = await client.get(
            f"{two.address}/v1/conversations/{conversation}",
            headers={"Authorization": f"Bearer {ALICE}"},
        )
        assert [m["content"] for m in history.json()["messages"]] == [
            "hello from one",
            "Echo: hello from one",
            "hello from two",
            "Echo: hello from two",
        ]

        # Per-user scopes hold across replicas.
        assert (await _turn(client, one, ALICE, "my zebra is called Lou")).status_code == 200
        await asyncio.wait_for(c.philia.wait_stored(3), 60)
        bob = await _turn(client, two, BOB, "what is the name of my zebra?")
        assert bob.headers["x-arona-memory"] == "disabled"
        alice = await _turn(client, two, ALICE, "what is my zebra called?")
        assert alice.headers["x-arona-memory"] == "enabled"
        assert "Lou" in alice.json()["choices"][0]["message"]["content"]
        # Every writeback so far answered, so none is cut off by the outage below.
        await c.wait_writebacks(client, 5)
        before = len(c.philia.stored)
        assert before == 5, [s["text"] for s in c.philia.stored]

        # Philia down: 100 turns over both replicas, every one answered, every episode queued.
        await c.down()
        for i in range(OUTAGE_TURNS):
            response = await _turn(client, c.http[i % 2], ALICE, f"outage turn {i}")
            assert response.status_code == 200
            assert response.headers["x-arona-memory"] == "offline"
        for _ in range(200):  # the last writebacks are still on their way (bounded)
            if await c.outbox_depth() == OUTAGE_TURNS:
                break
            await asyncio.sleep(0.05)
        assert await c.outbox_depth() == OUTAGE_TURNS, Counter(await c.outbox_texts()).most_common(
            3
        )

        # Philia back, no turn arriving: the replicas drain the outbox together, each once.
        await c.front.listen()
        await asyncio.wait_for(c.philia.wait_stored(before + OUTAGE_TURNS), 120)
        for _ in range(200):
            if await c.outbox_depth() == 0:
                break
            await asyncio.sleep(0.05)
        assert await c.outbox_depth() == 0
        counts = Counter(s["text"] for s in c.philia.stored[before:])
        expected = {f"User: outage turn {i}\nAssistant: Echo: outage turn {i}" for i in range(100)}
        assert set(counts) == expected
        assert set(counts.values()) == {1}
        # Both replicas queued episodes of their own turns.
        for replica in c.grpc:
            assert any("outbox" in line for line in replica.log), replica.name

        # A gRPC replica killed while its episodes are queued: the other one stores them.
        stored = len(c.philia.stored)
        await c.down()
        for i in range(10):
            response = await _turn(client, one, ALICE, f"before the kill {i}")
            assert response.status_code == 200
        for _ in range(200):
            if await c.outbox_depth() == 10:
                break
            await asyncio.sleep(0.05)
        await _stop(c.grpc[0], signal.SIGKILL)
        await c.front.listen()
        await asyncio.wait_for(c.philia.wait_stored(stored + 10), 120)
        counts = Counter(s["text"] for s in c.philia.stored[stored:])
        assert counts == Counter(
            {
                f"User: before the kill {i}\nAssistant: Echo: before the kill {i}": 1
                for i in range(10)
            }
        )
