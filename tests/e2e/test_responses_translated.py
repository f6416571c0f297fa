"""``POST /v1/responses`` against backends that serve chat completions only, end to end: the
built-in ``echo`` model and a backend the backends file marks ``api = "chat"`` (a recording
upstream under real uvicorn), through the real ``openai`` SDK and LangChain's
``ChatOpenAI(use_responses_api=True)``.

A text turn is translated to chat completions (the memory section and the client's
instructions as the system message) and its answer back to a ``response`` object or the
Responses stream events the SDK parses; what cannot be translated (tools, images, a
``previous_response_id`` chain) is a 400 saying that backend serves chat completions only,
before memory or any upstream is asked. Routing is chat's: aliases, and a fallback from a
Responses backend to a chat one before any byte.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from gateway_http.upstream.backends_file import load_backends
from tests.e2e.stack import Stack, running_stack
from tests.support.fake_philia import QUERY, STORE
from tests.support.fake_responses import RespondFail
from tests.support.fake_upstream import FakeUpstream

pytestmark = pytest.mark.asyncio

MEMORIES = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83}]
SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
ASK = "what tea do I like?"
OWN = "Answer in one sentence."
BACKENDS = """
[backends.native]
base_url = "{native}"
models = ["gpt-x"]

[backends.local]
base_url = "{local}"
api = "chat"
models = ["local-model"]
aliases = {{ small = "local-model-q4" }}

[fallbacks]
"gpt-x" = [{{ backend = "local", model = "local-model" }}]
"""


@contextlib.asynccontextmanager
async def two_backends(tmp_path: Path) -> AsyncIterator[tuple[Stack, FakeUpstream, FakeUpstream]]:
    """The gateway routing `gpt-x` to a Responses upstream and `local-model` (and `small`) to
    one that serves chat completions only."""
    async with FakeUpstream.start() as native, FakeUpstream.start() as local:
        path = tmp_path / "backends.toml"
        path.write_text(BACKENDS.format(native=native.base_url, local=local.base_url))
        backends = load_backends(path, {})
        async with running_stack(tmp_path / "data", backends=backends) as stack:
            stack.philia.memories = list(MEMORIES)
            yield stack, native, local


def sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


async def test_an_api_chat_backend_answers_json_and_streams_through_translation(
    tmp_path: Path,
) -> None:
    async with two_backends(tmp_path) as (stack, native, local), sdk(stack) as client:
        raw = await client.responses.with_raw_response.create(
            model="local-model", input=ASK, instructions=OWN, temperature=0.2
        )
        whole = raw.parse()
        assert (whole.object, whole.status, whole.output_text) == (
            "response",
            "completed",
            f"reply to: {ASK}",
        )
        assert whole.usage is not None
        assert whole.usage.output_tokens == len(whole.output_text.split())
        assert raw.headers["X-Arona-Memory"] == "enabled"
        assert raw.headers["X-Arona-Backend"] == "local"
        events = []
        async with client.responses.stream(model="small", input=ASK) as stream:
            events = [event.type async for event in stream]
            final = await stream.get_final_response()
        assert final.output_text == f"reply to: {ASK}"
        words = len(final.output_text.split())
        assert events == [
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
        # The upstream was asked chat completions only, the section and the client's
        # instructions as its system messages, the alias under its own name.
        first, second = local.chat_requests
        assert first.body["messages"] == [
            {"role": "system", "content": SECTION},
            {"role": "system", "content": OWN},
            {"role": "user", "content": ASK},
        ]
        assert (first.body["temperature"], first.body["stream"]) == (0.2, False)
        assert second.body["model"] == "local-model-q4" and second.body["stream"] is True
        assert [r.path for r in local.requests] == ["/v1/chat/completions"] * 2
        assert native.requests == []
        await stack.drain_writebacks()
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            f"User: {ASK}\nAssistant: reply to: {ASK}"
        ] * 2


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "'tools'"),
        ({"previous_response_id": "resp_123"}, "'previous_response_id'"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": ASK},
                            {"type": "input_image", "image_url": "https://example.invalid/a.png"},
                        ],
                    }
                ]
            },
            "input[0].content[1] (a part of type 'input_image')",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": "22 C"}]},
            "input[0] (an item of type 'function_call_output')",
        ),
    ],
    ids=["tools", "previous_response_id", "image", "tool-output"],
)
async def test_what_a_chat_backend_cannot_take_is_a_400_before_anything_is_asked(
    tmp_path: Path, extra: dict[str, Any], named: str
) -> None:
    async with two_backends(tmp_path) as (stack, native, local), sdk(stack) as client:
        body = {"model": "local-model", "input": ASK, **extra}
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(**body, stream=stream)
            error = refused.value.body
            assert isinstance(error, dict)
            assert error["code"] == "chat_completions_only"
            assert error["message"].startswith(
                "the model 'local-model' is served by backend 'local', which serves chat "
                f"completions only: {named} cannot be translated"
            )
            assert refused.value.response.headers["X-Arona-Memory"] == "disabled"
        assert local.requests == [] and native.requests == []
        assert stack.philia.frames_of(QUERY) == []


async def test_a_failing_responses_backend_falls_back_to_a_chat_one(tmp_path: Path) -> None:
    async with two_backends(tmp_path) as (stack, native, local), sdk(stack) as client:
        native.responses.script(RespondFail(status=503, body=b'{"error": {"message": "busy"}}'))
        native.responses.script(RespondFail(status=503, body=b'{"error": {"message": "busy"}}'))
        raw = await client.responses.with_raw_response.create(model="gpt-x", input=ASK)
        assert raw.parse().output_text == f"reply to: {ASK}"
        assert raw.headers["X-Arona-Backend"] == "local"
        stream = await client.responses.create(model="gpt-x", input=ASK, stream=True)
        assert [e.type async for e in stream][-1] == "response.completed"
        assert [r.path for r in native.requests] == ["/v1/responses"] * 2
        assert [r.body["model"] for r in local.chat_requests] == ["local-model"] * 2
        # Recalled once per turn, whatever the number of backends asked.
        assert len(stack.philia.frames_of(QUERY)) == 2


async def test_the_echo_model_answers_and_shows_the_section(tmp_path: Path) -> None:
    async with running_stack(tmp_path, upstream_url=None) as stack, sdk(stack) as client:
        stack.philia.memories = list(MEMORIES)
        raw = await client.responses.with_raw_response.create(model="echo", input=ASK)
        shown = f"Echo: {ASK}\n\n{SECTION}"
        assert raw.parse().output_text == shown
        assert (raw.headers["X-Arona-Memory"], raw.headers["X-Arona-Backend"]) == (
            "enabled",
            "echo",
        )
        async with client.responses.stream(model="echo", input=ASK, instructions=OWN) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == final.output_text == shown
        await stack.drain_writebacks()
        # The section the reply showed is cut out of the episode, as for a chat turn.
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            f"User: {ASK}\nAssistant: Echo: {ASK}"
        ] * 2


async def test_langchain_chat_openai_with_the_responses_api(tmp_path: Path) -> None:
    async with running_stack(tmp_path, upstream_url=None) as stack:
        stack.philia.memories = list(MEMORIES)
        seen: list[httpx.Response] = []

        async def note(response: httpx.Response) -> None:
            seen.append(response)

        async with httpx.AsyncClient(event_hooks={"response": [note]}) as http:
            llm = ChatOpenAI(
                model="echo",
                base_url=f"{stack.base_url}/v1",
                api_key="unused",  # type: ignore[arg-type]
                use_responses_api=True,
                max_retries=0,
                http_async_client=http,
            )
            reply = await llm.ainvoke([("system", OWN), ("human", ASK)])
            pieces = [chunk.text async for chunk in llm.astream(ASK)]
        shown = f"Echo: {ASK}\n\n{SECTION}"
        assert (reply.text, "".join(pieces)) == (shown, shown)
        assert [r.url.path for r in seen] == ["/v1/responses"] * 2
        assert [r.headers["X-Arona-Memory"] for r in seen] == ["enabled"] * 2
