"""A blackholed Philia for the benchmarks, run as its own process.

It accepts TCP connections and reads whatever arrives but never answers, like a memory
service whose host stopped responding: the WebSocket upgrade never completes, so every recall
waits out its deadline until the gateway's circuit breaker opens. Prints ``READY <port>``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal


class _Silent(asyncio.Protocol):
    def data_received(self, data: bytes) -> None:
        pass


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Silent, host, port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="a Philia that never answers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
