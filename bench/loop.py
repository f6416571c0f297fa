"""Process plumbing shared by the benchmark's own servers: uvloop when installed, and a
protocol server that prints ``READY <port>`` and runs until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def serve(
    protocol: Callable[[], asyncio.Protocol], host: str, port: int, backlog: int
) -> None:
    """Serve ``protocol`` on ``host:port`` (0 = a free port) until a stop signal."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol, host, port, backlog=backlog)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()


def main(protocol: Callable[[], asyncio.Protocol], description: str, backlog: int) -> None:
    """Command line of a benchmark server: ``--host`` and ``--port``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    run(serve(protocol, args.host, args.port, backlog))
