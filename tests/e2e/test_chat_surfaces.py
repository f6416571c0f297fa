"""Every chat surface end to end: recall and injection, memory states, writeback.

REST JSON, REST SSE, ``chat.send`` over HTTP and over WebSocket each run
against the real gRPC service, a scripted Philia and a recording upstream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import ASK_TEXT, SURFACES, running_stack
from tests.support.fake_philia import QUERY, STORE, Step
from tests.support.fake_upstream import Stream
from tests.support.raw_philia import closed_port

pytestmark = pytest.mark.asyncio

HEADER = "## Relevant Long-Term Memories"
MEMORIES = [
    {"node_type": "episode", "text": "I prefer oolong tea", "score": 0.834},
    {"node_type": "entity", "text": "   ", "score": 0.6},
    {"node_type": "episode", "text": "User: where do I live?\nAssistant: In Lyon.", "score": 0.41},
]
SECTION = (
    "## Relevant Long-Term Memories\n"
    "- [0.83] I prefer oolong tea\n"
    "- [0.41] User: where do I live?\n"
    "  Assistant: In Lyon."
)
ASK = [{"role": "user", "content": ASK_TEXT}]


@pytest.mark.parametrize("surface", SURFACES)
async def test_recalled_memories_are_injected_exactly(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "enabled")
        assert turn.content == "reply to: what tea do I like?"
        sent = stack.upstream.last_body["messages"]
        assert sent == [{"role": "system", "content": SECTION}, *ASK]
        [query] = stack.philia.frames_of(QUERY)
        # Shared scope mode: the wire is exactly the seed's, no node_type_filter.
        assert query["params"] == {"query": "what tea do I like?", "limit": 5}


@pytest.mark.parametrize("surface", SURFACES)
async def test_memory_true_override_recalls_and_content_parts_are_the_query(
    tmp_path: Path, surface: str
) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        parts = [
            {"role": "user", "content": "earlier question"},
            {"role": "assistant", "content": "earlier answer"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what tea"},
                    {"type": "text", "text": "do I like?"},
                ],
            },
        ]
        turn = await stack.turn(surface, parts, memory=True)
        assert turn.memory == "enabled"
        assert stack.philia.frames_of(QUERY)[0]["params"]["query"] == "what tea\ndo I like?"
        assert stack.upstream.last_body["messages"][0]["content"] == SECTION


@pytest.mark.parametrize("surface", SURFACES)
async def test_not_configured_is_disabled_and_never_connects(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, memory=False) as stack:
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "disabled")
        assert stack.upstream.last_body["messages"] == ASK
        assert stack.philia.upgrades == []


@pytest.mark.parametrize("surface", SURFACES)
async def test_memory_false_skips_recall(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        turn = await stack.turn(surface, ASK, memory=False)
        assert (turn.status, turn.memory) == (200, "disabled")
        assert stack.upstream.last_body["messages"] == ASK
        assert stack.philia.frames_of(QUERY) == []


@pytest.mark.parametrize("surface", SURFACES)
async def test_no_user_message_is_disabled(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        only_system = [{"role": "system", "content": "You are terse."}]
        turn = await stack.turn(surface, only_system)
        assert (turn.status, turn.memory) == (200, "disabled")
        assert stack.philia.frames_of(QUERY) == []
        assert stack.upstream.last_body["messages"] == only_system


@pytest.mark.parametrize("surface", SURFACES)
async def test_nothing_recalled_is_disabled_and_turn_unchanged(
    tmp_path: Path, surface: str
) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = [{"node_type": "episode", "text": "  \n ", "score": 0.9}]
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "disabled")
        assert len(stack.philia.frames_of(QUERY)) == 1
        assert stack.upstream.last_body["messages"] == ASK


@pytest.mark.parametrize("surface", SURFACES)
async def test_injection_is_idempotent(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        already = [{"role": "system", "content": SECTION}, *ASK]
        turn = await stack.turn(surface, already)
        assert (turn.status, turn.memory) == (200, "disabled")
        assert stack.philia.frames_of(QUERY) == []
        assert stack.upstream.last_body["messages"] == already


@pytest.mark.parametrize("surface", SURFACES)
async def test_a_message_quoting_the_section_does_not_stop_recall(
    tmp_path: Path, surface: str
) -> None:
    # An assistant reply that repeated its section (the echo model does), a user pasting
    # one: neither is the gateway's own system section, so the turn still recalls.
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        quoting = [
            {"role": "user", "content": f"look at this:\n{SECTION}"},
            {"role": "assistant", "content": f"Echo: earlier\n\n{SECTION}"},
            *ASK,
        ]
        turn = await stack.turn(surface, quoting)
        assert (turn.status, turn.memory) == (200, "enabled")
        assert len(stack.philia.frames_of(QUERY)) == 1
        assert stack.upstream.last_body["messages"] == [
            {"role": "system", "content": SECTION},
            *quoting,
        ]


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("fault", ["refused", "rpc_error", "timeout"])
async def test_recall_failure_is_offline_and_chat_still_answers(
    tmp_path: Path, surface: str, fault: str
) -> None:
    async with running_stack(tmp_path, timeout_s=0.3) as stack:
        stack.philia.memories = list(MEMORIES)
        if fault == "refused":
            await stack.philia.stop()
        elif fault == "rpc_error":
            stack.philia.script(QUERY, Step(error=(-32603, "stalled handler")))
        else:
            stack.philia.script(QUERY, Step(action="hang"))
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "offline")
        assert turn.content == "reply to: what tea do I like?"
        assert stack.upstream.last_body["messages"] == ASK


@pytest.mark.parametrize("surface", SURFACES)
async def test_unreachable_grpc_service_is_offline(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path, grpc_target=f"127.0.0.1:{closed_port()}") as stack:
        turn = await stack.turn(surface, ASK)
        assert (turn.status, turn.memory) == (200, "offline")
        assert turn.content == "reply to: what tea do I like?"


@pytest.mark.parametrize("surface", ["rest", "rpc", "rpc_ws"])
async def test_turn_is_written_back_as_an_episode(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        turn = await stack.turn(surface, ASK, memory=False)
        assert turn.status == 200
        [store] = await stack.philia.wait_frames(STORE)
        # Shared scope mode: exactly the seed's params.
        assert store["params"] == {
            "text": "User: what tea do I like?\nAssistant: reply to: what tea do I like?",
            "node_type": "episode",
        }


async def test_sse_writes_back_only_with_a_conversation(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        first = await stack.turn("sse", [{"role": "user", "content": "no conversation"}])
        assert first.status == 200
        conversation = await stack.create_conversation("sse")
        second = await stack.turn(
            "sse", [{"role": "user", "content": "with one"}], conversation_id=conversation
        )
        assert second.status == 200
        stores = await stack.philia.wait_frames(STORE)
        # The turn without a conversation was finished first; had it been
        # written back, its episode would be here too.
        assert [s["params"]["text"] for s in stores] == [
            "User: with one\nAssistant: reply to: with one"
        ]


async def test_failed_stream_writes_nothing_back(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        conversation = await stack.create_conversation("sse")
        stack.upstream.script(
            Stream(pieces=["half ", "an ", "answer"], pause_after=None, end="break")
        )
        broken = await stack.turn("sse", ASK, conversation_id=conversation)
        assert broken.status == 200
        assert broken.events[-1] == "[DONE]"
        error = broken.events[-2]
        assert error["error"]["code"] == "upstream_error"
        ok = await stack.turn("rest", [{"role": "user", "content": "next"}])
        assert ok.status == 200
        stores = await stack.philia.wait_frames(STORE)
        assert [s["params"]["text"] for s in stores] == ["User: next\nAssistant: reply to: next"]


async def test_writeback_false_stores_nothing(tmp_path: Path) -> None:
    async with running_stack(tmp_path, memory_writeback=False) as stack:
        stack.philia.memories = list(MEMORIES)
        turn = await stack.turn("rest", ASK)
        assert turn.memory == "enabled"
        status = await stack.rpc("memory.status")
        assert status["result"]["writeback"] is False
        # Recall still ran (it is not gated by writeback), and nothing was stored.
        assert [e["kind"] for e in status["result"]["events"]] == ["recall"]
        assert stack.philia.frames_of(STORE) == []


async def test_writeback_failure_never_alters_the_reply(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.script(STORE, Step(error=(-32603, "disk full")))
        turn = await stack.turn("rest", ASK)
        assert (turn.status, turn.content) == (200, "reply to: what tea do I like?")
        await stack.philia.wait_frames(STORE)
        status = await stack.rpc("memory.status")
        kinds = [e["kind"] for e in status["result"]["events"]]
        assert "error" in kinds


@pytest.mark.parametrize("surface", ["rest", "sse", "rpc"])
async def test_conversation_history_is_put_before_the_new_turn(
    tmp_path: Path, surface: str
) -> None:
    async with running_stack(tmp_path) as stack:
        conversation = await stack.create_conversation(surface)
        await stack.turn(
            surface,
            [{"role": "user", "content": "hello"}],
            conversation_id=conversation,
            memory=False,
        )
        await stack.turn(
            surface,
            [{"role": "user", "content": "again"}],
            conversation_id=conversation,
            memory=False,
        )
        assert stack.upstream.last_body["messages"] == [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "reply to: hello"},
            {"role": "user", "content": "again"},
        ]


@pytest.mark.parametrize("surface", ["rest", "sse", "rpc"])
async def test_unknown_and_foreign_conversations_are_refused(tmp_path: Path, surface: str) -> None:
    async with running_stack(tmp_path) as stack:
        missing = await stack.turn(surface, ASK, conversation_id="no-such-conversation")
        theirs = await stack.create_conversation("rest" if surface.startswith("rpc") else "rpc")
        foreign = await stack.turn(surface, ASK, conversation_id=theirs)
        if surface.startswith("rpc"):
            assert missing.body["error"]["data"]["code"] == "conversation_not_found"
            assert foreign.body["error"]["data"]["code"] == "conversation_forbidden"
        else:
            assert (missing.status, missing.body["error"]["code"]) == (
                404,
                "conversation_not_found",
            )
            assert (foreign.status, foreign.body["error"]["code"]) == (
                403,
                "conversation_forbidden",
            )
        assert stack.upstream.chat_requests == []


async def test_ws_chat_send_pushes_tokens_before_the_result(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        turn = await stack.turn("rpc_ws", ASK)
        pushes: list[dict[str, Any]] = [e["params"] for e in turn.events]
        assert {e["method"] for e in turn.events} == {"chat.stream"}
        assert pushes[-1]["is_complete"] is True
        assert "".join(p["token"] for p in pushes) == turn.content
        assert len(pushes) > 2
        assert {p["stream_id"] for p in pushes} == {turn.body["result"]["stream_id"]}
        assert turn.body["result"]["finish_reason"] == "stop"
