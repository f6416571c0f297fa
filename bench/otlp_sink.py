"""An OTLP/HTTP collector that takes every export and keeps nothing, run as its own process.

The benchmark's traced gateway (row 3o) exports its spans here: each ``POST`` is read whole
and answered ``200`` with an empty ``ExportTraceServiceResponse`` (zero bytes of protobuf), on
kept-alive connections, as a collector does, at the least CPU this box can spend on it (the
bodies are not decoded). Prints ``READY <port>``.
"""

from __future__ import annotations

import asyncio
from typing import cast

from bench.loop import main

_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"
_HEAD_END = b"\r\n\r\n"


class _Sink(asyncio.Protocol):
    def __init__(self) -> None:
        self._buffer = b""
        # Bytes of the current request's body still to come; None while reading its head.
        self._body_left: int | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio's, but writes the same).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            if self._body_left is None:
                end = self._buffer.find(_HEAD_END)
                if end < 0:
                    return
                head, self._buffer = self._buffer[:end], self._buffer[end + len(_HEAD_END) :]
                self._body_left = _content_length(head)
            if len(self._buffer) < self._body_left:
                self._body_left -= len(self._buffer)
                self._buffer = b""
                return
            self._buffer = self._buffer[self._body_left :]
            self._body_left = None
            assert self._transport is not None
            self._transport.write(_ANSWER)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


if __name__ == "__main__":
    main(_Sink, "an OTLP/HTTP collector that keeps nothing", backlog=128)
