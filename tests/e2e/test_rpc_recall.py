"""``memory.recall`` over JSON-RPC: what a turn would recall and inject, without a turn.

The real embedded store, the real gRPC service and the real HTTP layer on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from arona_grpc.scopes import scope_id
from tests.e2e.scoped import HEADER, jwt, scoped_stack

pytestmark = pytest.mark.asyncio

ALICE = jwt("alice")
BOB = jwt("bob")
ADMIN = jwt("ops", admin=True)
FACT = "My locker code is 4417 and my locker is the blue zebra one"
ASK = "Which zebra locker is mine, and its code?"


async def test_an_admin_sees_exactly_the_section_a_users_turn_would_inject(
    tmp_path: Path,
) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.say("rpc", ALICE, "I also keep a spare zebra key in the drawer")
        await stack.settle()

        recalled = await stack.result(ADMIN, "memory.recall", {"query": ASK, "scope": "alice"})
        assert recalled["state"] == "enabled"
        assert recalled["section"].startswith(HEADER + "\n")
        assert "4417" in recalled["section"]
        memories = recalled["memories"]
        assert memories and all(set(m) == {"text", "score", "node_type"} for m in memories)
        assert {m["node_type"] for m in memories} == {f"episode:{scope_id('alice')}"}
        scores = [m["score"] for m in memories]
        assert scores == sorted(scores, reverse=True)
        for m in memories:
            assert f"- [{m['score']:.2f}] " + m["text"].split("\n")[0] in recalled["section"]

        turn = await stack.say("rpc", ALICE, ASK)
        assert (turn.memory, turn.section) == ("enabled", recalled["section"])


async def test_the_limit_bounds_the_memories(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        for n in range(3):
            await stack.say("rpc", ALICE, f"zebra fact number {n}")
        await stack.settle()
        recalled = await stack.result(
            ADMIN, "memory.recall", {"query": "zebra fact", "scope": "alice", "limit": 1}
        )
        assert len(recalled["memories"]) == 1
        assert recalled["section"].count("\n- [") == 1


async def test_another_scope_recalls_nothing_of_alices(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        for params in ({"query": ASK, "scope": "bob"}, {"query": ASK}):
            # Bob's scope, then the admin's own (no scope named).
            recalled = await stack.result(ADMIN, "memory.recall", params)
            assert recalled == {"state": "disabled", "memories": [], "section": ""}


@pytest.mark.parametrize("params", [{"query": ASK}, {"query": ASK, "scope": "alice"}])
async def test_user_mode_needs_an_admin(tmp_path: Path, params: dict[str, Any]) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        events_before = len((await stack.result(ADMIN, "memory.status"))["events"])
        refused = await stack.rpc(ALICE, "memory.recall", params)
        assert refused["error"]["code"] == -32007
        assert refused["error"]["data"] == {"code": "admin_required"}
        # Nothing was asked of the memory service.
        assert len((await stack.result(ADMIN, "memory.status"))["events"]) == events_before


async def test_shared_mode_lets_any_jwt_holder_recall(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, scope="shared") as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        recalled = await stack.result(BOB, "memory.recall", {"query": ASK})
        assert recalled["state"] == "enabled" and "4417" in recalled["section"]
        turn = await stack.say("rpc", BOB, ASK)
        assert turn.section == recalled["section"]


async def test_without_a_token_it_is_authentication_required(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        response = await stack.http.post(
            "/api/rpc",
            json={"jsonrpc": "2.0", "id": 1, "method": "memory.recall", "params": {"query": "x"}},
        )
        assert response.json()["error"]["code"] == -32005


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"query": ""},
        {"query": 5},
        {"query": "tea", "limit": 0},
        {"query": "tea", "limit": 101},
        {"query": "tea", "limit": "5"},
        {"query": "tea", "scope": ""},
        {"query": "tea", "extra": True},
    ],
)
async def test_bad_params_are_invalid_params(tmp_path: Path, params: dict[str, Any] | None) -> None:
    async with scoped_stack(tmp_path) as stack:
        reply = await stack.rpc(ADMIN, "memory.recall", params)
        assert reply["error"]["code"] == -32602


async def test_a_stopped_store_is_offline_not_an_error(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, memory_timeout_s=1.0) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        await stack.store.stop()
        recalled = await stack.result(ADMIN, "memory.recall", {"query": ASK, "scope": "alice"})
        assert recalled == {"state": "offline", "memories": [], "section": ""}


async def test_recall_carries_the_grpc_token_of_a_guarded_service(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, grpc_token="a-grpc-token-for-the-memory-service") as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        recalled = await stack.result(ADMIN, "memory.recall", {"query": ASK, "scope": "alice"})
        assert recalled["state"] == "enabled" and "4417" in recalled["section"]
