"""Principals cannot collide: no JWT ``sub`` speaks as an API key or as another's user.

``sub=key:team-a`` would be the API key ``team-a``'s memory, ``sub=alice/bob`` alice's
``user=bob``. Such tokens, validly signed, are refused on every surface that takes a JWT
(REST and SSE bearer, JSON-RPC over POST and over WebSocket) with the same message, and the
gRPC service, which takes a scope name from its trusted callers, refuses a scope that is no
``<principal>[/<user>]``. Everything runs for real on loopback: the embedded store, the gRPC
service, the HTTP layer under uvicorn.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jwt
import orjson
import pytest
from websockets.asyncio.client import connect

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from tests.e2e.scoped import JWT_SECRET, TEAM_A_KEY, ScopedStack, scoped_stack
from tests.e2e.scoped import jwt as minted

COMMAND = str(Path(sys.executable).parent / "arona-gateway")

FACT = "My locker code is 4417 and my locker is the blue zebra one"
ASK = "Which zebra locker is mine, and its code?"
RULE = (
    "the token's 'sub' must be 1 to 128 printable characters, without '/', not starting with 'key:'"
)
# Subs that would take another principal's scope, or that name nobody.
COLLIDING = ("key:team-a", "Key:team-a", "alice/bob", "x" * 129, "", "a\u0000b")


def signed(sub: str) -> str:
    """A token our issuer signed (``arona-gateway token`` refuses to mint these)."""
    claims = {"sub": sub, "exp": int(time.time()) + 3600}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


async def ws_call(stack: ScopedStack, token: str, method: str, params: object) -> dict[str, object]:
    url = stack.base_url.replace("http://", "ws://") + f"/api/rpc?token={token}"
    async with connect(url, proxy=None) as ws:
        request = {"jsonrpc": "2.0", "id": 7, "method": method, "params": params}
        await ws.send(orjson.dumps(request).decode())
        reply: dict[str, object] = orjson.loads(await ws.recv())
        return reply


@pytest.mark.asyncio
async def test_colliding_subs_are_refused_on_every_surface_and_reach_nothing(
    tmp_path: Path,
) -> None:
    async with scoped_stack(tmp_path) as stack:
        # What the colliding tokens would reach: team-a's and alice's user bob's memories.
        assert (await stack.say("rest", TEAM_A_KEY, FACT)).status == 200
        assert (await stack.say("rest", minted("alice"), FACT, user="bob")).status == 200
        await stack.settle()
        requests = len(stack.upstream.chat_requests)
        for sub in COLLIDING:
            token = signed(sub)
            for surface in ("rest", "sse"):
                said = await stack.say(surface, token, ASK)
                assert said.status == 401, (sub, surface)
                assert said.body["error"] == {
                    "message": RULE,
                    "type": "authentication_error",
                    "code": "invalid_subject",
                }
            over_post = await stack.rpc(token, "memory.list")
            assert over_post["error"] == {"code": -32005, "message": RULE}, sub
            over_ws = await ws_call(stack, token, "chat.send", {"model": "m", "messages": []})
            assert over_ws["error"] == {"code": -32005, "message": RULE}, sub
        # Not one turn went upstream, recalled or stored anything.
        assert len(stack.upstream.chat_requests) == requests
        assert len(stack.stored_texts()) == 2


@pytest.mark.asyncio
async def test_an_open_rest_refuses_a_colliding_sub_instead_of_serving_it_as_nobody(
    tmp_path: Path,
) -> None:
    async with scoped_stack(tmp_path, api_keys=()) as stack:
        said = await stack.say("rest", signed("key:team-a"), ASK)
        assert (said.status, said.body["error"]["code"]) == (401, "invalid_subject")
        assert (await stack.say("rest", None, ASK)).status == 200


@pytest.mark.asyncio
async def test_the_grpc_service_refuses_a_scope_that_names_no_principal(tmp_path: Path) -> None:
    async with (
        scoped_stack(tmp_path) as stack,
        grpc.aio.insecure_channel(stack.grpc.target) as channel,
    ):
        stub = pb_grpc.MemoryServiceStub(channel)
        for scope, why in (
            ("/bob", "scope: its principal (before the first '/') must be 1 to 128"),
            ("x" * 129, "scope: its principal (before the first '/') must be 1 to 128"),
            ("alice/", "scope: its user (after the first '/') must not be empty after '/'"),
            ("alice/b\u0007b", "scope: its user (after the first '/') must not contain control"),
        ):
            for call in (
                stub.Recall(pb.RecallRequest(query=ASK, scope=scope)),
                stub.Writeback(pb.WritebackRequest(user=FACT, assistant="ok", scope=scope)),
                stub.List(pb.ListRequest(scope=scope)),
                stub.Forget(pb.ForgetRequest(scope=scope)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, scope
                assert (caught.value.details() or "").startswith(why), caught.value.details()
        # Well-formed scopes of every kind are served: a sub, a key, narrowed by a user.
        for scope in ("alice", "key:team-a", "key:team-a/bob", "svc:alice/Zoë"):
            reply = await stub.Recall(pb.RecallRequest(query=ASK, scope=scope))
            assert reply.state == pb.MEMORY_STATE_DISABLED
        assert stack.stored_texts() == []


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ("token", "--sub", "key:team-a"),
            "arona-gateway: error: --sub must be 1 to 128 printable characters, without '/', "
            "not starting with 'key:'",
        ),
        (
            ("import", "--user", "alice/bob", "history.jsonl"),
            "arona-gateway: error: --user (a JWT sub or key:NAME) must not contain '/' "
            "(it separates a principal from the user it narrows to)",
        ),
    ],
)
def test_the_command_line_mints_and_imports_for_principals_only(
    tmp_path: Path, argv: tuple[str, ...], line: str
) -> None:
    (tmp_path / "history.jsonl").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(tmp_path), ARONA_JWT_SECRET=JWT_SECRET)
    done = subprocess.run(
        [COMMAND, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")
