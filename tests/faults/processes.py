"""Real processes for the fault suite: the embedded store and the gateway, killed at will.

:class:`Store` runs ``arona-gateway store`` on a fixed port of 127.0.0.1 (so a restarted store
is found where the gateway looks), :class:`Gateway` runs ``arona-gateway serve`` (gRPC service
and HTTP layer in one process, the echo model upstream) pointed at it. Each writes its log to a
file of the test's directory; both can be SIGKILLed and started again on the same data
directory. :func:`stored_user_texts` counts on the store itself: it reads the store's SQLite
file. :class:`Load` (:class:`bench.paced.PacedTurns`, which the benchmark's outage row uses too)
drives chat turns at a steady rate from a fixed number of clients, bounded in count and time,
and keeps the text of every turn that was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.paced import PacedTurns as Load
from bench.paced import stored_user_texts

__all__ = ["Gateway", "Load", "Store", "running", "stored_user_texts", "wait_stored"]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
TOKEN = "outage-token-of-24-chars"
STORE_DB = "memory.db"
# A child comes up in about a second on an idle 2-core box; a loaded one gets sixty.
START_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(extra)
    return env


def _new_log(logs: Path, name: str) -> Path:
    """``<logs>/<name>-<n>.log`` for the first ``n`` not taken (each start has its own)."""
    logs.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        log = logs / f"{name}-{n}.log"
        if not log.exists():
            return log
    raise AssertionError("unreachable")


class Child:
    """One child process, its output in ``<logs>/<name>-<n>.log``."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    @classmethod
    async def start(cls, name: str, argv: list[str], env: Mapping[str, str], logs: Path) -> Child:
        log = _new_log(logs, name)
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *argv, env=dict(env), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
            )
        return cls(name, process, log)

    async def wait_for(self, pattern: str) -> re.Match[str]:
        """The first match of ``pattern`` in the log (another process's output: read again
        every 50 ms, for at most :data:`START_S`)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            found = regex.search(self.log.read_text(errors="replace"))
            if found:
                return found
            if self.process.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 0.05)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        raise AssertionError(f"{self.name} did not come up ({pattern!r}):\n{tail}")

    async def kill(self) -> None:
        """SIGKILL: no shutdown of any kind."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        await self.process.wait()

    async def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not ended within :data:`START_S`."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), START_S)
            except TimeoutError:
                await self.kill()


class _Part:
    """A part of the deployment, run as a :class:`Child` once started."""

    child: Child | None

    async def kill(self) -> None:
        """SIGKILL the running part."""
        assert self.child is not None
        await self.child.kill()

    async def stop(self) -> None:
        if self.child is not None:
            await self.child.stop()


@dataclass
class Store(_Part):
    """The embedded store on a fixed port, its database in ``data_dir`` (or in PostgreSQL at
    ``database_url``)."""

    data_dir: Path
    logs: Path
    port: int = field(default_factory=free_port)
    child: Child | None = None
    database_url: str | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def db(self) -> Path:
        return self.data_dir / STORE_DB

    async def start(self) -> None:
        env = _env(
            {
                "ARONA_DATA_DIR": str(self.data_dir),
                "ARONA_MEMORY_TOKEN": TOKEN,
                "ARONA_STORE_RANKING": "lexical",
                "ARONA_LOG_LEVEL": "info",
                **({"ARONA_STORE_DATABASE_URL": self.database_url} if self.database_url else {}),
            }
        )
        argv = [COMMAND, "store", "--host", "127.0.0.1", "--port", str(self.port)]
        self.child = await Child.start("store", argv, env, self.logs)
        await self.child.wait_for(r"embedded memory store on ws://")


@dataclass
class Gateway(_Part):
    """``arona-gateway serve`` on ``data_dir``, its memory the :class:`Store` at ``memory_url``."""

    data_dir: Path
    logs: Path
    memory_url: str
    env: dict[str, str] = field(default_factory=dict)
    grpc_port: int = field(default_factory=free_port)
    child: Child | None = None
    url: str = ""

    async def start(self) -> None:
        env = _env(
            {
                "ARONA_DATA_DIR": str(self.data_dir),
                "ARONA_HTTP_PORT": "0",
                "ARONA_GRPC_PORT": str(self.grpc_port),
                "ARONA_MEMORY_URL": self.memory_url,
                "ARONA_MEMORY_TOKEN": TOKEN,
                "ARONA_LOG_LEVEL": "info",
                **self.env,
            }
        )
        self.child = await Child.start("gateway", [COMMAND, "serve"], env, self.logs)
        found = await self.child.wait_for(r"serving on (http://[^\s,]+)")
        await self.child.wait_for(r"Application startup complete")
        self.url = found.group(1)

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        """The unlabelled samples and the breaker state of ``/metrics``."""
        text = (await client.get(f"{self.url}/metrics")).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            found = re.match(r'^(\w+)(\{state="(\w+)"\})? (\S+)$', line)
            if found:
                name = found.group(1) + (f":{found.group(3)}" if found.group(3) else "")
                samples[name] = float(found.group(4))
        return samples


async def wait_stored(db: Path, wanted: set[str], within_s: float) -> set[str]:
    """The wanted user texts still missing from the store once all are there, or when
    ``within_s`` has passed (the store is another process: its file is read every 0.5 s)."""
    deadline = time.monotonic() + within_s
    while True:
        missing = wanted - await asyncio.to_thread(stored_user_texts, db)
        if not missing or time.monotonic() >= deadline:
            return missing
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def running(tmp_path: Path) -> AsyncIterator[tuple[Store, Gateway]]:
    """A store and a gateway using it, each with its own data directory under ``tmp_path``."""
    store = Store(tmp_path / "store", tmp_path / "logs")
    gateway = Gateway(tmp_path / "gateway", tmp_path / "logs", store.url)
    try:
        await store.start()
        await gateway.start()
        yield store, gateway
    finally:
        await gateway.stop()
        await store.stop()
