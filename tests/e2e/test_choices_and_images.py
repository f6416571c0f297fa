"""Several choices (``n``) and photos, end to end: the real ``openai`` SDK against the real
gateway, a scripted Philia and the recording upstream.

What a user sees: of ``n=2`` choices, streamed or whole, the client gets both untouched and
memory and the conversation keep choice 0; a photo of over a megabyte sent as a data URL is
answered (OpenAI takes images of up to 20 MB) and reaches the model unchanged; a photo sent
alone recalls nothing and is remembered as ``[image]`` beside the answer.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.stack import Stack, running_stack
from tests.support.fake_philia import QUERY, STORE
from tests.support.fake_upstream import Choices, Complete, Stream

pytestmark = pytest.mark.asyncio

ASKED = "Name a tea for a cold evening."
ZERO = "Roasted oolong, brewed strong."
ONE = "Genmaicha with a little honey."
OOLONG = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.83}]


def client_of(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="k", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_of_two_choices_memory_and_the_conversation_keep_choice_0(
    tmp_path: Path, stream: bool
) -> None:
    async with running_stack(tmp_path) as stack:
        conversation = await stack.create_conversation("rest")
        stack.upstream.script(Choices(texts=[ZERO, ONE]))
        texts: dict[int, str] = {}
        async with client_of(stack) as client:
            if stream:
                chunks = await client.chat.completions.create(
                    model="fake-model",
                    messages=[{"role": "user", "content": ASKED}],
                    n=2,
                    stream=True,
                    extra_body={"conversation_id": conversation},
                )
                async for chunk in chunks:
                    for choice in chunk.choices:
                        texts[choice.index] = texts.get(choice.index, "") + (
                            choice.delta.content or ""
                        )
            else:
                completion = await client.chat.completions.create(
                    model="fake-model",
                    messages=[{"role": "user", "content": ASKED}],
                    n=2,
                    extra_body={"conversation_id": conversation},
                )
                texts = {c.index: c.message.content or "" for c in completion.choices}
        # The client gets every choice as the upstream sent it.
        assert texts == {0: ZERO, 1: ONE}
        assert stack.upstream.last_body["n"] == 2
        await stack.drain_writebacks()
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            f"User: {ASKED}\nAssistant: {ZERO}"
        ]
        stored = await stack.http.get(f"/v1/conversations/{conversation}")
        assert stored.json()["messages"] == [
            {"role": "user", "content": ASKED},
            {"role": "assistant", "content": ZERO},
        ]


def photo_url(size: int) -> str:
    """A JPEG-looking photo of ``size`` bytes as a data URL (base64: a third larger)."""
    jpeg = b"\xff\xd8\xff\xe0" + os.urandom(size - 6) + b"\xff\xd9"
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_photo_alone_is_answered_recalls_nothing_and_is_stored_as_image(
    tmp_path: Path, stream: bool
) -> None:
    url = photo_url(1_100_000)
    answer = "A grey cat asleep on a blue sofa."
    photo: dict[str, Any] = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url, "detail": "high"}}],
    }
    async with running_stack(tmp_path, memory_stream_writeback=True) as stack:
        stack.philia.memories = list(OOLONG)
        stack.upstream.script(Stream(pieces=[answer]) if stream else Complete(content=answer))
        async with client_of(stack) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="fake-model",
                messages=[photo],  # type: ignore[list-item]
                stream=stream,
            )
            assert raw.status_code == 200
            assert raw.headers["x-arona-memory"] == "disabled"
            parsed: Any = raw.parse()
            if stream:
                content = "".join([c.choices[0].delta.content or "" async for c in parsed])
            else:
                content = parsed.choices[0].message.content
        assert content == answer
        # The photo reached the model as it was sent, and nothing was recalled for it.
        assert stack.upstream.last_body["messages"] == [photo]
        assert stack.philia.frames_of(QUERY) == []
        await stack.drain_writebacks()
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            f"User: [image]\nAssistant: {answer}"
        ]


async def test_a_photo_with_a_question_recalls_and_stores_the_question(tmp_path: Path) -> None:
    question = "Is this tea any good?"
    asked: dict[str, Any] = {
        "role": "user",
        "content": [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": photo_url(200_000)}},
        ],
    }
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = list(OOLONG)
        async with client_of(stack) as client:
            await client.chat.completions.create(
                model="fake-model",
                messages=[asked],  # type: ignore[list-item]
            )
        [query] = stack.philia.frames_of(QUERY)
        assert query["params"]["query"] == question
        await stack.drain_writebacks()
        assert [s["params"]["text"] for s in stack.philia.frames_of(STORE)] == [
            f"User: {question}\nAssistant: reply to: {question}"
        ]
