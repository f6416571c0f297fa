"""A REST API key is a JSON-RPC bearer too: its holder manages its own memories, end to end.

Every test runs the real embedded store, the real gRPC service and the real HTTP layer on
loopback. The key's turns go over REST (narrowed or not by the OpenAI ``user`` field); the
same key then lists, deletes and forgets them over ``/api/rpc``, on HTTP and WebSocket, with
no JWT minted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.asyncio.client import connect

from tests.e2e.scoped import BARE_KEY, TEAM_A_KEY, ScopedStack, jwt, scoped_stack

pytestmark = pytest.mark.asyncio

FACT = "My locker code is 4417 and my locker is the blue zebra one"
OTHER = "The team's zebra standup is at nine"


async def _ws_call(stack: ScopedStack, key: str, method: str, params: dict[str, Any]) -> Any:
    url = stack.base_url.replace("http://", "ws://") + "/api/rpc"
    async with connect(
        url, proxy=None, additional_headers={"Authorization": f"Bearer {key}"}
    ) as ws:
        await ws.send(
            orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": method, "params": params}).decode()
        )
        return orjson.loads(await ws.recv())


async def test_a_key_lists_deletes_and_forgets_its_own_memories(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        assert (await stack.say("rest", TEAM_A_KEY, FACT, user="mia")).status == 200
        assert (await stack.say("rest", TEAM_A_KEY, OTHER)).status == 200
        assert (await stack.say("rest", BARE_KEY, "someone else's zebra")).status == 200

        # The key alone: its own un-narrowed episodes only.
        own = await stack.result(TEAM_A_KEY, "memory.list")
        assert [m["preview"] for m in own["memories"]] == [
            f"User: {OTHER} Assistant: reply to: {OTHER}"
        ]
        # Narrowed as the turn was: `user`, or the scope named in full.
        mia = await stack.result(TEAM_A_KEY, "memory.list", {"user": "mia"})
        [episode] = mia["memories"]
        assert "4417" in episode["preview"]
        named = await stack.result(TEAM_A_KEY, "memory.list", {"scope": "key:team-a/mia"})
        assert named["memories"] == mia["memories"]
        # Over the WebSocket, the key in the Authorization header.
        over_ws = await _ws_call(stack, TEAM_A_KEY, "memory.list", {"user": "mia"})
        assert over_ws["result"]["memories"] == mia["memories"]

        # mia's node is not in the key's own scope; in hers it is deleted.
        kept = await stack.result(TEAM_A_KEY, "memory.delete", {"node_id": episode["node_id"]})
        assert kept == {"deleted": False, "reason": "not_yours"}
        gone = await stack.result(
            TEAM_A_KEY, "memory.delete", {"node_id": episode["node_id"], "user": "mia"}
        )
        assert gone == {"deleted": True}
        assert all("4417" not in text for text in stack.stored_texts())
        assert await stack.result(TEAM_A_KEY, "memory.forget") == {
            "deleted": 1,
            "conversations": 0,
            "target": {"scope": "key:team-a"},
        }
        assert (await stack.result(TEAM_A_KEY, "memory.list"))["memories"] == []
        # The other key's episode is untouched.
        assert any("someone else's" in text for text in stack.stored_texts())


async def test_a_key_is_never_an_admin(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        for method, params in (
            ("memory.status", {}),
            ("memory.recall", {"query": "zebra"}),
            ("memory.list", {"scope": "alice"}),
            ("memory.list", {"scope": "key:team-a-not"}),
            ("memory.forget", {"scope": "key:other"}),
            ("memory.delete", {"node_id": "n-1", "scope": "alice"}),
        ):
            reply = await stack.rpc(TEAM_A_KEY, method, params)
            assert reply["error"]["code"] == -32007, (method, params)
            assert reply["error"]["data"] == {"code": "admin_required"}


async def test_a_key_chats_and_keeps_conversations_over_json_rpc(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        # A conversation made over REST with the key is the key's over JSON-RPC too.
        conversation = await stack.conversation(TEAM_A_KEY)
        said = await stack.say("rpc", TEAM_A_KEY, FACT, conversation_id=conversation)
        assert (said.status, said.memory) == (200, "disabled")
        assert "result" in said.body, said.body
        await stack.settle()
        # The same key recalls it on REST: one principal, key:team-a.
        again = await stack.say("rest", TEAM_A_KEY, "Which zebra locker is mine?")
        assert again.memory == "enabled" and "4417" in again.section
        stored = await stack.result(
            TEAM_A_KEY, "conversations.get", {"conversation_id": conversation}
        )
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]


@pytest.mark.parametrize(
    "params",
    [
        {"user": "mia", "scope": "key:team-a/mia"},
        {"user": 5},
        {"user": "tab\there"},
        {"user": "x" * 257},
    ],
)
async def test_a_bad_user_on_a_memory_method_is_invalid_params(
    tmp_path: Path, params: dict[str, Any]
) -> None:
    async with scoped_stack(tmp_path) as stack:
        for method in ("memory.list", "memory.forget"):
            reply = await stack.rpc(TEAM_A_KEY, method, params)
            assert reply["error"]["code"] == -32602, (method, reply)


async def test_an_unknown_key_or_open_rest_is_authentication_required(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        for bearer in ("key-nobody-has", TEAM_A_KEY[:-1]):
            reply = await stack.rpc(bearer, "memory.list")
            assert reply["error"]["code"] == -32005
    # With no keys configured there is no key to be: a bearer is a JWT or nothing.
    async with scoped_stack(tmp_path / "open", api_keys=()) as stack:
        reply = await stack.rpc(TEAM_A_KEY, "memory.list")
        assert reply["error"]["code"] == -32005


async def test_keys_work_without_a_jwt_secret_and_jwts_do_not(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, jwt_secret=None) as stack:
        assert (await stack.result(TEAM_A_KEY, "memory.list"))["memories"] == []
        reply = await stack.rpc(jwt("alice"), "memory.list")
        assert reply["error"]["code"] == -32005


async def test_in_shared_mode_a_key_holder_reads_the_status_as_any_caller(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, scope="shared") as stack:
        assert (await stack.say("rest", TEAM_A_KEY, FACT)).status == 200
        status = await stack.result(TEAM_A_KEY, "memory.status")
        assert status["scope"] == "shared"
        listed = await stack.result(TEAM_A_KEY, "memory.list")
        assert "4417" in listed["memories"][0]["preview"]
