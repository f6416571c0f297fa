"""JSON-RPC 2.0 over a real uvicorn: HTTP POST and WebSocket at /api/rpc."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
import pydantic
import pytest
import pytest_asyncio
from fastapi import FastAPI
from websockets.asyncio.client import ClientConnection, connect

from gateway_http.auth import AuthError, JwtVerifier, Principal, mint_token
from gateway_http.jsonrpc import (
    AUTH_REQUIRED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    RPC_MAX_BODY_BYTES,
    Dispatcher,
    RpcContext,
    RpcError,
    rpc_router,
)
from tests.support.uvicorn_server import serve_app

SECRET = "rpc-test-secret-" + "0123456789abcdef" * 3
WAIT_S = 5.0


# --- test methods --------------------------------------------------------------------------------


class EchoParams(pydantic.BaseModel):
    text: str
    count: int = 1


class TagParams(pydantic.BaseModel):
    tag: str


class PushParams(pydantic.BaseModel):
    count: int = 2


class NoParams(pydantic.BaseModel):
    pass


class BuggyParams(pydantic.BaseModel):
    value: str = ""

    @pydantic.field_validator("value")
    @classmethod
    def _lookup(cls, value: str) -> str:
        # A bug in a validator (not a ValueError), which pydantic does not turn into an error.
        return {"known": "ok"}[value]


class RevocableVerifier(JwtVerifier):
    """A real verifier whose credentials can be withdrawn while a socket is open."""

    def __init__(self, secret: str | None) -> None:
        super().__init__(secret)
        self.revoked = False

    def principal(self, token: str | None) -> Principal:
        if self.revoked:
            raise AuthError(reason="revoked")
        return super().principal(token)


@dataclass
class Methods:
    """What the test methods did, so tests can see side effects of calls with no response."""

    recorded: list[str] = field(default_factory=list)
    recorded_event: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    slow_started: asyncio.Event = field(default_factory=asyncio.Event)
    slow_cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def echo(self, params: EchoParams, ctx: RpcContext) -> dict[str, Any]:
        return {"text": params.text * params.count, "user": ctx.user}

    async def record(self, params: TagParams, ctx: RpcContext) -> str:
        self.recorded.append(params.tag)
        self.recorded_event.set()
        return "ok"

    async def slow(self, params: NoParams, ctx: RpcContext) -> str:
        self.slow_started.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.slow_cancelled.set()
            raise
        return "slow done"

    async def boom(self, params: NoParams, ctx: RpcContext) -> str:
        raise RuntimeError("db password hunter2 at /srv/secret/path")

    async def fail(self, params: NoParams, ctx: RpcContext) -> str:
        raise RpcError(-32000, "Memory service unavailable", {"retryable": True})

    async def push(self, params: PushParams, ctx: RpcContext) -> dict[str, Any]:
        if ctx.notify is None:
            return {"pushed": 0}
        for i in range(params.count):
            await ctx.notify("test.tick", {"i": i})
        return {"pushed": params.count}

    async def model_result(self, params: NoParams, ctx: RpcContext) -> EchoParams:
        return EchoParams(text="as model", count=3)

    async def unencodable(self, params: NoParams, ctx: RpcContext) -> object:
        return object()


def build_dispatcher(methods: Methods, verifier: JwtVerifier) -> Dispatcher:
    dispatcher = Dispatcher(verifier)
    dispatcher.register("echo.params", methods.echo, EchoParams)
    dispatcher.register("record", methods.record, TagParams)
    dispatcher.register("slow", methods.slow, NoParams)
    dispatcher.register("boom", methods.boom, NoParams)
    dispatcher.register("fail", methods.fail, NoParams)
    dispatcher.register("push", methods.push, PushParams)
    dispatcher.register("model.result", methods.model_result, NoParams)
    dispatcher.register("unencodable", methods.unencodable, NoParams)
    dispatcher.register("buggy.params", methods.echo, BuggyParams)
    return dispatcher


@dataclass
class Rig:
    base: str
    methods: Methods
    verifier: RevocableVerifier
    http: httpx.AsyncClient

    @property
    def ws_url(self) -> str:
        return self.base.replace("http://", "ws://", 1) + "/api/rpc"

    async def post(self, body: Any, token: str | None = None, raw: bool = False) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        content = body if raw else json.dumps(body).encode()
        return await self.http.post("/api/rpc", content=content, headers=headers)

    async def call(self, body: Any, token: str | None = None) -> Any:
        response = await self.post(body, token if token is not None else alice_token())
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        return response.json()


def alice_token() -> str:
    return mint_token(SECRET, "alice")


async def _rig(verifier_secret: str | None) -> AsyncIterator[Rig]:
    methods = Methods()
    verifier = RevocableVerifier(verifier_secret)
    dispatcher = build_dispatcher(methods, verifier)
    app = FastAPI()
    app.include_router(rpc_router(lambda: dispatcher))
    async with serve_app(app) as base:
        async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=WAIT_S) as http:
            yield Rig(base, methods, verifier, http)


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    async for value in _rig(SECRET):
        yield value


@pytest_asyncio.fixture
async def rig_no_secret() -> AsyncIterator[Rig]:
    async for value in _rig(None):
        yield value


def req(method: str, params: Any = None, id_: Any = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        body["params"] = params
    if id_ is not _NOTIFICATION:
        body["id"] = id_
    return body


_NOTIFICATION = object()


def note(method: str, params: Any = None) -> dict[str, Any]:
    return req(method, params, _NOTIFICATION)


async def ws_recv(ws: ClientConnection) -> Any:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout=WAIT_S))


# --- authentication ------------------------------------------------------------------------------


def _b64(obj: dict[str, Any]) -> str:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _bad_tokens() -> list[tuple[str, str | None]]:
    # Made at collection: a day, so each is refused for its own fault, never for expiry.
    future = int(time.time()) + 24 * 3600
    return [
        ("missing", None),
        ("malformed", "this.is-not.a-jwt"),
        ("wrong signature", jwt.encode({"sub": "alice", "exp": future}, "x" * 40, "HS256")),
        (
            "alg none",
            f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64({'sub': 'alice', 'exp': future})}.",
        ),
        ("expired", jwt.encode({"sub": "alice", "exp": int(time.time()) - 60}, SECRET, "HS256")),
        ("no exp", jwt.encode({"sub": "alice"}, SECRET, "HS256")),
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize(("label", "token"), _bad_tokens())
async def test_bad_jwt_is_refused_with_32005(rig: Rig, label: str, token: str | None) -> None:
    response = await rig.post(req("record", {"tag": label}, 3), token)
    assert response.status_code == 200
    assert response.json() == {
        "jsonrpc": "2.0",
        "error": {"code": AUTH_REQUIRED, "message": "Authentication required"},
        "id": 3,
    }
    assert rig.methods.recorded == []  # the method never ran


@pytest.mark.asyncio
async def test_no_secret_configured_fails_closed(rig_no_secret: Rig) -> None:
    body = await rig_no_secret.call(req("echo.params", {"text": "hi"}, 1), alice_token())
    assert body["error"]["code"] == AUTH_REQUIRED
    # Unknown methods too: without auth nothing is revealed about what exists.
    body = await rig_no_secret.call(req("no.such.method", None, 2), alice_token())
    assert body["error"]["code"] == AUTH_REQUIRED


@pytest.mark.asyncio
async def test_valid_jwt_reaches_the_method_as_its_subject(rig: Rig) -> None:
    body = await rig.call(
        req("echo.params", {"text": "hi", "count": 2}, 1), mint_token(SECRET, "u-1")
    )
    assert body == {"jsonrpc": "2.0", "result": {"text": "hihi", "user": "u-1"}, "id": 1}


@pytest.mark.asyncio
async def test_unauthenticated_notification_does_not_run(rig: Rig) -> None:
    response = await rig.post(note("record", {"tag": "sneaky"}), None)
    assert response.status_code == 204
    assert rig.methods.recorded == []


# --- standard error codes ------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "raw", [b'{"jsonrpc": "2.0", "method": "echo.params", "id": 1', b"\xff\xfe{}", b"", b"nul"]
)
async def test_parse_error_has_null_id(rig: Rig, raw: bytes) -> None:
    response = await rig.post(raw, alice_token(), raw=True)
    assert response.status_code == 200
    body = response.json()
    assert body["error"]["code"] == PARSE_ERROR
    assert body["id"] is None


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("request_body", "expected_id"),
    [
        (1, None),
        ("echo.params", None),
        ({"method": "echo.params", "id": 4}, 4),
        ({"jsonrpc": "1.0", "method": "echo.params", "id": 4}, 4),
        ({"jsonrpc": 2.0, "method": "echo.params", "id": 4}, 4),
        ({"jsonrpc": "2.0", "method": 5, "id": "x"}, "x"),
        ({"jsonrpc": "2.0", "id": 4}, 4),
        ({"jsonrpc": "2.0", "method": "echo.params", "id": 1.5}, None),
        ({"jsonrpc": "2.0", "method": "echo.params", "id": True}, None),
        ({"jsonrpc": "2.0", "method": "echo.params", "id": {"a": 1}}, None),
        ({"jsonrpc": "2.0", "method": "echo.params", "id": [1]}, None),
        ({"jsonrpc": "2.0", "method": "echo.params", "params": "text", "id": 4}, 4),
        ({"jsonrpc": "2.0", "method": "echo.params", "params": None, "id": 4}, 4),
        ({"jsonrpc": "2.0", "method": "record", "params": 3}, None),
    ],
)
async def test_invalid_request_shapes_get_32600(
    rig: Rig, request_body: Any, expected_id: Any
) -> None:
    body = await rig.call(request_body)
    assert body["jsonrpc"] == "2.0"
    assert body["error"]["code"] == INVALID_REQUEST
    assert body["id"] == expected_id
    assert type(body["id"]) is type(expected_id)
    assert rig.methods.recorded == []


@pytest.mark.asyncio
async def test_unknown_method_is_32601(rig: Rig) -> None:
    body = await rig.call(req("nope", {}, "q"))
    assert body == {
        "jsonrpc": "2.0",
        "error": {"code": METHOD_NOT_FOUND, "message": "Method not found"},
        "id": "q",
    }


@pytest.mark.asyncio
async def test_invalid_params_name_the_fields_without_pydantic_noise(rig: Rig) -> None:
    body = await rig.call(req("echo.params", {"count": "many"}, 1))
    error = body["error"]
    assert error["code"] == INVALID_PARAMS
    assert "text" in error["message"] and "count" in error["message"]
    encoded = json.dumps(body)
    assert "pydantic.dev" not in encoded
    assert "many" not in encoded  # the caller's input is not echoed back
    assert "Traceback" not in encoded
    assert {f["field"] for f in error["data"]["fields"]} == {"text", "count"}


@pytest.mark.asyncio
async def test_positional_params_are_32602(rig: Rig) -> None:
    body = await rig.call(req("echo.params", ["hi"], 1))
    assert body["error"]["code"] == INVALID_PARAMS
    assert body["id"] == 1


@pytest.mark.asyncio
async def test_omitted_params_are_an_empty_object(rig: Rig) -> None:
    body = await rig.call(req("push", None, 1))
    assert body["result"] == {"pushed": 0}  # HTTP has no push channel
    body = await rig.call(req("echo.params", None, 2))
    assert body["error"]["code"] == INVALID_PARAMS
    assert "text" in body["error"]["message"]


@pytest.mark.asyncio
async def test_handler_crash_is_32603_without_internals(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="gateway_http.jsonrpc"):
        response = await rig.post(req("boom", None, 9), alice_token())
    assert response.json() == {
        "jsonrpc": "2.0",
        "error": {"code": INTERNAL_ERROR, "message": "Internal error"},
        "id": 9,
    }
    assert "hunter2" not in response.text and "Traceback" not in response.text
    # The operator still gets the traceback.
    crash = [r for r in caplog.records if r.exc_info is not None]
    assert crash and "boom" in crash[0].getMessage()


@pytest.mark.asyncio
async def test_unencodable_result_is_32603(rig: Rig) -> None:
    body = await rig.call(req("unencodable", None, 5))
    assert body["error"] == {"code": INTERNAL_ERROR, "message": "Internal error"}
    assert body["id"] == 5


@pytest.mark.asyncio
async def test_params_model_bug_is_32603(rig: Rig) -> None:
    body = await rig.call(req("buggy.params", {"value": "unknown"}, 6))
    assert body == {
        "jsonrpc": "2.0",
        "error": {"code": INTERNAL_ERROR, "message": "Internal error"},
        "id": 6,
    }


@pytest.mark.asyncio
async def test_pydantic_model_result_is_serialized(rig: Rig) -> None:
    body = await rig.call(req("model.result", None, 5))
    assert body["result"] == {"text": "as model", "count": 3}


@pytest.mark.asyncio
async def test_rpc_error_passes_through(rig: Rig) -> None:
    body = await rig.call(req("fail", None, "f"))
    assert body == {
        "jsonrpc": "2.0",
        "error": {
            "code": -32000,
            "message": "Memory service unavailable",
            "data": {"retryable": True},
        },
        "id": "f",
    }


# --- ids, notifications, batches -----------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("id_", [7, "7", 0, -3, "", None, 2**53 + 1])
async def test_ids_are_echoed_with_their_json_type(rig: Rig, id_: Any) -> None:
    response = await rig.post(req("echo.params", {"text": "x"}, id_), alice_token())
    assert response.json()["id"] == id_
    assert type(response.json()["id"]) is type(id_)
    # Byte-level: 7 is not "7" on the wire.
    assert f'"id":{json.dumps(id_)}' in response.text


@pytest.mark.asyncio
async def test_notification_runs_but_gets_no_response(rig: Rig) -> None:
    response = await rig.post(note("record", {"tag": "n1"}), alice_token())
    assert response.status_code == 204
    assert response.content == b""
    assert rig.methods.recorded == ["n1"]


@pytest.mark.asyncio
async def test_batch_is_answered_in_order_without_notifications(rig: Rig) -> None:
    body = await rig.call(
        [
            req("echo.params", {"text": "a"}, 1),
            note("record", {"tag": "in-batch"}),
            req("echo.params", {"text": "b"}, "two"),
            req("nope", None, 3),
            42,
        ]
    )
    assert isinstance(body, list)
    assert [item["id"] for item in body] == [1, "two", 3, None]
    assert body[0]["result"]["text"] == "a"
    assert body[1]["result"]["text"] == "b"
    assert body[2]["error"]["code"] == METHOD_NOT_FOUND
    assert body[3]["error"]["code"] == INVALID_REQUEST
    assert rig.methods.recorded == ["in-batch"]


@pytest.mark.asyncio
async def test_empty_batch_is_a_single_invalid_request(rig: Rig) -> None:
    body = await rig.call([])
    assert isinstance(body, dict)
    assert body["error"]["code"] == INVALID_REQUEST
    assert body["id"] is None


@pytest.mark.asyncio
async def test_all_notification_batch_is_204(rig: Rig) -> None:
    response = await rig.post(
        [note("record", {"tag": "a"}), note("record", {"tag": "b"})], alice_token()
    )
    assert response.status_code == 204
    assert response.content == b""
    assert rig.methods.recorded == ["a", "b"]


# --- body size -----------------------------------------------------------------------------------


def _echo_body_of_size(size: int) -> bytes:
    base = json.dumps(req("echo.params", {"text": ""}, 1)).encode()
    padding = size - len(base)
    return json.dumps(req("echo.params", {"text": "a" * padding}, 1)).encode()


@pytest.mark.asyncio
async def test_body_at_the_limit_is_served(rig: Rig) -> None:
    body = _echo_body_of_size(RPC_MAX_BODY_BYTES)
    assert len(body) == RPC_MAX_BODY_BYTES
    response = await rig.post(body, alice_token(), raw=True)
    assert response.status_code == 200
    assert len(response.json()["result"]["text"]) > RPC_MAX_BODY_BYTES - 100


@pytest.mark.asyncio
async def test_body_over_the_limit_is_413(rig: Rig) -> None:
    response = await rig.post(_echo_body_of_size(RPC_MAX_BODY_BYTES + 1), alice_token(), raw=True)
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"]["code"] == INVALID_REQUEST
    assert body["id"] is None


@pytest.mark.asyncio
async def test_chunked_body_over_the_limit_is_413(rig: Rig) -> None:
    # No Content-Length: the limit must be enforced while reading.
    payload = _echo_body_of_size(RPC_MAX_BODY_BYTES + 1)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(payload), 64 * 1024):
            yield payload[start : start + 64 * 1024]

    response = await rig.http.post(
        "/api/rpc",
        content=chunks(),
        headers={"authorization": f"Bearer {alice_token()}"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == INVALID_REQUEST


# --- WebSocket -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_websocket_token_via_query(rig: Rig) -> None:
    token = mint_token(SECRET, "query-user")
    async with connect(f"{rig.ws_url}?token={token}", proxy=None) as ws:
        await ws.send(json.dumps(req("echo.params", {"text": "q"}, 1)))
        assert await ws_recv(ws) == {
            "jsonrpc": "2.0",
            "result": {"text": "q", "user": "query-user"},
            "id": 1,
        }


@pytest.mark.asyncio
async def test_websocket_token_via_header(rig: Rig) -> None:
    token = mint_token(SECRET, "header-user")
    async with connect(
        rig.ws_url, additional_headers={"Authorization": f"Bearer {token}"}, proxy=None
    ) as ws:
        await ws.send(json.dumps(req("echo.params", {"text": "h"}, "h1")))
        body = await ws_recv(ws)
        assert body["result"]["user"] == "header-user"
        assert body["id"] == "h1"


@pytest.mark.asyncio
async def test_websocket_without_token_gets_32005_per_message(rig: Rig) -> None:
    async with connect(rig.ws_url, proxy=None) as ws:
        for i in range(2):
            await ws.send(json.dumps(req("echo.params", {"text": "x"}, i)))
            body = await ws_recv(ws)
            assert body["error"]["code"] == AUTH_REQUIRED
            assert body["id"] == i


@pytest.mark.asyncio
async def test_websocket_token_is_checked_per_message(rig: Rig) -> None:
    async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
        await ws.send(json.dumps(req("echo.params", {"text": "x"}, 1)))
        assert (await ws_recv(ws))["result"]["user"] == "alice"
        rig.verifier.revoked = True  # e.g. the token expired while the socket stayed open
        await ws.send(json.dumps(req("echo.params", {"text": "x"}, 2)))
        assert (await ws_recv(ws))["error"]["code"] == AUTH_REQUIRED


@pytest.mark.asyncio
async def test_websocket_notifications_are_pushed_before_the_result(rig: Rig) -> None:
    async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
        await ws.send(json.dumps(req("push", {"count": 3}, 11)))
        received = [await ws_recv(ws) for _ in range(4)]
    assert received[:3] == [
        {"jsonrpc": "2.0", "method": "test.tick", "params": {"i": i}} for i in range(3)
    ]
    assert received[3] == {"jsonrpc": "2.0", "result": {"pushed": 3}, "id": 11}


@pytest.mark.asyncio
async def test_websocket_slow_call_does_not_block_a_fast_one(rig: Rig) -> None:
    async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
        await ws.send(json.dumps(req("slow", None, "slow")))
        await asyncio.wait_for(rig.methods.slow_started.wait(), WAIT_S)
        await ws.send(json.dumps(req("echo.params", {"text": "fast"}, "fast")))
        first = await ws_recv(ws)
        assert first["id"] == "fast"
        rig.methods.gate.set()
        second = await ws_recv(ws)
        assert second == {"jsonrpc": "2.0", "result": "slow done", "id": "slow"}


@pytest.mark.asyncio
async def test_websocket_notification_gets_no_response(rig: Rig) -> None:
    async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
        await ws.send(json.dumps(note("record", {"tag": "ws-note"})))
        await asyncio.wait_for(rig.methods.recorded_event.wait(), WAIT_S)
        await ws.send(json.dumps(req("echo.params", {"text": "after"}, 2)))
        # The first frame back answers the request, not the notification.
        assert (await ws_recv(ws))["id"] == 2
    assert rig.methods.recorded == ["ws-note"]


@pytest.mark.asyncio
async def test_websocket_batch_and_parse_error(rig: Rig) -> None:
    async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
        await ws.send(json.dumps([req("echo.params", {"text": "a"}, 1), req("nope", None, 2)]))
        batch = await ws_recv(ws)
        assert [item["id"] for item in batch] == [1, 2]
        await ws.send("{not json")
        body = await ws_recv(ws)
        assert body["error"]["code"] == PARSE_ERROR and body["id"] is None


@pytest.mark.asyncio
async def test_websocket_oversized_message_is_refused_and_socket_stays_usable(rig: Rig) -> None:
    async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
        await ws.send(_echo_body_of_size(RPC_MAX_BODY_BYTES + 1).decode())
        body = await ws_recv(ws)
        assert body["error"]["code"] == INVALID_REQUEST
        assert body["id"] is None
        await ws.send(json.dumps(req("echo.params", {"text": "still here"}, 3)))
        assert (await ws_recv(ws))["result"]["text"] == "still here"


@pytest.mark.asyncio
async def test_websocket_close_cancels_running_calls_quietly(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
            await ws.send(json.dumps(req("slow", None, 1)))
            await asyncio.wait_for(rig.methods.slow_started.wait(), WAIT_S)
        # The client hung up mid-call: the server stops the work...
        await asyncio.wait_for(rig.methods.slow_cancelled.wait(), WAIT_S)
        # ...and is still serving new sockets.
        async with connect(f"{rig.ws_url}?token={alice_token()}", proxy=None) as ws:
            await ws.send(json.dumps(req("echo.params", {"text": "next"}, 2)))
            assert (await ws_recv(ws))["result"]["text"] == "next"
    # A disconnect is routine: no error records, no tracebacks.
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


# --- dispatcher without a transport --------------------------------------------------------------


def test_registering_a_method_twice_is_a_programming_error() -> None:
    dispatcher = Dispatcher(JwtVerifier(SECRET))
    methods = Methods()
    dispatcher.register("echo.params", methods.echo, EchoParams)
    with pytest.raises(ValueError, match=r"echo\.params"):
        dispatcher.register("echo.params", methods.echo, EchoParams)
