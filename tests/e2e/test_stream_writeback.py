"""A streamed REST turn without a conversation, end to end over real uvicorn.

Such a turn is not written back (the seed's rule), and its response says so in
``X-Arona-Writeback``, as every REST chat answer says whether it is written back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.stack import ASK_TEXT, running_stack
from tests.support.fake_philia import STORE

pytestmark = pytest.mark.asyncio

ASK = [{"role": "user", "content": ASK_TEXT}]
SKIPPED = "skipped; reason=no_conversation_id"


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
        {"memory": False},
    ],
    ids=["writeback-false", "memory-not-configured"],
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
        # Off wins over skipped: no conversation would make these turns stored.
        assert [t.headers["X-Arona-Writeback"] for t in turns if t.headers] == ["off"] * 3
        await stack.drain_writebacks()
        assert stack.philia.frames_of(STORE) == []
