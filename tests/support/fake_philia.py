"""A scripted Philia server for tests: real WebSockets on ``127.0.0.1`` port 0.

It speaks the subset of the Philia wire protocol the gateway uses and, by default,
behaves like a tiny in-memory store: the handshake accepts the right token, a query
answers with :attr:`FakePhilia.memories` (cut to ``limit``), a store appends to
:attr:`FakePhilia.stored` and answers ``n-1``, ``n-2``…, a delete answers whether
that id was stored. Everything it sees is recorded:

- :attr:`FakePhilia.upgrades`: the path and query of every upgrade request, in order
  (rejected ones included), e.g. ``/ws?token=t0k3n``;
- :attr:`FakePhilia.frames`: every text frame received, parsed (or the raw text when
  it is not JSON).

A test changes the next answer of a method with :meth:`FakePhilia.script` and a
:class:`Step`: reply with a given result, a JSON-RPC error, never answer, close the
connection mid-call, send garbage, wait for a gate, or send extra frames first
(greeting, heartbeat ack, a reply with some other id). Steps queue per method and are
used once each; when none is queued the default behaviour answers.

Tests never sleep: :meth:`FakePhilia.wait_frames` returns once enough frames of a
method have arrived. Typical use::

    async with FakePhilia(token="t0k3n") as fake:
        fake.script("Sync.MemoryStoreRequest", Step(error=(-32603, "boom")))
        client = PhiliaClient(fake.url, "t0k3n", timeout_s=0.5)
        ...
        [store] = await fake.wait_frames("Sync.MemoryStoreRequest")
        assert store["params"]["text"] == "User: hi\\nAssistant: hello"
"""

from __future__ import annotations

import asyncio
import json
import logging
import types
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

HANDSHAKE = "Sync.ConnectHandshake"
QUERY = "Sync.MemoryQueryRequest"
STORE = "Sync.MemoryStoreRequest"
DELETE = "Sync.MemoryDeleteRequest"

# Frames a real Philia sends that match no request; a client must skip them.
GREETING: dict[str, Any] = {
    "jsonrpc": "2.0",
    "method": "Sync.ServerVersion",
    "params": {"version": "0.0.0-fake", "build_info": "tests"},
}
HEARTBEAT_ACK: dict[str, Any] = {"jsonrpc": "2.0", "method": "Base.HeartbeatAck", "params": {}}

_DEFAULT = object()


@dataclass
class Step:
    """How the fake answers one call of a method.

    ``action`` is one of:

    - ``"reply"``: answer with ``result`` if given (a value, or a function of the
      request's params), else with ``error`` if given, else the default behaviour;
    - ``"hang"``: never answer;
    - ``"close"``: close the connection with ``close_code`` instead of answering;
    - ``"garbage"``: send ``garbage`` as the answer.

    ``before`` frames are sent first (dicts as JSON, ``str`` as raw text, ``bytes`` as
    a binary frame); ``gate``, when set, is awaited before anything; ``hold``, when
    set, is awaited after the ``before`` frames and before the answer (a late reply).
    ``error_data`` goes into the error object as ``data``; ``repeat`` sends the answer
    that many times (duplicate replies).
    """

    result: Any = _DEFAULT
    error: tuple[int, str] | None = None
    action: Literal["reply", "hang", "close", "garbage"] = "reply"
    before: list[Any] = field(default_factory=list)
    gate: asyncio.Event | None = None
    close_code: int = 4000
    garbage: str | bytes = "this is not json"
    hold: asyncio.Event | None = None
    error_data: Any = None
    repeat: int = 1


class FakePhilia:
    """See the module docstring. Start with ``async with`` or :meth:`start`/:meth:`stop`."""

    # Its own logger name, so tests can tell the fake's log lines (which show the
    # token it received) from the gateway's.
    LOGGER = "fake_philia"

    def __init__(
        self,
        token: str = "t0k3n",
        path: str = "/ws",
        port: int = 0,
        *,
        filtering: bool = False,
        max_size: int = 2**20,
    ) -> None:
        self.token = token
        # The largest frame taken: a bigger one closes the connection with 1009, as Philia does.
        self.max_size = max_size
        # With ``node_type_filter``, a query answers with the stored nodes of that type (what
        # a Philia that honours the filter would find), newest first.
        self.filtering = filtering
        self.path = path
        self.port = port
        self.memories: list[dict[str, Any]] = []
        self.stored: list[dict[str, Any]] = []
        self.upgrades: list[str] = []
        self.frames: list[Any] = []
        self._steps: dict[str, deque[Step]] = defaultdict(deque)
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: Server | None = None
        self._open = 0
        # When set, every upgrade is answered with this HTTP status (e.g. 401).
        self.upgrade_status: int | None = None
        # Calls fully answered (or acted on), for tests that await a late reply.
        self.answered = 0

    @property
    def url(self) -> str:
        """The WebSocket URL to configure, without the token."""
        return f"ws://127.0.0.1:{self.port}{self.path}"

    def script(self, method: str, *steps: Step) -> None:
        """Queue answers for the next calls of ``method``, one step per call."""
        self._steps[method].extend(steps)

    def frames_of(self, method: str) -> list[dict[str, Any]]:
        """Every received request of ``method``, in order."""
        return [f for f in self.frames if isinstance(f, dict) and f.get("method") == method]

    def upgrade_queries(self) -> list[dict[str, list[str]]]:
        """The decoded query string of every upgrade request."""
        return [parse_qs(urlsplit(u).query, keep_blank_values=True) for u in self.upgrades]

    async def wait_frames(self, method: str, count: int = 1) -> list[dict[str, Any]]:
        """Return the requests of ``method`` once at least ``count`` have arrived."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.frames_of(method)) >= count)
        return self.frames_of(method)

    async def wait_answered(self, count: int) -> None:
        """Return once ``count`` calls in all have been answered (late replies included)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.answered >= count)

    async def wait_stored(self, count: int) -> None:
        """Return once ``count`` stores in all have been answered and kept."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.stored) >= count)

    async def wait_all_closed(self) -> None:
        """Return once no client connection is open (e.g. after the client aborted)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._open == 0)

    async def close_connections(self, code: int = 4000) -> None:
        """Close every open connection from the server side (as Philia does when idle)."""
        assert self._server is not None
        await asyncio.gather(*(c.close(code) for c in self._server.connections))

    async def start(self) -> FakePhilia:
        self._server = await serve(
            self._handle,
            "127.0.0.1",
            self.port,
            process_request=self._check_upgrade,
            compression=None,
            max_size=self.max_size,
            close_timeout=1,
            logger=logging.getLogger(self.LOGGER),
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> FakePhilia:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.stop()

    def _check_upgrade(self, connection: ServerConnection, request: Request) -> Response | None:
        self.upgrades.append(request.path)
        target = urlsplit(request.path)
        if self.upgrade_status is not None:
            return connection.respond(self.upgrade_status, "refused by the test\n")
        if target.path != self.path:
            return connection.respond(404, "not found\n")
        if parse_qs(target.query).get("token") != [self.token]:
            return connection.respond(401, "bad token\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        calls: set[asyncio.Task[None]] = set()
        async with self._changed:
            self._open += 1
        try:
            async for raw in ws:
                try:
                    frame = json.loads(raw)
                except ValueError:
                    frame = raw
                await self._record(frame)
                if isinstance(frame, dict) and "id" in frame and "method" in frame:
                    # Like Philia, calls on one connection are answered concurrently.
                    task = asyncio.get_running_loop().create_task(self._answer(ws, frame))
                    calls.add(task)
                    self._tasks.add(task)
                    task.add_done_callback(calls.discard)
                    task.add_done_callback(self._tasks.discard)
        except ConnectionClosed:
            pass  # the client aborted the link: what the gateway does on any fault
        finally:
            for task in calls:
                task.cancel()
            async with self._changed:
                self._open -= 1
                self._changed.notify_all()

    async def _record(self, frame: Any) -> None:
        async with self._changed:
            self.frames.append(frame)
            self._changed.notify_all()

    async def _answer(self, ws: ServerConnection, frame: dict[str, Any]) -> None:
        try:
            await self._act(ws, frame)
        except ConnectionClosed:
            pass  # the client went away first; nothing to answer

    async def _act(self, ws: ServerConnection, frame: dict[str, Any]) -> None:
        method = frame["method"]
        queue = self._steps.get(method)
        step = queue.popleft() if queue else Step()
        if step.gate is not None:
            await step.gate.wait()
        for extra in step.before:
            await ws.send(json.dumps(extra) if isinstance(extra, dict) else extra)
        if step.hold is not None:
            await step.hold.wait()
        if step.action == "hang":
            await asyncio.Future()  # until the connection goes away
        elif step.action == "close":
            await ws.close(step.close_code)
        elif step.action == "garbage":
            await ws.send(step.garbage)
        else:
            reply = self._reply(method, frame, step)
            for _ in range(step.repeat):
                await self._send(ws, reply)
        async with self._changed:
            self.answered += 1
            self._changed.notify_all()

    def _reply(self, method: str, frame: dict[str, Any], step: Step) -> dict[str, Any]:
        if step.error is not None and step.result is _DEFAULT:
            code, message = step.error
            error: dict[str, Any] = {"code": code, "message": message}
            if step.error_data is not None:
                error["data"] = step.error_data
            return {"id": frame["id"], "error": error}
        params = frame.get("params") or {}
        result = step.result
        if result is _DEFAULT:
            result = self._default(method, params)
        elif callable(result):
            result = result(params)
        return {"id": frame["id"], "result": result}

    async def _send(self, ws: ServerConnection, reply: dict[str, Any]) -> None:
        await ws.send(json.dumps({"jsonrpc": "2.0", **reply}))

    def _default(self, method: str, params: dict[str, Any]) -> Any:
        if method == HANDSHAKE:
            ok = params.get("token") == self.token
            return {
                "ok": ok,
                "error": None if ok else "invalid token",
                "session_id": "s-1" if ok else None,
                "reconnect": False,
            }
        if method == QUERY:
            limit = params.get("limit", 10)
            results = self.memories[:limit]
            wanted = params.get("node_type_filter")
            if self.filtering and wanted is not None:
                results = [
                    {"node_type": wanted, "text": p["text"], "score": 0.5}
                    for p in reversed(self.stored)
                    if p.get("node_type") == wanted
                ][:limit]
            return {"query": params.get("query"), "total": len(results), "results": results}
        if method == STORE:
            self.stored.append(params)
            return {"node_id": f"n-{len(self.stored)}"}
        if method == DELETE:
            ids = {f"n-{i}" for i in range(1, len(self.stored) + 1)}
            return {"deleted": params.get("node_id") in ids}
        return None
