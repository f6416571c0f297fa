"""Durable before answered: a gateway killed hard right after answering loses no episode.

The gateway runs as a real process (``arona-gateway serve``); Philia (a scripted fake in
this test's process) is slow to confirm stores, so the answered turns' episodes are still in
flight when the process is killed with SIGKILL. Started again on the same data directory,
the gateway sends them from its journal.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.fake_philia import STORE, FakePhilia, Step

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
TOKEN = "hard-kill-token"
TURNS = 20


async def start(data_dir: Path, philia: FakePhilia) -> tuple[asyncio.subprocess.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(
        ARONA_DATA_DIR=str(data_dir),
        ARONA_HTTP_PORT="0",
        ARONA_GRPC_PORT="0",
        ARONA_MEMORY_URL=philia.url,
        ARONA_MEMORY_TOKEN=TOKEN,
        # Longer than the test: a store still unconfirmed at the kill stays in flight.
        ARONA_MEMORY_TIMEOUT_S="120",
        ARONA_LOG_LEVEL="info",
    )
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "serve",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    url = None
    while True:
        raw = await asyncio.wait_for(process.stderr.readline(), 60)
        assert raw, "the gateway exited before it served"
        line = raw.decode()
        found = re.search(r"serving on (http://\S+?),? ", line + " ")
        if found:
            url = found.group(1)
        if "Application startup complete" in line and url:
            break
    asyncio.ensure_future(_drain(process))
    return process, url


async def _drain(process: asyncio.subprocess.Process) -> None:
    assert process.stderr is not None
    async for _ in process.stderr:
        pass


async def test_answered_turns_survive_a_sigkill(tmp_path: Path) -> None:
    async with FakePhilia(token=TOKEN) as philia:
        never = asyncio.Event()  # stores are never confirmed before the kill
        philia.script(STORE, *(Step(hold=never) for _ in range(TURNS)))
        process, url = await start(tmp_path, philia)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for i in range(TURNS):
                    response = await client.post(
                        "/v1/chat/completions",
                        json={
                            "model": "echo",
                            "messages": [{"role": "user", "content": f"fact {i}"}],
                        },
                    )
                    assert response.status_code == 200
            # Every answered turn's store reached Philia, and none was confirmed.
            await asyncio.wait_for(philia.wait_frames(STORE, TURNS), 30)
            assert philia.stored == []
        finally:
            process.send_signal(signal.SIGKILL)
            await process.wait()
        assert process.returncode == -signal.SIGKILL

        process, url = await start(tmp_path, philia)
        try:
            await asyncio.wait_for(philia.wait_stored(TURNS), 60)
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)
        stored = sorted(s["text"] for s in philia.stored)
        assert stored == sorted(f"User: fact {i}\nAssistant: Echo: fact {i}" for i in range(TURNS))
