"""A blackholed Philia for the benchmarks, run as its own process.

It accepts TCP connections and reads whatever arrives but never answers, like a memory
service whose host stopped responding: the WebSocket upgrade never completes, so every recall
waits out its deadline until the gateway's circuit breaker opens. Prints ``READY <port>``.
"""

from __future__ import annotations

import asyncio

from bench.loop import main


class _Silent(asyncio.Protocol):
    def data_received(self, data: bytes) -> None:
        pass


if __name__ == "__main__":
    main(_Silent, "a Philia that never answers", backlog=1024)
