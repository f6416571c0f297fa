"""``POST /v1/responses`` end to end: the real ``openai`` SDK (sync and async) and LangChain's
``ChatOpenAI(use_responses_api=True)`` against the real gateway under uvicorn, the real gRPC
service, and a recording upstream that speaks the Responses API.

What the client sees: the output text, the stream's events in order and byte for byte as the
upstream sent them, the memory headers. What the upstream receives: the memory section in
``instructions`` ahead of the client's own, every other field untouched, one section only
along a ``previous_response_id`` chain. A fact said in one response is recalled in a later
one; a backend that serves chat completions only (``api = "chat"``, the ``echo`` model)
answers through translation, and refuses with a 400 what it cannot be translated to.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from tests.e2e.scoped import TEAM_A_KEY, scoped_stack
from tests.e2e.stack import Stack, running_stack
from tests.support.fake_philia import QUERY, STORE
from tests.support.fake_responses import Respond, RespondFail, RespondStream

pytestmark = pytest.mark.asyncio

MEMORIES = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83}]
SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
HEADER = "## Relevant Long-Term Memories"
ASK = "what tea do I like?"
OWN = "Answer in one sentence."
# Fields the gateway does not own: each must reach the upstream exactly as sent.
PASSED = {
    "store": False,
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "reasoning": {"effort": "low"},
    "metadata": {"ticket": "T-1"},
    "max_output_tokens": 64,
}
# A field this SDK does not know yet (sent as extra_body): passed on all the same.
FUTURE = {"some_future_field": {"nested": [1, "two", None]}}


def sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def sync_sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def responses_bodies(stack: Stack) -> list[Any]:
    return [r.body for r in stack.upstream.responses_requests]


async def test_a_json_response_through_the_async_sdk(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack, sdk(stack) as client:
        stack.philia.memories = list(MEMORIES)
        raw = await client.responses.with_raw_response.create(
            model="fake-model", input=ASK, instructions=OWN, extra_body=FUTURE, **PASSED
        )
        response = raw.parse()
        assert response.output_text == f"reply to: {ASK}"
        assert raw.headers["X-Arona-Memory"] == "enabled"
        assert raw.headers["X-Arona-Memory-Count"] == "1"
        assert float(raw.headers["X-Arona-Recall-Ms"]) > 0
        [sent] = responses_bodies(stack)
        # The section first, the client's instructions kept after it.
        assert sent["instructions"] == f"{SECTION}\n\n{OWN}"
        assert {k: v for k, v in sent.items() if k != "instructions"} == {
            "model": "fake-model",
            "input": ASK,
            **PASSED,
            **FUTURE,
        }
        # The upstream's body, byte for byte.
        assert raw.http_response.content == stack.upstream.responses.sent[-1]
        await stack.drain_writebacks()
        [stored] = stack.philia.frames_of(STORE)
        assert stored["params"]["text"] == f"User: {ASK}\nAssistant: reply to: {ASK}"


async def test_a_stream_through_the_async_sdk(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack, sdk(stack) as client:
        stack.philia.memories = list(MEMORIES)
        stream = await client.responses.create(
            model="fake-model",
            input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
            stream=True,
        )
        headers = stream.response.headers
        events = [event async for event in stream]
        words = len(f"reply to: {ASK}".split())
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * words,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
            f"reply to: {ASK}"
        )
        assert (headers["X-Arona-Memory"], headers["X-Arona-Memory-Count"]) == ("enabled", "1")
        assert responses_bodies(stack)[0]["instructions"] == SECTION
        await stack.drain_writebacks()
        [stored] = stack.philia.frames_of(STORE)
        assert stored["params"]["text"] == f"User: {ASK}\nAssistant: reply to: {ASK}"


async def test_a_stream_reaches_the_client_byte_for_byte(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        body = {"model": "fake-model", "input": ASK, "stream": True}
        async with stack.http.stream("POST", "/v1/responses", json=body) as response:
            received = b"".join([chunk async for chunk in response.aiter_raw()])
        assert response.headers["content-type"].startswith("text/event-stream")
        assert received == stack.upstream.responses.sent[-1]


async def test_the_sync_sdk_json_and_streams(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)

        def three() -> tuple[str, str, str]:
            with sync_sdk(stack) as client:
                whole = client.responses.create(model="fake-model", input=ASK)
                with client.responses.stream(model="fake-model", input=ASK) as stream:
                    final = stream.get_final_response()
                events = client.responses.create(model="fake-model", input=ASK, stream=True)
                deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            return whole.output_text, final.output_text, "".join(deltas)

        assert await asyncio.to_thread(three) == (f"reply to: {ASK}",) * 3
        assert [b["instructions"] for b in responses_bodies(stack)] == [SECTION] * 3


async def test_memory_false_recalls_nothing_and_the_section_is_not_added_twice(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        off = await stack.http.post(
            "/v1/responses", json={"model": "fake-model", "input": ASK, "memory": False}
        )
        assert off.status_code == 200 and off.headers["X-Arona-Memory"] == "disabled"
        held = f"{SECTION}\n\n{OWN}"
        again = await stack.http.post(
            "/v1/responses", json={"model": "fake-model", "input": ASK, "instructions": held}
        )
        assert again.status_code == 200 and again.headers["X-Arona-Memory"] == "disabled"
        first, second = responses_bodies(stack)
        assert "memory" not in first and "instructions" not in first
        assert second["instructions"] == held
        # Neither asked memory anything.
        assert stack.philia.frames_of(QUERY) == []


async def test_a_previous_response_id_chain_carries_one_section(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack, sdk(stack) as client:
        stack.philia.memories = list(MEMORIES)
        previous: str | None = None
        for question in (ASK, "and which one is best cold?", "thanks"):
            response = await client.responses.create(
                model="fake-model",
                input=question,
                instructions=OWN,
                **({"previous_response_id": previous} if previous else {}),
            )
            previous = response.id
        # What the model was given for the last response: the whole chain, one section.
        seen = stack.upstream.responses.contexts[-1]
        assert seen.count(HEADER) == 1 and seen.startswith(SECTION)
        assert ASK in seen and "and which one is best cold?" in seen
        assert [b.get("previous_response_id") for b in responses_bodies(stack)][1:] == [
            r for r in list(stack.upstream.responses.stored)[:2]
        ]


async def test_a_broken_stream_ends_with_an_error_event_and_writes_nothing_back(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack, sdk(stack) as client:
        stack.upstream.responses.script(RespondStream(pieces=["half ", "an "], end="break"))
        stream = await client.responses.create(model="fake-model", input=ASK, stream=True)
        events = [event async for event in stream]
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            # The Responses API's own way of saying the stream failed.
            "error",
        ]
        error = events[-1]
        assert error.type == "error" and error.code == "upstream_error"
        assert error.message == "upstream stream broke off" and error.sequence_number == 6
        await stack.drain_writebacks()
        assert stack.philia.frames_of(STORE) == []


async def test_a_client_that_leaves_a_stream_closes_the_upstream_request(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        held = RespondStream(pieces=["a ", "long ", "answer"], end="hold")
        stack.upstream.responses.script(held)
        body = {"model": "fake-model", "input": ASK, "stream": True}
        async with stack.http.stream("POST", "/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                if line == "event: response.output_text.delta":
                    break
        # The gateway gave up the upstream's stream as soon as its client was gone.
        await asyncio.wait_for(held.closed.wait(), 10)
        await stack.drain_writebacks()
        assert stack.philia.frames_of(STORE) == []


async def test_bad_input_is_a_400_in_openai_shape(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        for body, field in (
            ({"input": ASK}, "'model'"),
            ({"model": "fake-model", "input": 3}, "'input'"),
            ({"model": "fake-model", "input": None}, "'input'"),
            ({"model": "fake-model", "input": ASK, "instructions": ["x"]}, "'instructions'"),
            ({"model": "fake-model", "input": ASK, "memory": "yes"}, "'memory'"),
            ({"model": "fake-model", "input": ASK, "stream": "true"}, "'stream'"),
        ):
            answer = await stack.http.post("/v1/responses", json=body)
            assert answer.status_code == 400, body
            error = answer.json()["error"]
            assert field in error["message"] and error["type"] == "invalid_request_error"
        assert responses_bodies(stack) == []


async def test_a_fact_said_in_one_response_is_recalled_in_a_later_one(tmp_path: Path) -> None:
    fact = "My locker code is 4417 and my locker is the blue zebra one"
    async with (
        scoped_stack(tmp_path) as stack,
        openai.AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key=TEAM_A_KEY, max_retries=0
        ) as client,
    ):
        told = await client.responses.create(model="fake-model", input=fact, stream=True)
        assert [e.type async for e in told][-1] == "response.completed"
        await stack.settle()
        asked = await client.responses.with_raw_response.create(
            model="fake-model", input="Which zebra locker is mine?", instructions=OWN
        )
        assert asked.headers["X-Arona-Memory"] == "enabled"
        instructions = stack.upstream.responses_requests[-1].body["instructions"]
        assert instructions.startswith(f"{HEADER}\n- [")
        assert "4417" in instructions and instructions.endswith(f"\n\n{OWN}")
        await stack.settle()
        assert stack.stored_texts() == [
            f"User: {fact}\nAssistant: reply to: {fact}",
            "User: Which zebra locker is mine?\nAssistant: reply to: Which zebra locker is mine?",
        ]


async def test_langchain_chat_openai_through_a_responses_upstream(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(MEMORIES)
        seen: list[httpx.Response] = []

        async def note(response: httpx.Response) -> None:
            seen.append(response)

        async with httpx.AsyncClient(event_hooks={"response": [note]}) as http:
            llm = ChatOpenAI(
                model="fake-model",
                base_url=f"{stack.base_url}/v1",
                api_key="unused",  # type: ignore[arg-type]
                use_responses_api=True,
                max_retries=0,
                http_async_client=http,
            )
            reply = await llm.ainvoke([("system", OWN), ("human", ASK)])
            pieces = [chunk.text async for chunk in llm.astream([("human", ASK)])]
        assert (reply.text, "".join(pieces)) == (f"reply to: {ASK}",) * 2
        assert [r.headers["X-Arona-Memory"] for r in seen] == ["enabled"] * 2
        invoked, streamed = responses_bodies(stack)
        # LangChain sends its system message as an input item: the section goes in
        # `instructions`, the client's items untouched.
        assert invoked["instructions"] == streamed["instructions"] == SECTION
        assert [item["role"] for item in invoked["input"]] == ["system", "user"]
        assert streamed["stream"] is True


async def test_what_does_not_complete_is_not_written_back(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack, sdk(stack) as client:
        stack.upstream.responses.script(
            Respond(status="incomplete"),
            RespondStream(end="failed"),
            RespondFail(status=400),
        )
        cut = await client.responses.create(model="fake-model", input=ASK)
        assert cut.status == "incomplete"
        failed = await client.responses.create(model="fake-model", input=ASK, stream=True)
        assert [e.type async for e in failed][-1] == "response.failed"
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(
                model="fake-model", input=ASK, previous_response_id="resp_unknown"
            )
        # The upstream's refusal as it said it, status and body, saying what memory did.
        assert refused.value.status_code == 400
        assert refused.value.response.content == RespondFail().body
        assert refused.value.response.headers["X-Arona-Memory"] == "disabled"
        await stack.drain_writebacks()
        assert stack.philia.frames_of(STORE) == []
