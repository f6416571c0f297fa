"""Memory that belongs to its user (``ARONA_MEMORY_SCOPE=user``), end to end.

Every test runs the real embedded store, the real gRPC service and the real HTTP layer on
loopback, and speaks as several people: JWT holders on REST and JSON-RPC, named and unnamed
API keys, the OpenAI ``user`` field, an admin.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.episodes import preview_of
from arona_grpc.scopes import scope_id
from gateway_http.auth import parse_key_entry
from tests.e2e.scoped import BARE_KEY, HEADER, SURFACES, TEAM_A_KEY, jwt, scoped_stack

pytestmark = pytest.mark.asyncio

ALICE = jwt("alice")
BOB = jwt("bob")
ADMIN = jwt("ops", admin=True)
FACT = "My locker code is 4417 and my locker is the blue zebra one"
ASK = "Which zebra locker is mine, and its code?"


@pytest.mark.parametrize("surface", SURFACES)
async def test_one_users_fact_never_reaches_another_user(tmp_path: Path, surface: str) -> None:
    async with scoped_stack(tmp_path) as stack:
        conversations: dict[str, str | None] = {"alice": None, "bob": None}
        if surface == "sse":
            # The streaming path writes back only with a conversation.
            conversations = {"alice": await stack.conversation(ALICE), "bob": None}
            conversations["bob"] = await stack.conversation(BOB)
        said = await stack.say(surface, ALICE, FACT, conversation_id=conversations["alice"])
        assert said.status == 200
        await stack.settle()
        assert any("4417" in text for text in stack.stored_texts())

        bob = await stack.say(surface, BOB, ASK, conversation_id=conversations["bob"])
        assert (bob.status, bob.memory, bob.section) == (200, "disabled", "")
        alice = await stack.say(surface, ALICE, ASK, conversation_id=conversations["alice"])
        assert (alice.status, alice.memory) == (200, "enabled")
        assert "4417" in alice.section

        bob_list = await stack.result(BOB, "memory.list")
        assert all("4417" not in m["preview"] for m in bob_list["memories"])
        alice_list = await stack.result(ALICE, "memory.list")
        assert any("4417" in m["preview"] for m in alice_list["memories"])


async def test_rest_with_a_jwt_and_json_rpc_are_one_person(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        assert (await stack.say("rest", ALICE, FACT)).status == 200
        await stack.settle()
        over_rpc = await stack.say("rpc_ws", ALICE, ASK)
        assert over_rpc.memory == "enabled" and "4417" in over_rpc.section
        # The conversation a JWT holder makes over REST is theirs over JSON-RPC too.
        conversation = await stack.conversation(ALICE)
        reply = await stack.result(ALICE, "conversations.get", {"conversation_id": conversation})
        assert reply["id"] == conversation


async def test_api_keys_are_principals_and_the_user_field_narrows(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rest", TEAM_A_KEY, FACT, user="u1")
        await stack.settle()
        # The same key for another of its users, the key alone, and another key: nothing.
        for bearer, user in ((TEAM_A_KEY, "u2"), (TEAM_A_KEY, None), (BARE_KEY, "u1")):
            said = await stack.say("rest", bearer, ASK, user=user)
            assert (said.status, said.memory, said.section) == (200, "disabled", ""), user
        said = await stack.say("sse", TEAM_A_KEY, ASK, user="u1")
        assert said.memory == "enabled" and "4417" in said.section
        # The user field still reaches the upstream untouched.
        assert stack.upstream.last_body["user"] == "u1"
        # The store sees scope ids, never the key, its name or the user.
        for text in stack.stored_texts():
            assert TEAM_A_KEY not in text
        status = await stack.result(ADMIN, "memory.status")
        scopes = {e["scope_id"] for e in status["events"] if e["kind"] == "writeback"}
        bare = parse_key_entry(BARE_KEY)[0]
        assert bare.startswith("key:") and BARE_KEY not in bare
        expected = ("key:team-a/u1", "key:team-a/u2", "key:team-a", f"{bare}/u1")
        assert scopes == {scope_id(scope) for scope in expected}
        # An admin reaches a key user's episodes by the scope name.
        listed = await stack.result(ADMIN, "memory.list", {"scope": "key:team-a/u1"})
        assert [m["preview"] for m in listed["memories"]][-1:] == [
            preview_of(f"User: {FACT}\nAssistant: reply to: {FACT}")
        ]


async def test_only_the_owner_or_an_admin_deletes_an_episode(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        [mine] = (await stack.result(ALICE, "memory.list"))["memories"]
        node_id = mine["node_id"]
        # Bob's delete of Alice's node: false, and Philia is not asked. Whether an id is
        # another's or nobody's, Bob only learns that it is not his.
        not_his = {"deleted": False, "reason": "not_yours"}
        assert await stack.result(BOB, "memory.delete", {"node_id": node_id}) == not_his
        assert await stack.result(BOB, "memory.delete", {"node_id": "no-such-node"}) == not_his
        refused = await stack.rpc(BOB, "memory.delete", {"node_id": node_id, "scope": "alice"})
        assert refused["error"]["code"] == -32007
        assert "4417" in (await stack.say("rest", ALICE, ASK, memory=True)).section
        # An admin may.
        done = await stack.result(ADMIN, "memory.delete", {"node_id": node_id, "scope": "alice"})
        assert done == {"deleted": True}
        await stack.settle()
        assert "4417" not in (await stack.say("rest", ALICE, ASK)).section
        assert all(
            m["node_id"] != node_id for m in (await stack.result(ALICE, "memory.list"))["memories"]
        )
        assert all("4417" not in text for text in stack.stored_texts())


async def test_forget_removes_all_of_one_users_episodes_and_none_of_anothers(
    tmp_path: Path,
) -> None:
    async with scoped_stack(tmp_path) as stack:
        for i in range(3):
            await stack.say("rpc", ALICE, f"zebra fact number {i} of alice")
        for i in range(2):
            await stack.say("rpc", BOB, f"zebra fact number {i} of bob")
        await stack.settle()
        refused = await stack.rpc(BOB, "memory.forget", {"scope": "alice"})
        assert refused["error"]["code"] == -32007
        assert await stack.result(ALICE, "memory.forget") == {
            "deleted": 3,
            "conversations": 0,
            "target": {"scope": "alice"},
        }
        assert (await stack.result(ALICE, "memory.list"))["memories"] == []
        assert len((await stack.result(BOB, "memory.list"))["memories"]) == 2
        assert sorted(stack.stored_texts()) == [
            f"User: zebra fact number {i} of bob\nAssistant: reply to: zebra fact number {i} of bob"
            for i in range(2)
        ]
        # Safe to say again: nothing left to delete.
        assert await stack.result(ALICE, "memory.forget") == {
            "deleted": 0,
            "conversations": 0,
            "target": {"scope": "alice"},
        }
        assert (await stack.say("rest", ALICE, "zebra fact?")).memory == "disabled"
        assert (await stack.say("rest", BOB, "zebra fact?")).memory == "enabled"
        await stack.settle()
        # An admin forgets for another (Bob's two facts and his question).
        assert await stack.result(ADMIN, "memory.forget", {"scope": "bob"}) == {
            "deleted": 3,
            "conversations": 0,
            "target": {"scope": "bob"},
        }
        assert [t for t in stack.stored_texts() if "bob" in t] == []


async def test_list_pages_newest_first(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        for i in range(5):
            await stack.say("rpc", ALICE, f"note {i}")
            await stack.settle()
        seen: list[str] = []
        before = None
        for expected in (2, 2, 1):
            params: dict[str, object] = {"limit": 2}
            if before is not None:
                params["before"] = before
            page = await stack.result(ALICE, "memory.list", params)
            assert len(page["memories"]) == expected
            seen += [m["preview"] for m in page["memories"]]
            before = page["next"]
        assert before is None
        assert seen == [f"User: note {i} Assistant: reply to: note {i}" for i in (4, 3, 2, 1, 0)]
        assert all(m["at"].endswith("Z") for m in page["memories"])
        bad = await stack.rpc(ALICE, "memory.list", {"before": "not-a-cursor"})
        assert bad["error"]["code"] == -32602
        for limit in (0, 101):
            bad = await stack.rpc(ALICE, "memory.list", {"limit": limit})
            assert bad["error"]["code"] == -32602


async def test_a_turn_without_a_principal_gets_no_memory(tmp_path: Path) -> None:
    # REST open (no keys): a caller with no bearer, or one that is not a valid JWT, is nobody.
    async with scoped_stack(tmp_path, api_keys=()) as stack:
        await stack.say("rest", ALICE, FACT)
        await stack.settle()
        stored = stack.stored_texts()
        for bearer in (None, "not-a-jwt"):
            said = await stack.say("rest", bearer, ASK)
            assert (said.status, said.memory, said.section) == (200, "disabled", "")
            said = await stack.say("rest", bearer, "Remember that I like figs")
            assert said.status == 200
        await stack.settle()
        assert stack.stored_texts() == stored
        status = await stack.result(ADMIN, "memory.status")
        # Only Alice's own turn recalled; the turns of nobody never asked.
        assert [e["detail"] for e in status["events"] if e["kind"] == "recall"] == [FACT]
        # The same open REST with a valid JWT is that person.
        assert (await stack.say("rest", ALICE, ASK)).memory == "enabled"


async def test_status_needs_an_admin_in_user_mode(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        refused = await stack.rpc(ALICE, "memory.status")
        assert refused["error"]["code"] == -32007
        assert refused["error"]["data"] == {"code": "admin_required"}
        status = await stack.result(ADMIN, "memory.status")
        assert status["scope"] == "user"
        [writeback] = [e for e in status["events"] if e["kind"] == "writeback"]
        # Status events carry the scope id, never the scope's name.
        assert writeback["scope_id"] == scope_id("alice")
        assert "alice" not in str(status)


@pytest.mark.parametrize("user", [5, ["a"], "x" * 257, "tab\there", "nul\x00", "del\x7f", "c1\x85"])
async def test_a_bad_user_field_is_refused_and_nothing_happens(
    tmp_path: Path, user: object
) -> None:
    async with scoped_stack(tmp_path) as stack:
        said = await stack.say("rest", ALICE, FACT, user=user)
        assert said.status == 400
        assert said.body["error"]["type"] == "invalid_request_error"
        assert "'user'" in said.body["error"]["message"]
        reply = await stack.rpc(
            ALICE,
            "chat.send",
            {"model": "fake-model", "messages": [{"role": "user", "content": FACT}], "user": user},
        )
        assert reply["error"]["code"] == -32602
        await stack.settle()
        assert stack.stored_texts() == []
        assert stack.upstream.chat_requests == []


async def test_an_unknown_key_is_401_and_changes_nothing(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        for bearer in ("key-nobody-has", jwt("mallory")[:-4] + "AAAA", None):
            said = await stack.say("rest", bearer, FACT)
            assert said.status == 401
            assert said.body["error"]["code"] == "invalid_api_key"
        await stack.settle()
        assert stack.stored_texts() == []


async def test_grpc_callers_name_the_scope(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        async with grpc.aio.insecure_channel(stack.grpc.target) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            for call in (
                stub.Recall(pb.RecallRequest(query="zebra")),
                stub.Writeback(pb.WritebackRequest(user="hi", assistant="there")),
                stub.List(pb.ListRequest()),
                stub.Forget(pb.ForgetRequest()),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stored = await stub.Writeback(
                pb.WritebackRequest(user=FACT, assistant="noted", scope="svc:alice")
            )
            assert stored.stored
            other = await stub.Recall(pb.RecallRequest(query=ASK, scope="svc:bob"))
            assert other.state == pb.MEMORY_STATE_DISABLED and not other.memories
            own = await stub.Recall(pb.RecallRequest(query=ASK, scope="svc:alice"))
            assert own.state == pb.MEMORY_STATE_ENABLED and "4417" in own.section
            # Another scope's delete is false and leaves it; the owner's removes it.
            other_delete = await stub.Delete(
                pb.DeleteRequest(node_id=stored.node_id, scope="svc:bob")
            )
            assert (other_delete.deleted, other_delete.reason) == (False, "other_scope")
            listed = await stub.List(pb.ListRequest(scope="svc:alice"))
            assert [e.node_id for e in listed.episodes] == [stored.node_id]
            assert (await stub.Forget(pb.ForgetRequest(scope="svc:alice"))).deleted == 1
            gone = await stub.Recall(pb.RecallRequest(query=ASK, scope="svc:alice"))
            assert gone.state == pb.MEMORY_STATE_DISABLED


async def test_echo_turns_never_store_a_memory_section(tmp_path: Path) -> None:
    # The echo model's replies show the section it was given: stored as they are, each turn
    # would nest the last one's memories into the next episode.
    async with scoped_stack(tmp_path, echo=True) as stack:
        await stack.say("rest", ALICE, FACT)
        await stack.settle()
        for _ in range(3):
            said = await stack.say("rest", ALICE, ASK)
            assert said.memory == "enabled" and HEADER in said.content
            await stack.settle()
        texts = stack.stored_texts()
        assert len(texts) == 2  # the fact, and the question asked three times (one node)
        assert all(HEADER not in text and "- [" not in text for text in texts), texts


async def test_shared_mode_lists_and_forgets_the_callers_own(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, scope="shared") as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        # One pool: Bob recalls Alice's fact, and anyone may read the status.
        assert (await stack.say("rpc", BOB, ASK)).memory == "enabled"
        assert (await stack.result(BOB, "memory.status"))["scope"] == "shared"
        [mine] = (await stack.result(ALICE, "memory.list"))["memories"]
        assert "4417" in mine["preview"]
        assert all(
            "4417" not in m["preview"] for m in (await stack.result(BOB, "memory.list"))["memories"]
        )
        # As the seed says, any JWT holder may delete any node in shared mode.
        assert await stack.result(BOB, "memory.delete", {"node_id": mine["node_id"]}) == {
            "deleted": True
        }
        assert (await stack.result(ALICE, "memory.list"))["memories"] == []


async def test_an_admin_deletes_any_indexed_node_by_its_id(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, FACT)
        await stack.say("rest", TEAM_A_KEY, "The zebra parking spot is 12", user="mia")
        await stack.say("rpc", ADMIN, "The zebra server room code is 0000")
        await stack.settle()
        [alices] = (await stack.result(ADMIN, "memory.list", {"scope": "alice"}))["memories"]
        [mias] = (await stack.result(ADMIN, "memory.list", {"scope": "key:team-a/mia"}))["memories"]
        [own] = (await stack.result(ADMIN, "memory.list"))["memories"]

        # The id alone, as just listed: the index says whose it is.
        deleted = await stack.result(ADMIN, "memory.delete", {"node_id": alices["node_id"]})
        assert deleted == {"deleted": True}
        assert all("4417" not in text for text in stack.stored_texts())
        assert (await stack.result(ALICE, "memory.list"))["memories"] == []
        assert (await stack.say("rest", ALICE, ASK)).memory == "disabled"
        assert await stack.result(ADMIN, "memory.delete", {"node_id": own["node_id"]}) == {
            "deleted": True
        }
        # A refusal says why, without asking Philia.
        for node_id in (alices["node_id"], "no-such-node"):
            again = await stack.result(ADMIN, "memory.delete", {"node_id": node_id})
            assert again == {"deleted": False, "reason": "not_indexed"}
        named = await stack.result(
            ADMIN, "memory.delete", {"node_id": mias["node_id"], "scope": "alice"}
        )
        assert named == {"deleted": False, "reason": "other_scope"}
        status = await stack.result(ADMIN, "memory.status")
        deletes = [e for e in status["events"] if e["kind"] == "delete"]
        # Each delete event names the owner's scope id, not the admin's.
        assert [e["scope_id"] for e in deletes] == [scope_id("ops"), scope_id("alice")]

        # gRPC: a Delete without a scope is the same delete by id.
        async with grpc.aio.insecure_channel(stack.grpc.target) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            by_id = await stub.Delete(pb.DeleteRequest(node_id=mias["node_id"]))
            assert (by_id.deleted, by_id.reason) == (True, "")
            unknown = await stub.Delete(pb.DeleteRequest(node_id=mias["node_id"]))
            assert (unknown.deleted, unknown.reason) == (False, "not_indexed")
        assert all("parking" not in text for text in stack.stored_texts())
        assert (await stack.result(TEAM_A_KEY, "memory.list", {"user": "mia"}))["memories"] == []
