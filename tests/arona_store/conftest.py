"""Fixtures for the embedded store: a real server on 127.0.0.1:0 over a SQLite file in tmp_path."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import pytest_asyncio
from websockets.asyncio.client import ClientConnection, connect

from arona_store.server import StoreServer

# Characters that need URL-encoding, so the upgrade check is exercised with a decoded token.
TOKEN = "s3cret+tok/en=Zq9"
WAIT_S = 5.0


def ws_url(server: StoreServer, token: str | None = TOKEN) -> str:
    if token is None:
        return server.url
    return f"{server.url}?{urlencode({'token': token})}"


class StoreClient:
    """A minimal test client: sends frames, reads replies by id, skips other frames."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self.skipped: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any] | str) -> None:
        await self.ws.send(message if isinstance(message, str) else json.dumps(message))

    async def recv(self) -> dict[str, Any]:
        raw = await asyncio.wait_for(self.ws.recv(), WAIT_S)
        message = json.loads(raw)
        assert isinstance(message, dict)
        return message

    async def reply_to(self, request_id: object) -> dict[str, Any]:
        """The next frame carrying ``request_id``; other frames are kept in ``skipped``."""
        for _ in range(20):
            message = await self.recv()
            if "id" in message and message["id"] == request_id:
                return message
            self.skipped.append(message)
        raise AssertionError("no reply carrying the request id")

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        request_id = next(self._ids)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        await self.send(message)
        return await self.reply_to(request_id)

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``result`` of a request that must succeed."""
        reply = await self.request(method, params)
        assert "error" not in reply, reply
        result = reply["result"]
        assert isinstance(result, dict)
        return result

    async def handshake(self, token: str = TOKEN) -> dict[str, Any]:
        return await self.call("Sync.ConnectHandshake", {"token": token, "client_type": "cli"})


@pytest.fixture(autouse=True)
def lexical_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store tests pin lexical scores and orders: servers they start rank lexically unless
    a test asks for ``hybrid`` (``ranking=``) itself."""
    monkeypatch.setenv("ARONA_STORE_RANKING", "lexical")


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[StoreServer]:
    async with await StoreServer.start(db_path=tmp_path / "store.db", token=TOKEN) as srv:
        yield srv


@pytest_asyncio.fixture
async def raw_client(server: StoreServer) -> AsyncIterator[StoreClient]:
    """Connected (upgrade token accepted) but no handshake yet."""
    async with connect(ws_url(server), proxy=None, open_timeout=WAIT_S) as ws:
        yield StoreClient(ws)


@pytest_asyncio.fixture
async def client(raw_client: StoreClient) -> StoreClient:
    """Connected and handshaken."""
    result = await raw_client.handshake()
    assert result["ok"] is True
    return raw_client


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "nested" / "dir" / "store.db"
