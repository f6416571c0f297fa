"""A raw TCP front for Philia on ``127.0.0.1`` port 0: faults a WebSocket server cannot script.

:class:`RawPhilia` listens on its own port and, per connection, does what its
:attr:`~RawPhilia.mode` says at the moment the connection arrives:

- ``"pass"``: pipe bytes both ways to a real server (normally :class:`FakePhilia`);
- ``"reset"``: accept, then reset the TCP connection at once (Philia down);
- ``"silent"``: accept the TCP connection and never answer the upgrade (blackholed);
- ``"mid_reply"``, ``"close_keep_tcp"``, ``"eof"``, ``"oversize"``: answer the upgrade
  and the ``Sync.ConnectHandshake`` itself (minimal RFC 6455 framing), then on the
  next request send half a frame and hang / send a close frame and keep the TCP
  connection open / close the TCP connection without a close frame / answer with a
  frame of :data:`OVERSIZE_BYTES`.

:meth:`RawPhilia.refuse` closes the listener (connections are refused) and
:meth:`RawPhilia.listen` opens it again on the same port. :meth:`RawPhilia.drop_all`
aborts every open connection, so a mode change applies to the next link at once.
Tests await :meth:`RawPhilia.wait_all_closed` and :meth:`RawPhilia.wait_requests`
instead of sleeping.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import socket
import struct
import types
from typing import Any, Literal

Mode = Literal["pass", "reset", "silent", "mid_reply", "close_keep_tcp", "eof", "oversize"]

OVERSIZE_BYTES = 3 * 2**20
_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_MAX_HEADER = 16 * 1024


class RawPhilia:
    """See the module docstring. Start with ``async with`` or :meth:`start`/:meth:`stop`."""

    def __init__(self, backend_port: int | None = None, path: str = "/ws") -> None:
        self.backend_port = backend_port
        self.path = path
        self.mode: Mode = "pass"
        self.port = 0
        self.accepted = 0
        # Requests (method names) seen by the raw WebSocket modes.
        self.requests: list[str] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Condition()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{self.path}"

    @property
    def open_connections(self) -> int:
        return len(self._writers)

    async def start(self) -> RawPhilia:
        await self.listen()
        return self

    async def listen(self) -> None:
        """Accept connections (again) on :attr:`port` (0 the first time: a free port)."""
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        """Close the listener: new connections are refused until :meth:`listen`."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    def drop_all(self) -> None:
        """Abort every open connection (both sides of piped ones)."""
        for writer in list(self._writers):
            writer.transport.abort()

    async def wait_all_closed(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._writers)

    async def wait_requests(self, count: int) -> list[str]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.requests) >= count)
        return list(self.requests)

    async def stop(self) -> None:
        await self.refuse()
        self.drop_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> RawPhilia:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.stop()

    # --- connections -----------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        await self._opened(writer)
        mode = self.mode
        try:
            if mode == "reset":
                _reset(writer)
            elif mode == "pass":
                await self._pipe(reader, writer)
            elif mode == "silent":
                await _drain_until_eof(reader)
            else:
                await self._websocket(mode, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.transport.abort()
            await self._closed(writer)
            self._tasks.discard(task)

    async def _opened(self, writer: asyncio.StreamWriter) -> None:
        async with self._changed:
            self.accepted += 1
            self._writers.add(writer)
            self._changed.notify_all()

    async def _closed(self, writer: asyncio.StreamWriter) -> None:
        async with self._changed:
            self._writers.discard(writer)
            self._changed.notify_all()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.backend_port is not None, "pass mode needs a backend"
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        await self._opened(up_writer)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_copy(reader, up_writer))
                group.create_task(_copy(up_reader, writer))
        except* (ConnectionError, OSError):
            pass
        finally:
            up_writer.transport.abort()
            await self._closed(up_writer)

    async def _websocket(
        self, mode: Mode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await _upgrade(reader, writer)
        while True:
            opcode, payload = await _read_frame(reader)
            if opcode == 0x8:
                continue  # the client's close: never answered, TCP stays open
            if opcode != 0x1:
                continue
            request = json.loads(payload)
            method = str(request.get("method"))
            async with self._changed:
                self.requests.append(method)
                self._changed.notify_all()
            if method == "Sync.ConnectHandshake":
                result = {"ok": True, "error": None, "session_id": "s-raw", "reconnect": False}
                await _send_text(writer, {"jsonrpc": "2.0", "id": request["id"], "result": result})
                continue
            if mode == "mid_reply":
                # A frame header announcing 1000 bytes, then only 10 of them.
                writer.write(bytes([0x81, 126]) + struct.pack("!H", 1000) + b'{"jsonrpc"')
                await writer.drain()
                await _drain_until_eof(reader)
                return
            if mode == "close_keep_tcp":
                writer.write(_frame(0x8, struct.pack("!H", 4000) + b"bye"))
                await writer.drain()
                await _drain_until_eof(reader)
                return
            if mode == "eof":
                writer.close()
                return
            if mode == "oversize":
                big = {
                    "jsonrpc": "2.0",
                    "id": request["id"],
                    "result": {"pad": "x" * OVERSIZE_BYTES},
                }
                await _send_text(writer, big)
                await _drain_until_eof(reader)
                return
            raise AssertionError(mode)


def closed_port() -> int:
    """A loopback port with nothing listening (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        # Linger 0: close sends RST, like a crashed peer.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()


async def _drain_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


async def _upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > _MAX_HEADER:
        raise ConnectionError("oversized upgrade request")
    key = ""
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "sec-websocket-key":
            key = value.strip()
    accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()
    writer.write(
        (
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Accept: {accept}\r\n\r\n"
        ).encode()
    )
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first, second = await reader.readexactly(2)
    length = second & 0x7F
    if length == 126:
        (length,) = struct.unpack("!H", await reader.readexactly(2))
    elif length == 127:
        (length,) = struct.unpack("!Q", await reader.readexactly(8))
    mask = await reader.readexactly(4) if second & 0x80 else b"\0\0\0\0"
    data = await reader.readexactly(length)
    return first & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        header = bytes([0x80 | opcode, n])
    elif n < 2**16:
        header = bytes([0x80 | opcode, 126]) + struct.pack("!H", n)
    else:
        header = bytes([0x80 | opcode, 127]) + struct.pack("!Q", n)
    return header + payload


async def _send_text(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(_frame(0x1, json.dumps(message).encode()))
    await writer.drain()
