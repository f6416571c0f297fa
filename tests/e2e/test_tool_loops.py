"""Agents' tool loops end to end: the real ``openai`` SDK (sync and async, whole and streamed),
LangChain's ``ChatOpenAI`` and ``chat.send`` against the real gateway over the real embedded
store, with the recording upstream scripted to call a tool, then to answer.

What a user sees: a loop of two steps is one memory, ``User: <the question>`` and
``Assistant: <the final answer>``, stored once when the loop ends; the second step is given
the same memories as the first, never the first step itself; the tool's result is never
stored; structured output through a forced tool is stored with its arguments as the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.e2e.scoped import HEADER, ScopedStack, jwt, scoped_stack
from tests.support.fake_upstream import Complete, RecordedRequest, Stream, split_words

pytestmark = pytest.mark.asyncio

ASKED = "I live in Reykjavik. What's the weather in my city?"
SEED = "My sister visits Reykjavik every winter"
FINAL = "Sleet and minus three degrees in Reykjavik."
# What the tool said: it must never become a memory.
TOOL_SAID = '{"temp_c": -3, "sky": "sleet", "station": "BIRK-7731"}'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_ID = "call_wx_1"
ARGUMENTS = '{"city": "Reykjavik"}'
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": "weather", "arguments": ARGUMENTS},
        }
    ],
}
STREAMED_CALL = [
    {
        "tool_calls": [
            {
                "index": 0,
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "weather", "arguments": ""},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Reykjavik"}'}}]},
]
EPISODE = f"User: {ASKED}\nAssistant: {FINAL}"


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[ScopedStack]:
    # Shared memory, REST open; a streamed turn is written back without a conversation.
    async with scoped_stack(
        tmp_path, scope="shared", api_keys=(), memory_stream_writeback=True
    ) as stack:
        # Something to recall, so that each step's section shows what it was given.
        seeded = await stack.say("rest", None, SEED)
        assert seeded.status == 200
        await stack.settle()
        yield stack


def section_of(request: RecordedRequest) -> str:
    """The memory section an upstream request carried ("" for none)."""
    for message in request.body["messages"]:
        content = message.get("content")
        if isinstance(content, str) and content.startswith(HEADER):
            return content
    return ""


async def check_one_loop_stored(stack: ScopedStack, before: int) -> None:
    """The loop's two upstream requests got the same memories, not the loop's first step;
    the loop is one episode, without the tool's words."""
    await stack.settle()
    first, second = stack.upstream.chat_requests[before:]
    assert SEED in section_of(first)
    assert section_of(second) == section_of(first)
    assert "weather" not in section_of(second)
    texts = stack.stored_texts()
    assert texts[1:] == [EPISODE]
    assert not any("BIRK-7731" in text or "sleet" in text for text in texts)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("sdk", ["sync", "async"])
async def test_an_openai_sdk_tool_loop_is_one_memory(
    stack: ScopedStack, sdk: str, stream: bool
) -> None:
    before = len(stack.upstream.chat_requests)
    if stream:
        stack.upstream.script(Stream(deltas=STREAMED_CALL), Stream(pieces=split_words(FINAL)))
    else:
        stack.upstream.script(
            Complete(message=CALL, finish_reason="tool_calls"), Complete(content=FINAL)
        )
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASKED}]
    ask = _sync_ask if sdk == "sync" else _async_ask

    content, calls = await ask(stack, messages, stream)
    assert content == "" and [c["id"] for c in calls] == [CALL_ID]
    assert calls[0]["function"]["arguments"] == ARGUMENTS
    await stack.settle()
    # A step that calls a tool is not an answer yet: nothing of it is stored.
    assert len(stack.stored_texts()) == 1

    messages += [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": CALL_ID, "content": TOOL_SAID},
    ]
    content, calls = await ask(stack, messages, stream)
    assert calls == []
    assert content == FINAL
    await check_one_loop_stored(stack, before)


async def _async_ask(
    stack: ScopedStack, messages: list[dict[str, Any]], stream: bool
) -> tuple[str, list[dict[str, Any]]]:
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="open", max_retries=0)
    async with client:
        if not stream:
            completion = await client.chat.completions.create(
                model="fake-model",
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
            )
            return _whole(completion)
        chunks = await client.chat.completions.create(
            model="fake-model",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
        )
        return _assembled([chunk async for chunk in chunks])


async def _sync_ask(
    stack: ScopedStack, messages: list[dict[str, Any]], stream: bool
) -> tuple[str, list[dict[str, Any]]]:
    def ask() -> tuple[str, list[dict[str, Any]]]:
        with openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key="open", max_retries=0
        ) as client:
            if not stream:
                completion = client.chat.completions.create(
                    model="fake-model",
                    messages=messages,  # type: ignore[arg-type]
                    tools=TOOLS,  # type: ignore[arg-type]
                )
                return _whole(completion)
            chunks = client.chat.completions.create(
                model="fake-model",
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                stream=True,
            )
            return _assembled(list(chunks))

    # The gateway runs on this event loop: the blocking client runs beside it.
    return await asyncio.to_thread(ask)


def _whole(completion: Any) -> tuple[str, list[dict[str, Any]]]:
    message = completion.choices[0].message
    calls = [call.model_dump(exclude_none=True) for call in message.tool_calls or ()]
    return message.content or "", calls


def _assembled(chunks: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """A streamed answer's text and tool calls, put together as a client does."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            text.append(delta.content or "")
            for part in delta.tool_calls or ():
                call = calls.setdefault(
                    part.index, {"type": "function", "function": {"name": "", "arguments": ""}}
                )
                if part.id:
                    call["id"] = part.id
                if part.function is not None:
                    call["function"]["name"] += part.function.name or ""
                    call["function"]["arguments"] += part.function.arguments or ""
    return "".join(text), [calls[i] for i in sorted(calls)]


async def test_a_langchain_bind_tools_loop_is_one_memory(stack: ScopedStack) -> None:
    before = len(stack.upstream.chat_requests)
    stack.upstream.script(
        Complete(message=CALL, finish_reason="tool_calls"), Complete(content=FINAL)
    )
    llm = ChatOpenAI(
        model="fake-model", base_url=f"{stack.base_url}/v1", api_key="open", max_retries=0
    )
    agent = llm.bind_tools(TOOLS)
    history: list[BaseMessage] = [HumanMessage(ASKED)]

    step = await agent.ainvoke(history)
    assert isinstance(step, AIMessage)
    [call] = step.tool_calls
    assert (call["name"], call["args"], call["id"]) == ("weather", {"city": "Reykjavik"}, CALL_ID)
    await stack.settle()
    assert len(stack.stored_texts()) == 1

    history += [step, ToolMessage(TOOL_SAID, tool_call_id=CALL_ID)]
    final = await agent.ainvoke(history)
    assert final.content == FINAL
    # The upstream got the loop as LangChain sent it: the call, then the tool's result.
    sent = stack.upstream.last_body["messages"]
    assert [m["role"] for m in sent if not section_of_message(m)] == ["user", "assistant", "tool"]
    await check_one_loop_stored(stack, before)


def section_of_message(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, str) and content.startswith(HEADER)


async def test_a_chat_send_loop_is_one_memory(stack: ScopedStack) -> None:
    before = len(stack.upstream.chat_requests)
    stack.upstream.script(
        Complete(message=CALL, finish_reason="tool_calls"), Complete(content=FINAL)
    )
    token = jwt("alice")
    asked = [{"role": "user", "content": ASKED}]
    step = await stack.result(token, "chat.send", {"model": "fake-model", "messages": asked})
    assert (step["content"], step["finish_reason"]) == ("", "tool_calls")
    await stack.settle()
    assert len(stack.stored_texts()) == 1

    loop = [*asked, CALL, {"role": "tool", "tool_call_id": CALL_ID, "content": TOOL_SAID}]
    final = await stack.result(token, "chat.send", {"model": "fake-model", "messages": loop})
    assert final["content"] == FINAL
    await check_one_loop_stored(stack, before)


class Person(BaseModel):
    """Someone who signed up."""

    name: str
    city: str


async def test_structured_output_through_a_forced_tool_stores_its_arguments(
    stack: ScopedStack,
) -> None:
    said = "Anna from Oslo signed up today; file her details."
    arguments = '{"name": "Anna", "city": "Oslo"}'
    forced = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_p",
                "type": "function",
                "function": {"name": "Person", "arguments": arguments},
            }
        ],
    }
    stack.upstream.script(Complete(message=forced, finish_reason="stop"))
    llm = ChatOpenAI(
        model="fake-model", base_url=f"{stack.base_url}/v1", api_key="open", max_retries=0
    )
    extract = llm.with_structured_output(Person, method="function_calling")

    person = await extract.ainvoke(said)

    assert person == Person(name="Anna", city="Oslo")
    # LangChain forced the call by naming the function: the call is the turn's answer.
    assert stack.upstream.last_body["tool_choice"]["function"]["name"] == "Person"
    await stack.settle()
    assert stack.stored_texts()[1:] == [f"User: {said}\nAssistant: {arguments}"]


async def test_a_streamed_forced_call_is_stored_like_a_whole_one(stack: ScopedStack) -> None:
    said = "Anna from Oslo signed up today; file her details."
    deltas = [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_p",
                    "type": "function",
                    "function": {"name": "Person", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"name": "Anna", '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"city": "Oslo"}'}}]},
    ]
    stack.upstream.script(Stream(deltas=deltas))
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="open", max_retries=0)
    async with client:
        chunks = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": said}],
            tools=[{"type": "function", "function": {"name": "Person", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "Person"}},
            stream=True,
        )
        content, calls = _assembled([chunk async for chunk in chunks])
    assert content == "" and calls[0]["function"]["arguments"] == '{"name": "Anna", "city": "Oslo"}'
    await stack.settle()
    assert stack.stored_texts()[1:] == [
        f'User: {said}\nAssistant: {{"name": "Anna", "city": "Oslo"}}'
    ]
