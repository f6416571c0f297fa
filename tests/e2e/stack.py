"""The real gateway on loopback for end-to-end tests, and one client per chat surface.

A :class:`Stack` is a scripted Philia (:class:`FakePhilia`), the real grpc.aio
``MemoryService`` talking to it, a recording OpenAI-compatible upstream
(:class:`FakeUpstream`), and the real FastAPI app under uvicorn calling the gRPC
service through its stub: every hop is a real socket on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.asyncio.client import connect

from arona_common.database import open_pool
from arona_grpc.config import Settings
from arona_grpc.server import GrpcServer
from arona_grpc.service import MemoryDomain
from gateway_http.app import create_app
from gateway_http.auth import mint_token
from gateway_http.edge import uvicorn_options
from gateway_http.upstream.backends_file import BackendsFile
from tests.support.fake_philia import FakePhilia
from tests.support.fake_upstream import FakeUpstream
from tests.support.uvicorn_server import serve_app

PHILIA_TOKEN = "philia-secret-token"
JWT_SECRET = "an-hs256-secret-that-is-long-enough-0123456789"
SURFACES = ("rest", "sse", "rpc", "rpc_ws")
ASK_TEXT = "what tea do I like?"
UNSET: Any = object()


@dataclass
class Turn:
    status: int
    memory: str | None
    content: str
    body: Any = None
    events: list[Any] = field(default_factory=list)
    # The response headers (REST JSON and SSE).
    headers: httpx.Headers | None = None


@dataclass
class Stack:
    philia: FakePhilia
    upstream: FakeUpstream
    grpc: GrpcServer | None
    settings: Settings
    base_url: str
    http: httpx.AsyncClient
    user: str = "alice"
    app: Any = None

    async def drain_writebacks(self) -> None:
        """Wait for the turns' background writebacks to end."""
        await self.app.state.gateway.pipeline.drain(10.0)

    @property
    def jwt(self) -> str:
        return mint_token(JWT_SECRET, self.user, 600)

    def rpc_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.jwt}"}

    async def rpc(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON-RPC call over HTTP POST; the whole response object."""
        request: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method}
        if params is not None:
            request["params"] = params
        response = await self.http.post("/api/rpc", json=request, headers=self.rpc_headers())
        assert response.status_code == 200, response.text
        reply: dict[str, Any] = response.json()
        return reply

    async def create_conversation(self, surface: str) -> str:
        if surface.startswith("rpc"):
            reply = await self.rpc("conversations.create", {"title": "t"})
            return str(reply["result"]["id"])
        response = await self.http.post("/v1/conversations", json={"title": "t"})
        assert response.status_code == 200, response.text
        return str(response.json()["id"])

    async def turn(
        self,
        surface: str,
        messages: list[dict[str, Any]],
        *,
        memory: Any = UNSET,
        conversation_id: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Turn:
        body: dict[str, Any] = {"model": "fake-model", "messages": messages, **(extra or {})}
        if memory is not UNSET:
            body["memory"] = memory
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        if surface == "rest":
            response = await self.http.post("/v1/chat/completions", json=body)
            data = response.json()
            content = data["choices"][0]["message"]["content"] if response.is_success else ""
            memory = response.headers.get("x-arona-memory")
            return Turn(response.status_code, memory, content, data, headers=response.headers)
        if surface == "sse":
            return await self._sse({**body, "stream": True})
        if surface == "rpc":
            reply = await self.rpc("chat.send", body)
            result = reply.get("result") or {}
            return Turn(200, result.get("memory"), result.get("content", ""), reply)
        if surface == "rpc_ws":
            return await self._ws(body)
        raise AssertionError(surface)

    async def _sse(self, body: dict[str, Any]) -> Turn:
        events: list[Any] = []
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if not response.is_success:
                await response.aread()
                return Turn(
                    response.status_code, None, "", response.json(), headers=response.headers
                )
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append("[DONE]" if data == "[DONE]" else orjson.loads(data))
        content = "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in events
            if isinstance(e, dict) and e.get("choices")
        )
        return Turn(
            response.status_code,
            response.headers.get("x-arona-memory"),
            content,
            None,
            events,
            headers=response.headers,
        )

    async def _ws(self, params: dict[str, Any]) -> Turn:
        message, events = await chat_over_websocket(self.base_url, self.jwt, params)
        result = message.get("result") or {}
        return Turn(200, result.get("memory"), result.get("content", ""), message, events)


async def chat_over_websocket(
    base_url: str, token: str, params: dict[str, Any]
) -> tuple[dict[str, Any], list[Any]]:
    """One ``chat.send`` over a JSON-RPC WebSocket: its response and the frames before it."""
    url = base_url.replace("http://", "ws://") + f"/api/rpc?token={token}"
    request_id = str(uuid.uuid4())
    events: list[Any] = []
    async with connect(url, proxy=None) as ws:
        await ws.send(
            orjson.dumps(
                {"jsonrpc": "2.0", "id": request_id, "method": "chat.send", "params": params}
            ).decode()
        )
        while True:
            message: dict[str, Any] = orjson.loads(await ws.recv())
            if message.get("id") == request_id:
                return message, events
            events.append(message)


@contextlib.asynccontextmanager
async def running_stack(
    data_dir: Path,
    *,
    memory: bool = True,
    timeout_s: float = 1.0,
    grpc_target: str | None = None,
    clock: Callable[[], float] | None = None,
    http_overrides: dict[str, Any] | None = None,
    backends: BackendsFile | None = None,
    **overrides: Any,
) -> AsyncIterator[Stack]:
    """Start every part; ``grpc_target`` points the HTTP layer elsewhere (no gRPC started).

    ``clock`` replaces the monotonic clock of the memory breaker (tests skip its cooldown).
    ``timeout_s`` is Philia's per-call timeout, and so the recall budget unless overridden: a
    first turn connects and recalls in about 40 ms on a loaded 2-core box, and 1 s keeps a
    wide margin for a machine that stalls (a 0.4 s budget once ran out in CI).
    ``overrides`` apply to both layers' settings, ``http_overrides`` to the HTTP layer's only.
    ``backends`` (a checked backends file) routes the models instead of the one upstream.
    """
    async with FakePhilia(token=PHILIA_TOKEN) as philia, FakeUpstream.start() as upstream:
        fields: dict[str, Any] = {
            "memory_url": philia.url if memory else None,
            "memory_token": PHILIA_TOKEN if memory else None,
            "memory_timeout_s": timeout_s,
            "grpc_port": 0,
            "upstream_url": upstream.base_url if backends is None else None,
            "jwt_secret": JWT_SECRET,
            "data_dir": data_dir,
        }
        settings = Settings(**{**fields, **overrides})
        # One pool for both parts, as the command line has (ARONA_DATABASE_URL).
        pool = await open_pool(settings.database_url) if settings.database_url else None
        grpc: GrpcServer | None = None
        try:
            if grpc_target is None:
                domain = (
                    MemoryDomain(settings, clock=clock, pool=pool) if clock is not None else None
                )
                grpc = await GrpcServer.start(settings, domain, pool=pool)
                grpc_target = grpc.target
            settings = dataclasses.replace(
                settings, grpc_target=grpc_target, **(http_overrides or {})
            )
            app = create_app(settings, pool=pool, backends=backends)
            async with (
                serve_app(app, options=uvicorn_options(settings)) as base_url,
                httpx.AsyncClient(base_url=base_url, timeout=10.0) as http,
            ):
                yield Stack(philia, upstream, grpc, settings, base_url, http, app=app)
        finally:
            if grpc is not None:
                await grpc.stop(0.5)
            if pool is not None:
                await pool.close()
