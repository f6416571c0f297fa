"""A conversation with the ``echo`` model keeps recalling, turn after turn, end to end.

The echo model's replies quote the memory section they were given, and a conversation
stores those replies: later turns carry them in their history. Only a ``system`` message
that is exactly an injected section may stop a turn from recalling, so every later turn
of the conversation still recalls and shows its memories.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.scoped import HEADER, SURFACES, jwt, scoped_stack

pytestmark = pytest.mark.asyncio

ALICE = jwt("alice")
FACT = "My locker code is 4417 and my locker is the blue zebra one"
QUESTIONS = (
    "Which zebra locker is mine?",
    "What is the code of my zebra locker?",
    "Remind me about the blue zebra locker",
)


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("scope", ["shared", "user"])
async def test_every_turn_of_an_echo_conversation_recalls(
    tmp_path: Path, surface: str, scope: str
) -> None:
    async with scoped_stack(tmp_path, scope=scope, echo=True) as stack:
        conversation = await stack.conversation(ALICE)
        first = await stack.say(surface, ALICE, FACT, conversation_id=conversation)
        assert (first.status, first.memory) == (200, "disabled")
        await stack.settle()
        for question in QUESTIONS:
            said = await stack.say(surface, ALICE, question, conversation_id=conversation)
            # The history holds earlier echoed sections; the turn recalls all the same.
            assert (said.status, said.memory) == (200, "enabled"), question
            assert said.content.startswith(f"Echo: {question}\n\n{HEADER}\n- [")
            assert "4417" in said.content
            await stack.settle()
        history = await stack.result(ALICE, "conversations.get", {"conversation_id": conversation})
        replies = [m["content"] for m in history["messages"] if m["role"] == "assistant"]
        assert len(replies) == 4 and all(HEADER in reply for reply in replies[1:])
