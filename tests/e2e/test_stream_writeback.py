"""A streamed REST turn without a conversation, end to end over real uvicorn.

By default (the seed's rule) such a turn is not written back, and its response says so in
``X-Arona-Writeback``; with ``ARONA_MEMORY_STREAM_WRITEBACK=true`` it is written back once its
stream has ended, and a later turn recalls it from the embedded store. A failed or cancelled
stream writes nothing back either way.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.scoped import TEAM_A_KEY, scoped_stack
from tests.e2e.stack import ASK_TEXT, running_stack
from tests.support.fake_philia import STORE
from tests.support.fake_upstream import Stream

pytestmark = pytest.mark.asyncio

ASK = [{"role": "user", "content": ASK_TEXT}]
SKIPPED = "skipped; reason=no_conversation_id"
FACT = "My locker code is 4417 and my locker is the blue zebra one"
QUESTION = "Which zebra locker is mine?"


async def test_the_writeback_header_says_what_becomes_of_each_rest_turn(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        streamed = await stack.turn("sse", [{"role": "user", "content": "no conversation"}])
        assert streamed.status == 200 and streamed.headers is not None
        assert streamed.headers["X-Arona-Writeback"] == SKIPPED
        conversation = await stack.create_conversation("sse")
        attached = await stack.turn(
            "sse", [{"role": "user", "content": "with one"}], conversation_id=conversation
        )
        assert attached.headers is not None and attached.headers["X-Arona-Writeback"] == "on"
        # A whole (JSON) answer is written back without a conversation, whatever `memory` says.
        whole = await stack.turn("rest", [{"role": "user", "content": "json"}], memory=False)
        assert whole.headers is not None and whole.headers["X-Arona-Writeback"] == "on"
        await stack.drain_writebacks()
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            "User: with one\nAssistant: reply to: with one",
            "User: json\nAssistant: reply to: json",
        ]


@pytest.mark.parametrize(
    "overrides",
    [
        {"memory_writeback": False},
        {"memory_writeback": False, "memory_stream_writeback": True},
        {"memory": False},
    ],
    ids=["writeback-false", "writeback-false-stream-true", "memory-not-configured"],
)
async def test_off_when_the_memory_service_stores_no_writebacks(
    tmp_path: Path, overrides: dict[str, bool]
) -> None:
    async with running_stack(tmp_path, **overrides) as stack:
        conversation = await stack.create_conversation("sse")
        turns = [
            await stack.turn("sse", ASK),
            await stack.turn("sse", ASK, conversation_id=conversation),
            await stack.turn("rest", ASK),
        ]
        # Off wins over skipped: no setting of the client's would make these turns stored.
        assert [t.headers["X-Arona-Writeback"] for t in turns if t.headers] == ["off"] * 3
        await stack.drain_writebacks()
        assert stack.philia.frames_of(STORE) == []


@pytest.mark.parametrize(
    ("stream_writeback", "header"), [(False, SKIPPED), (True, "on")], ids=["default", "on"]
)
async def test_a_streamed_turn_without_a_conversation_is_recalled_only_when_set(
    tmp_path: Path, stream_writeback: bool, header: str
) -> None:
    async with scoped_stack(
        tmp_path, scope="shared", memory_stream_writeback=stream_writeback
    ) as stack:
        told = await stack.say("sse", TEAM_A_KEY, FACT)
        assert told.status == 200 and told.headers is not None
        assert told.headers["X-Arona-Writeback"] == header
        await stack.settle()
        asked = await stack.say("rest", TEAM_A_KEY, QUESTION)
        assert asked.status == 200
        await stack.settle()
        question_turn = f"User: {QUESTION}\nAssistant: reply to: {QUESTION}"
        if stream_writeback:
            # The user message and the reply as streamed, recalled by the next turn.
            assert (asked.memory, "4417" in asked.section) == ("enabled", True)
            assert stack.stored_texts() == [
                f"User: {FACT}\nAssistant: reply to: {FACT}",
                question_turn,
            ]
        else:
            assert (asked.memory, asked.section) == ("disabled", "")
            assert stack.stored_texts() == [question_turn]


async def test_with_the_setting_a_failed_or_cancelled_stream_still_writes_nothing(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path, memory_stream_writeback=True) as stack:
        stack.upstream.script(Stream(pieces=["half ", "an ", "answer"], end="break"))
        broken = await stack.turn("sse", [{"role": "user", "content": "broken"}])
        assert broken.headers is not None and broken.headers["X-Arona-Writeback"] == "on"
        assert broken.events[-2]["error"]["code"] == "upstream_error"

        reply = Stream(pieces=["a ", "b ", "c"], pause_after=1)
        stack.upstream.script(reply)
        body = {"model": "m", "messages": [{"role": "user", "content": "left"}], "stream": True}
        async with stack.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.headers["X-Arona-Writeback"] == "on"
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
            await asyncio.wait_for(reply.paused.wait(), 5)
        # Leaving the block closed the connection mid-stream.
        await asyncio.wait_for(reply.closed.wait(), 5)

        whole = await stack.turn("sse", [{"role": "user", "content": "whole"}])
        assert whole.headers is not None and whole.headers["X-Arona-Writeback"] == "on"
        await stack.drain_writebacks()
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            "User: whole\nAssistant: reply to: whole"
        ]
