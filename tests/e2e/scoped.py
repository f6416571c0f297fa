"""The real gateway over the real embedded store, with callers of its own: per-user memory.

A :class:`ScopedStack` is the embedded Philia-compatible store (which honours
``node_type_filter``), the real grpc.aio ``MemoryService``, a recording upstream and the
real FastAPI app under uvicorn, with named and unnamed REST API keys and a JWT secret, so
that end-to-end tests can speak as several people on every surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import FastAPI

from arona_grpc.config import Settings
from arona_grpc.server import GrpcServer
from arona_store.server import StoreServer
from gateway_http.app import create_app
from gateway_http.auth import mint_token
from gateway_http.state import Gateway
from tests.e2e.stack import chat_over_websocket
from tests.support.fake_upstream import FakeUpstream
from tests.support.uvicorn_server import serve_app

STORE_TOKEN = "store-secret-token"
JWT_SECRET = "an-hs256-secret-that-is-long-enough-0123456789"
TEAM_A_KEY = "key-of-team-a-0001"
BARE_KEY = "key-without-a-name-0002"
API_KEYS = (f"team-a={TEAM_A_KEY}", BARE_KEY)
HEADER = "## Relevant Long-Term Memories"
# Chat surfaces that take a JWT as the caller (REST takes it as its bearer).
SURFACES = ("rest", "sse", "rpc", "rpc_ws")


# Test modules mint their tokens when they are imported, at collection: a token must outlive
# the whole suite, which took 18 minutes on a loaded 2-core box (600 s tokens had expired by
# the time the last end-to-end tests ran).
TOKEN_TTL_S = 24 * 3600


def jwt(sub: str, *, admin: bool = False) -> str:
    return mint_token(JWT_SECRET, sub, TOKEN_TTL_S, admin=admin)


@dataclass
class Said:
    """What one turn showed its caller and sent upstream."""

    status: int
    memory: str | None
    # The memory section the upstream received ("" when none was injected).
    section: str
    content: str
    body: Any = None
    # The response headers (REST JSON and SSE).
    headers: httpx.Headers | None = None


@dataclass
class ScopedStack:
    store: StoreServer
    upstream: FakeUpstream
    grpc: GrpcServer
    app: FastAPI
    settings: Settings
    base_url: str
    http: httpx.AsyncClient
    # Every gRPC replica the HTTP layer spreads its calls over (``grpc`` is the first).
    replicas: tuple[GrpcServer, ...] = ()

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway

    async def settle(self) -> None:
        """Wait for every writeback the turns so far started, and for the store to embed what
        they stored (it answers a store before embedding it): awaited events, no sleep."""
        await self.gateway.pipeline.drain(10.0)
        await asyncio.wait_for(self.store.wait_embedded(), 60.0)

    def stored_texts(self) -> list[str]:
        """Every node text in the store's database file."""
        db_path = self.settings.data_dir / "memory.db"
        with contextlib.closing(sqlite3.connect(db_path)) as db:
            return [str(row[0]) for row in db.execute("SELECT text FROM nodes ORDER BY seq")]

    def _section(self, requests_before: int) -> str:
        if len(self.upstream.chat_requests) == requests_before:
            return ""
        first = self.upstream.last_body["messages"][0]
        content = first.get("content") or ""
        return str(content) if first["role"] == "system" and HEADER in content else ""

    async def rpc(
        self, token: str, method: str, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One JSON-RPC call over HTTP POST as ``token``'s holder; the whole response."""
        request: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method}
        if params is not None:
            request["params"] = params
        response = await self.http.post(
            "/api/rpc", json=request, headers={"Authorization": f"Bearer {token}"}
        )
        assert response.status_code == 200, response.text
        reply: dict[str, Any] = response.json()
        return reply

    async def result(
        self, token: str, method: str, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        reply = await self.rpc(token, method, params)
        assert "result" in reply, reply
        result: dict[str, Any] = reply["result"]
        return result

    async def conversation(self, bearer: str) -> str:
        response = await self.http.post(
            "/v1/conversations", json={}, headers={"Authorization": f"Bearer {bearer}"}
        )
        assert response.status_code == 200, response.text
        return str(response.json()["id"])

    async def say(
        self,
        surface: str,
        bearer: str | None,
        text: str,
        *,
        user: Any = None,
        conversation_id: str | None = None,
        memory: bool | None = None,
    ) -> Said:
        """One turn on ``surface`` as ``bearer`` (an API key or a JWT; JSON-RPC needs a JWT)."""
        body: dict[str, Any] = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": text}],
        }
        if user is not None:
            body["user"] = user
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        if memory is not None:
            body["memory"] = memory
        before = len(self.upstream.chat_requests)
        headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
        if surface == "rest":
            response = await self.http.post("/v1/chat/completions", json=body, headers=headers)
            data = response.json()
            content = data["choices"][0]["message"]["content"] if response.is_success else ""
            return Said(
                response.status_code,
                response.headers.get("x-arona-memory"),
                self._section(before),
                content,
                data,
                response.headers,
            )
        if surface == "sse":
            return await self._sse({**body, "stream": True}, headers, before)
        assert bearer is not None
        if surface == "rpc":
            reply = await self.rpc(bearer, "chat.send", body)
            result = reply.get("result") or {}
            return Said(
                200, result.get("memory"), self._section(before), result.get("content", ""), reply
            )
        if surface == "rpc_ws":
            return await self._ws(bearer, body, before)
        raise AssertionError(surface)

    async def _sse(self, body: dict[str, Any], headers: dict[str, str], before: int) -> Said:
        parts: list[str] = []
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
            if not response.is_success:
                await response.aread()
                return Said(response.status_code, None, "", "", response.json(), response.headers)
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = orjson.loads(line[len("data: ") :])
                    parts.append(event["choices"][0]["delta"].get("content") or "")
        return Said(
            response.status_code,
            response.headers.get("x-arona-memory"),
            self._section(before),
            "".join(parts),
            headers=response.headers,
        )

    async def _ws(self, token: str, params: dict[str, Any], before: int) -> Said:
        message, _ = await chat_over_websocket(self.base_url, token, params)
        result = message.get("result") or {}
        return Said(
            200, result.get("memory"), self._section(before), result.get("content", ""), message
        )


@contextlib.asynccontextmanager
async def scoped_stack(
    data_dir: Path,
    *,
    scope: str = "user",
    echo: bool = False,
    grpc_replicas: int = 1,
    more_stores: tuple[str, ...] = (),
    **overrides: Any,
) -> AsyncIterator[ScopedStack]:
    """Every part started on 127.0.0.1; ``echo`` uses the built-in echo model upstream;
    ``grpc_replicas`` gRPC services (on one database, ``database_url``) serve the HTTP layer;
    ``more_stores``: store URLs listed in ``ARONA_MEMORY_URL`` after the embedded store's."""
    store = await StoreServer.start(db_path=data_dir / "memory.db", token=STORE_TOKEN)
    try:
        async with FakeUpstream.start() as upstream:
            fields: dict[str, Any] = {
                "memory_url": ",".join((store.url, *more_stores)),
                "memory_token": STORE_TOKEN,
                "memory_scope": scope,
                "grpc_port": 0,
                "upstream_url": None if echo else upstream.base_url,
                "jwt_secret": JWT_SECRET,
                "api_keys": API_KEYS,
                "data_dir": data_dir,
                **overrides,
            }
            settings = Settings(**fields)
            replicas: list[GrpcServer] = []
            try:
                for _ in range(grpc_replicas):
                    replicas.append(await GrpcServer.start(settings))
                target = ",".join(replica.target for replica in replicas)
                settings = dataclasses.replace(settings, grpc_target=target)
                app = create_app(settings)
                async with (
                    serve_app(app) as base_url,
                    httpx.AsyncClient(base_url=base_url, timeout=10.0) as http,
                ):
                    yield ScopedStack(
                        store, upstream, replicas[0], app, settings, base_url, http, (*replicas,)
                    )
            finally:
                for replica in replicas:
                    await replica.stop(0.5)
    finally:
        await store.stop()
