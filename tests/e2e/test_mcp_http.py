"""The memory tools over MCP Streamable HTTP at ``/mcp``, as an agent on the official MCP client
sees them: the real embedded store, the real gRPC service and the real HTTP layer on loopback,
with named and unnamed API keys and JWTs as bearers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.e2e.mcp_agent import bearer_headers, http_agent
from tests.e2e.scoped import BARE_KEY, HEADER, TEAM_A_KEY, jwt, scoped_stack
from tests.support.otlp_receiver import spans_in_memory

pytestmark = pytest.mark.asyncio

ALICE = jwt("alice")
ADMIN = jwt("ops", admin=True)
FACT = "my deploy key rotates on Fridays"
ASK = "when does my deploy key rotate?"


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


TOOLS = {"search_memories", "add_memory", "list_memories", "delete_memory", "forget_memories"}


async def test_the_tools_say_what_they_do_and_which_one_destroys(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, TEAM_A_KEY) as agent:
        tools = await agent.tools()
        assert set(tools) == TOOLS
        for tool in tools.values():
            assert tool.description and len(tool.description) > 80
            assert tool.input_schema["type"] == "object"
            assert tool.annotations is not None
        assert tools["search_memories"].input_schema["required"] == ["query"]
        assert tools["add_memory"].input_schema["required"] == ["text"]
        assert tools["delete_memory"].input_schema["required"] == ["node_id"]
        assert tools["forget_memories"].annotations.destructive_hint is True
        assert tools["delete_memory"].annotations.destructive_hint is True
        assert tools["search_memories"].annotations.read_only_hint is True
        assert tools["list_memories"].annotations.read_only_hint is True
        assert tools["add_memory"].annotations.destructive_hint is False


async def test_what_an_agent_adds_a_chat_turn_of_the_same_key_recalls(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, TEAM_A_KEY) as agent:
        added = await agent.ok("add_memory", {"text": FACT})
        assert added["stored"] is True and added["node_id"]
        await stack.settle()

        turn = await stack.say("rest", TEAM_A_KEY, ASK)
        assert turn.memory == "enabled"
        assert FACT in turn.section

        found = await agent.ok("search_memories", {"query": ASK})
        # What the turn was given, to the byte: the same ranking, floors and scope.
        assert found["state"] == "enabled"
        assert found["section"] == turn.section
        assert found["section"].startswith(HEADER + "\n")
        mine = [m for m in found["memories"] if FACT in m["text"]]
        assert [m["node_id"] for m in mine] == [added["node_id"]]
        assert all(0.0 <= m["score"] <= 1.0 for m in found["memories"])

        listed = await agent.ok("list_memories", {"contains": "on fridays"})
        assert [m["node_id"] for m in listed["memories"]] == [added["node_id"]]


async def test_what_a_chat_turn_said_is_found_by_search_and_list(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        await stack.say("rpc", ALICE, "I keep the budget spreadsheet in the green folder")
        await stack.say("rpc", ALICE, "the trip budget is 1200 euros")
        async with http_agent(stack.base_url, ALICE) as agent:
            # Read-your-write: the turns just answered are listed, newest first.
            listed = await agent.ok("list_memories", {"limit": 1})
            assert len(listed["memories"]) == 1
            assert "1200 euros" in listed["memories"][0]["preview"]
            assert listed["next"]
            older = await agent.ok("list_memories", {"limit": 1, "before": listed["next"]})
            assert "green folder" in older["memories"][0]["preview"]

            await stack.settle()
            found = await agent.ok("search_memories", {"query": "what is the trip budget?"})
            assert "1200 euros" in found["memories"][0]["text"]
            assert found["memories"][0]["node_id"] == listed["memories"][0]["node_id"]


async def test_two_keys_are_kept_apart(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        async with http_agent(stack.base_url, TEAM_A_KEY) as team_a:
            node_id = (await team_a.ok("add_memory", {"text": FACT}))["node_id"]
            await stack.settle()
            for other in (BARE_KEY, ALICE):
                async with http_agent(stack.base_url, other) as agent:
                    found = await agent.ok("search_memories", {"query": ASK})
                    assert found == {
                        "query": ASK,
                        "state": "disabled",
                        "memories": [],
                        "section": "",
                    }
                    assert (await agent.ok("list_memories"))["memories"] == []
                    refused = await agent.ok("delete_memory", {"node_id": node_id})
                    assert refused == {"deleted": False, "node_id": node_id, "reason": "not_yours"}
                    forgot = await agent.ok("forget_memories")
                    assert forgot["deleted"] == 0
            # Still there for its owner.
            listed = await team_a.ok("list_memories")
            assert [m["node_id"] for m in listed["memories"]] == [node_id]
            assert (await team_a.ok("search_memories", {"query": ASK}))["memories"]


async def test_delete_one_then_forget_everything(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, ALICE) as agent:
        kept = await agent.ok("add_memory", {"text": "the office wifi is called zebra-5"})
        gone = await agent.ok("add_memory", {"text": FACT})
        await stack.say("rpc", ALICE, "remember that my zebra plant needs water on Mondays")
        conversation = await stack.result(ALICE, "conversations.create", {"title": "t"})
        await stack.settle()

        deleted = await agent.ok("delete_memory", {"node_id": gone["node_id"]})
        assert deleted == {"deleted": True, "node_id": gone["node_id"]}
        again = await agent.ok("delete_memory", {"node_id": gone["node_id"]})
        assert again["deleted"] is False and again["reason"] == "not_yours"
        listed = await agent.ok("list_memories")
        assert gone["node_id"] not in [m["node_id"] for m in listed["memories"]]
        assert kept["node_id"] in [m["node_id"] for m in listed["memories"]]
        found = await agent.ok("search_memories", {"query": ASK})
        assert all(FACT not in m["text"] for m in found["memories"])

        forgot = await agent.ok("forget_memories")
        # The memory it added, and the chat turn's; and the conversation, as memory.forget.
        assert forgot == {"deleted": 2, "conversations": 1}
        assert (await agent.ok("list_memories"))["memories"] == []
        assert (await agent.ok("search_memories", {"query": "zebra"}))["memories"] == []
        turn = await stack.say("rpc", ALICE, "what is the office wifi called, zebra?")
        assert turn.memory == "disabled" and turn.section == ""
        gone_conversation = await stack.rpc(
            ALICE, "conversations.get", {"conversation_id": conversation["id"]}
        )
        assert "error" in gone_conversation


@pytest.mark.parametrize(
    "bearer",
    [None, "not-a-key", jwt("alice").replace(".", "x", 1), ALICE[:-4] + "AAAA"],
    ids=["none", "unknown key", "malformed jwt", "bad signature"],
)
async def test_no_valid_bearer_is_401_before_any_message_is_read(
    tmp_path: Path, bearer: str | None
) -> None:
    async with scoped_stack(tmp_path) as stack:
        # A body that is not even JSON: the answer comes before it is read.
        response = await stack.http.post(
            "/mcp",
            content=b"not json at all",
            headers={**bearer_headers(bearer), "content-type": "application/json"},
        )
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json() == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": -32005, "message": "Authentication required"},
        }
        # The official client hears it as the protocol's error, with the reason.
        with pytest.raises(Exception) as caught:
            async with http_agent(stack.base_url, bearer):
                pass
        assert [str(leaf) for leaf in _leaves(caught.value)] == ["Authentication required"]


async def test_a_key_and_a_jwt_are_bearers_and_the_per_request_protocol_works_too(
    tmp_path: Path,
) -> None:
    async with scoped_stack(tmp_path) as stack:
        async with httpx2.AsyncClient(headers=bearer_headers(ALICE), timeout=30.0) as http:
            # The SDK's Client as it connects by default: server/discover, then one POST a call.
            transport = streamable_http_client(stack.base_url + "/mcp", http_client=http)
            async with Client(transport, cache=None) as client:
                added = await client.call_tool("add_memory", {"text": FACT})
                assert not added.is_error
        await stack.settle()
        turn = await stack.say("rpc", ALICE, ASK)
        assert turn.memory == "enabled" and FACT in turn.section
        async with http_agent(stack.base_url, TEAM_A_KEY) as agent:
            assert (await agent.ok("search_memories", {"query": ASK}))["memories"] == []


@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("search_memories", {}, "query"),
        ("search_memories", {"query": ""}, "query"),
        ("search_memories", {"query": ASK, "limit": 0}, "limit"),
        ("search_memories", {"query": ASK, "limit": "5"}, "limit"),
        ("search_memories", {"query": ASK, "k": 3}, "k"),
        ("add_memory", {"text": 42}, "text"),
        ("add_memory", {}, "text"),
        ("list_memories", {"limit": 101}, "limit"),
        ("list_memories", {"before": "not-a-cursor"}, "before"),
        ("delete_memory", {"node_id": ""}, "node_id"),
        ("forget_memories", {"everything": True}, "everything"),
    ],
)
async def test_bad_arguments_are_tool_errors_and_change_nothing(
    tmp_path: Path, tool: str, arguments: dict[str, Any], field: str
) -> None:
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, ALICE) as agent:
        node_id = (await agent.ok("add_memory", {"text": FACT}))["node_id"]
        refused = await agent.refused(tool, arguments)
        assert refused["error"] == "invalid_arguments"
        assert field in refused["reason"]
        listed = await agent.ok("list_memories")
        assert [m["node_id"] for m in listed["memories"]] == [node_id]


async def test_an_unknown_tool_is_the_protocols_error(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, ALICE) as agent:
        with pytest.raises(MCPError, match="Unknown tool: remember_everything"):
            await agent.call("remember_everything", {})


async def test_a_section_alone_is_not_stored_and_one_inside_a_text_is_cut_out(
    tmp_path: Path,
) -> None:
    section = f"{HEADER}\n- [0.83] I prefer oolong tea"
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, ALICE) as agent:
        refused = await agent.refused("add_memory", {"text": section})
        assert refused["error"] == "nothing_to_store"
        await agent.ok("add_memory", {"text": f"{section}\n\nmy bike is the red one"})
        await stack.settle()
        assert any("my bike is the red one" in text for text in stack.stored_texts())
        assert not any("oolong" in text for text in stack.stored_texts())


async def test_a_store_down_is_a_tool_error_and_what_is_added_is_kept(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, ALICE) as agent:
        node_id = (await agent.ok("add_memory", {"text": FACT}))["node_id"]
        await stack.settle()
        await stack.store.stop()

        offline = await agent.refused("search_memories", {"query": ASK})
        assert offline["error"] == "memory_offline"
        queued = await agent.refused("add_memory", {"text": "the spare key is under the mat"})
        assert queued["error"] == "memory_offline" and "outbox" in queued["reason"]
        # Kept once, however often the agent tries again.
        await agent.refused("add_memory", {"text": "the spare key is under the mat"})
        status = await stack.result(ADMIN, "memory.status")
        assert status["outbox_depth"] == 1
        deleting = await agent.refused("delete_memory", {"node_id": node_id})
        assert deleting["error"] in ("unavailable", "timeout")
        # What memory held is still listed (the service's own index).
        listed = await agent.ok("list_memories")
        assert [m["node_id"] for m in listed["memories"]] == [node_id]


async def test_an_open_shared_gateway_takes_agents_without_a_bearer(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path, scope="shared", api_keys=()) as stack:
        async with http_agent(stack.base_url, None) as anonymous:
            node_id = (await anonymous.ok("add_memory", {"text": FACT}))["node_id"]
            await stack.settle()
            # The memory of REST's anonymous turns.
            turn = await stack.say("rest", None, ASK)
            assert turn.memory == "enabled" and FACT in turn.section
            listed = await anonymous.ok("list_memories")
            assert node_id in [m["node_id"] for m in listed["memories"]]
        async with http_agent(stack.base_url, ALICE) as alice:
            # Shared memory: recalled by everyone, deleted by its owner only.
            assert (await alice.ok("search_memories", {"query": ASK}))["memories"]
            refused = await alice.ok("delete_memory", {"node_id": node_id})
            assert refused == {"deleted": False, "node_id": node_id, "reason": "not_yours"}
            assert (await alice.ok("list_memories"))["memories"] == []


async def test_calls_are_counted_and_answered_with_a_request_id(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        async with http_agent(stack.base_url, ALICE) as agent:
            await agent.ok("add_memory", {"text": FACT})
            await agent.refused("search_memories", {"query": ""})
        response = await stack.http.post(
            "/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
            headers={
                **bearer_headers(ALICE),
                "accept": "application/json, text/event-stream",
                "x-request-id": "agent-request-0001",
            },
        )
        assert response.headers["x-request-id"] == "agent-request-0001"
        metrics = (await stack.http.get("/metrics")).text
        assert 'arona_mcp_tool_calls_total{outcome="ok",tool="add_memory"} 1.0' in metrics
        assert (
            'arona_mcp_tool_calls_total{outcome="client_error",tool="search_memories"} 1.0'
            in metrics
        )


async def test_a_lone_call_answers_as_the_sdk_does_on_either_protocol_revision(
    tmp_path: Path,
) -> None:
    """A lone handshake-era tools/call takes the endpoint's direct path, a per-request one the
    SDK's: the same answer either way."""
    envelope = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "0"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    base = {
        **bearer_headers(ALICE),
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
    }
    revisions = {
        "2025-11-25": ({"mcp-protocol-version": "2025-11-25"}, {}),
        "2026-07-28": (
            {
                "mcp-protocol-version": "2026-07-28",
                "mcp-method": "tools/call",
                "mcp-name": "search_memories",
            },
            {"_meta": envelope},
        ),
    }
    async with scoped_stack(tmp_path) as stack, http_agent(stack.base_url, ALICE) as agent:
        await agent.ok("add_memory", {"text": FACT})
        await stack.settle()
        answers: dict[str, Any] = {}
        for revision, (headers, extra) in revisions.items():
            for arguments in ({"query": ASK}, {"query": ""}):
                response = await stack.http.post(
                    "/mcp",
                    json={
                        "jsonrpc": "2.0",
                        "id": 5,
                        "method": "tools/call",
                        "params": {"name": "search_memories", "arguments": arguments, **extra},
                    },
                    headers={**base, **headers},
                )
                assert response.status_code == 200
                assert response.headers["content-type"] == "application/json"
                answer = response.json()
                assert answer["id"] == 5
                answer["result"].pop("_meta", None)
                answer["result"].pop("resultType", None)
                answers[f"{revision} {arguments['query'] or 'empty'}"] = answer
        assert answers[f"2025-11-25 {ASK}"] == answers[f"2026-07-28 {ASK}"]
        assert answers["2025-11-25 empty"] == answers["2026-07-28 empty"]
        assert answers["2025-11-25 empty"]["result"]["isError"] is True


async def test_a_tool_call_continues_the_agents_trace(tmp_path: Path) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {
        **bearer_headers(ALICE),
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": "2025-11-25",
        "traceparent": f"00-{trace_id}-{parent_id}-01",
    }
    with spans_in_memory() as exporter:
        async with scoped_stack(tmp_path) as stack:
            for arguments in ({"query": ASK}, {"query": ASK, "limit": 0}):
                response = await stack.http.post(
                    "/mcp",
                    json={
                        "jsonrpc": "2.0",
                        "id": 1,
                        "method": "tools/call",
                        "params": {"name": "search_memories", "arguments": arguments},
                    },
                    headers=headers,
                )
                assert response.status_code == 200
        spans = exporter.get_finished_spans()
    calls = [s for s in spans if s.name == "tools/call search_memories"]
    assert len(calls) == 2
    for span in calls:
        assert format(span.context.trace_id, "032x") == trace_id
        assert span.parent is not None and format(span.parent.span_id, "016x") == parent_id
        assert span.kind.name == "SERVER"
        assert span.attributes["gen_ai.tool.name"] == "search_memories"
    searched, refused = calls
    recalls = [
        s
        for s in spans
        if s.name == "arona.memory.v1.MemoryService/Recall"
        and s.kind.name == "CLIENT"
        and s.parent is not None
        and s.parent.span_id == searched.context.span_id
    ]
    assert len(recalls) == 1
    assert searched.status.status_code.name == "UNSET"
    assert refused.status.status_code.name == "ERROR"
    assert refused.attributes["error.type"] == "client_error"
