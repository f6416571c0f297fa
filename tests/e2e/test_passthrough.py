"""The OpenAI routes beside chat, end to end: the real ``openai`` SDK (sync and async) against
the real gateway under uvicorn, the real gRPC service, a scripted Philia and recording fake
upstreams (real uvicorn each).

What a user sees: embeddings, completions (whole and streamed), moderations, speech (the audio's
bytes as the upstream sent them), transcriptions and translations (the upload reaching the
upstream byte for byte), image generation and ``models.retrieve`` work through the gateway's
base URL as they would against the upstream; the model is routed like chat's (an alias sent as
the backend's name, a fallback after a 5xx); an upstream's 400 reaches the client with its
body (the backend's key masked), a 401 from it a 502 naming it; API keys and budgets apply;
embeddings' and completions' usage is metered; memory is never involved; a stream that breaks
off is never taken for whole, and a client that leaves ends the upstream request; the echo
model embeds; one trace holds the request and its upstream call; a route the gateway does not
serve is OpenAI's 404 naming it.
"""

from __future__ import annotations

import asyncio
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway_http.usage.records import Budget, UsageQuery, micros
from gateway_http.usage.tokens import TokenCounter
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_routing import routed_stack
from tests.support.fake_philia import QUERY, STORE
from tests.support.fake_upstream import SPEECH, Cut, Fail, Hang, Trickle, embedding_of
from tests.support.otlp_receiver import OtlpReceiver, exported, named, traced_here

pytestmark = pytest.mark.asyncio

AUDIO = b"ID3\x04\x00" + bytes(range(256)) * 40 + b"\r\n--not-a-boundary\r\n" + b"\x00" * 512
KEY = "sk-team-0123456789"


def sdk(stack: Stack, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=0)


def sync_sdk(stack: Stack, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=0)


def form_fields(raw: bytes) -> dict[str, bytes]:
    """The fields of a multipart body as the upstream received it, parsed independently."""
    boundary = raw.split(b"\r\n", 1)[0]
    fields = {}
    for part in raw.split(boundary)[1:-1]:
        head, _, value = part.partition(b"\r\n\r\n")
        name = head.split(b'name="', 1)[1].split(b'"', 1)[0].decode()
        fields[name] = value.removesuffix(b"\r\n")
    return fields


async def _rows(stack: Stack) -> dict[tuple[str, str, str], tuple[int, int, int]]:
    """The usage of the last hour: (requests, prompt tokens, completion tokens) by principal,
    model and backend."""
    now = datetime.now(UTC)
    summary = await stack.app.state.gateway.usage.summary(
        UsageQuery(
            micros(now - timedelta(hours=1)),
            micros(now + timedelta(hours=1)),
            ("principal", "model", "backend"),
        )
    )
    return {
        row.groups: (row.turns, row.prompt_tokens, row.completion_tokens) for row in summary.rows
    }


def _json() -> dict[str, str]:
    return {"Content-Type": "application/json"}


async def _estimated(stack: Stack) -> set[str]:
    """The models of the last hour with requests whose tokens the gateway counted."""
    now = datetime.now(UTC)
    summary = await stack.app.state.gateway.usage.summary(
        UsageQuery(micros(now - timedelta(hours=1)), micros(now + timedelta(hours=1)), ("model",))
    )
    return {row.groups[0] for row in summary.rows if row.estimated_turns}


async def test_every_route_answers_through_the_async_sdk_with_memory_left_out(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = [{"node_type": "episode", "text": "likes oolong", "score": 0.5}]
        client = sdk(stack)
        raw = await client.embeddings.with_raw_response.create(
            model="text-embedding-3-small", input=["hello there", "tea"]
        )
        embedded = raw.parse()
        completion = await client.completions.create(model="davinci-002", prompt="Say tea")
        streamed = await client.completions.create(
            model="davinci-002", prompt="Say more tea", stream=True
        )
        pieces = [choice.text async for chunk in streamed for choice in chunk.choices]
        moderation = await client.moderations.create(input="tea is lovely")
        image = await client.images.generate(model="dall-e-3", prompt="a teapot")
        transcription = await client.audio.transcriptions.create(
            model="whisper-1", file=("speech.mp3", AUDIO, "audio/mpeg")
        )
        with warnings.catch_warnings():
            # The SDK marks translations deprecated; the route is still OpenAI's.
            warnings.simplefilter("ignore", DeprecationWarning)
            translation = await client.audio.translations.create(
                model="whisper-1", file=("speech.mp3", AUDIO, "audio/mpeg")
            )
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="hello"
        ) as speech:
            speech_type = speech.headers["content-type"]
            await speech.stream_to_file(tmp_path / "speech.mp3")
        listed = await client.models.retrieve("fake-model")
        await client.close()
        up = stack.upstream

        # Memory had no part: nothing recalled, nothing written back, and the answers say so.
        await stack.drain_writebacks()
        assert stack.philia.frames_of(QUERY) == stack.philia.frames_of(STORE) == []
    assert raw.headers["X-Arona-Memory"] == "disabled"
    assert raw.headers["X-Arona-Backend"] == "upstream"

    # The SDK asks for base64 embeddings; they arrive decoded to the upstream's numbers.
    assert [e.embedding for e in embedded.data] == [
        embedding_of("hello there"),
        embedding_of("tea"),
    ]
    assert embedded.usage.prompt_tokens == 3
    [asked] = up.requests_to("embeddings")
    assert asked.body["input"] == ["hello there", "tea"]
    assert asked.body["model"] == "text-embedding-3-small"
    assert completion.choices[0].text == "completed: Say tea"
    assert "".join(pieces) == "completed: Say more tea"
    assert [r.body.get("stream") for r in up.requests_to("completions")] == [None, True]
    assert moderation.results[0].flagged is False
    # OpenAI's default moderation model is the one asked for when the SDK names none.
    assert "model" not in up.requests_to("moderations")[0].body
    assert image.data is not None and image.data[0].url == "https://images.example/a teapot.png"
    assert speech_type == "audio/mpeg"
    assert (tmp_path / "speech.mp3").read_bytes() == SPEECH
    for route, answer in (
        ("audio/transcriptions", transcription),
        ("audio/translations", translation),
    ):
        [upload] = up.requests_to(route)
        fields = form_fields(upload.raw_body)
        assert fields["model"] == b"whisper-1"
        assert fields["file"] == AUDIO
        assert answer.text == f"{route.split('/')[1]} of {len(upload.raw_body)} bytes"
    assert listed.id == "fake-model"
    # Only the routes asked for went upstream: nothing went to chat.
    assert up.chat_requests == []


async def test_the_sync_sdk_works_too(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:

        def calls() -> tuple[Any, Any, bytes, Any]:
            with sync_sdk(stack) as client:
                embedded = client.embeddings.create(model="e", input="tea", encoding_format="float")
                completion = client.completions.create(model="c", prompt="Say tea")
                speech = client.audio.speech.create(model="tts-1", voice="alloy", input="hi")
                listed = client.models.list()
                return embedded, completion, speech.read(), listed

        embedded, completion, audio, listed = await asyncio.to_thread(calls)
    assert embedded.data[0].embedding == embedding_of("tea")
    assert completion.choices[0].text == "completed: Say tea"
    assert audio == SPEECH
    assert [m.id for m in listed.data] == ["fake-model"]


async def test_an_alias_routes_and_the_backend_gets_its_own_name(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        client = sdk(routed.stack)
        raw = await client.embeddings.with_raw_response.create(model="fast", input="tea")
        await client.audio.transcriptions.create(
            model="sonnet", file=("speech.mp3", AUDIO, "audio/mpeg")
        )
        await client.completions.create(model="claude-3-haiku", prompt="hi")
        await client.close()
    assert raw.headers["X-Arona-Backend"] == "a"
    [embedded] = routed.a.requests_to("embeddings")
    assert embedded.body["model"] == "gpt-4o-mini"
    assert embedded.authorization == "Bearer sk-backend-a-0123456789"
    # The form's model field renamed, every other byte of the upload as the client sent it.
    [upload] = routed.b.requests_to("audio/transcriptions")
    fields = form_fields(upload.raw_body)
    assert fields["model"] == b"claude-3-5-sonnet-20241022"
    assert fields["file"] == AUDIO
    assert upload.authorization == "Bearer sk-backend-b-9876543210"
    assert routed.b.requests_to("completions")[0].body["model"] == "claude-3-haiku"


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_a_5xx_or_429_falls_back_to_the_next_backend(tmp_path: Path, status: int) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script_routes(Fail(status, "busy"), Fail(status, "busy"))
        client = sdk(routed.stack)
        raw = await client.embeddings.with_raw_response.create(model="gpt-4o", input="tea")
        streamed = await client.completions.create(model="gpt-4o", prompt="hi", stream=True)
        text = "".join([choice.text async for chunk in streamed for choice in chunk.choices])
        await client.close()
    assert raw.headers["X-Arona-Backend"] == "b"
    assert raw.parse().data[0].embedding == embedding_of("tea")
    assert text == "completed: hi"
    # b serves gpt-4o under its own name for it.
    assert [r.body["model"] for r in routed.b.requests] == ["openai/gpt-4o"] * 2
    assert len(routed.a.requests) == 2


async def test_an_upstream_400_reaches_the_client_with_its_body(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script_routes(Fail(400, "input is too long"), Fail(400, "input is too long"))
        response = await routed.stack.http.post(
            "/v1/embeddings", json={"model": "gpt-4o", "input": "tea"}
        )
        client = sdk(routed.stack)
        with pytest.raises(openai.BadRequestError) as raised:
            await client.embeddings.create(model="gpt-4o", input="tea")
        await client.close()
        # Not a failure worth another backend: b was never asked.
        assert routed.b.requests == []
    assert response.status_code == 400
    assert response.content == orjson.dumps(
        {"error": {"message": "input is too long", "type": "server_error", "code": None}}
    )
    assert response.headers["content-type"] == "application/json"
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["message"] == "input is too long"


async def test_an_upstream_error_never_shows_the_backends_key(tmp_path: Path) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script_routes(Fail(400, "bad request from sk-backend-a-0123456789 here"))
        response = await routed.stack.http.post(
            "/v1/embeddings", json={"model": "gpt-4o", "input": "tea"}
        )
    assert response.status_code == 400
    assert "sk-backend-a" not in response.text
    assert response.json()["error"]["message"].startswith("bad request from ")


async def test_an_upstream_refusing_the_gateways_key_is_a_502_naming_the_backend(
    tmp_path: Path,
) -> None:
    async with routed_stack(tmp_path) as routed:
        routed.a.script_routes(Fail(401, "Incorrect API key provided: sk-backend-a-0123456789"))
        response = await routed.stack.http.post(
            "/v1/embeddings", json={"model": "gpt-4o", "input": "tea"}
        )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["message"].startswith("backend a refused the gateway's credentials (HTTP 401)")
    assert "sk-backend" not in response.text


async def test_api_keys_and_budgets_apply(tmp_path: Path) -> None:
    async with running_stack(tmp_path, api_keys=(f"team={KEY}", "spent=sk-spent-0123456789")) as (
        stack
    ):
        usage = stack.app.state.gateway.usage
        await usage.store.set_budget("key:spent", Budget(tokens=5))
        await usage.budgets.refresh()
        keyless = sdk(stack)
        with pytest.raises(openai.AuthenticationError) as refused:
            await keyless.embeddings.create(model="e", input="tea")
        await keyless.close()
        upload = await stack.http.post(
            "/v1/audio/transcriptions",
            files={"file": ("a.mp3", AUDIO)},
            data={"model": "whisper-1"},
        )

        client = sdk(stack, KEY)
        for _ in range(2):
            await client.embeddings.create(model="e", input="one two three")
        await client.close()
        spent = sdk(stack, "sk-spent-0123456789")
        # Under budget: answered, and its tokens are counted against it.
        await spent.embeddings.create(model="e", input="one two three four five six")
        await usage.meter.flush()
        with pytest.raises(openai.RateLimitError) as over:
            await spent.images.generate(model="dall-e-3", prompt="a teapot")
        await spent.close()
        up = stack.upstream
        assert len(up.requests_to("embeddings")) == 3
        assert up.requests_to("images/generations") == []
        rows = await _rows(stack)
    assert refused.value.status_code == 401
    assert refused.value.body is not None
    assert upload.status_code == 401
    assert upload.json()["error"]["type"] == "authentication_error"
    assert over.value.code == "insufficient_quota"
    # Each embeddings request recorded with the tokens its upstream reported.
    assert rows == {
        ("key:team", "e", "upstream"): (2, 6, 0),
        ("key:spent", "e", "upstream"): (1, 6, 0),
    }


async def test_a_route_the_gateway_does_not_serve_is_openais_404_naming_it(
    tmp_path: Path,
) -> None:
    async with running_stack(tmp_path) as stack:
        answers = {
            "POST /v1/foo": await stack.http.post("/v1/foo", json={}),
            "GET /v1/embeddings": await stack.http.get("/v1/embeddings"),
            "DELETE /v1/models": await stack.http.delete("/v1/models"),
            "GET /v1": await stack.http.get("/v1"),
        }
        client = sdk(stack)
        with pytest.raises(openai.NotFoundError) as unknown_model:
            await client.models.retrieve("no-such-model")
        await client.close()
    for route, response in answers.items():
        assert response.status_code == 404, route
        assert response.json() == {
            "error": {
                "message": f"Invalid URL ({route})",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        assert response.headers["X-Arona-Memory"] == "disabled"
    assert unknown_model.value.code == "model_not_found"


async def test_the_echo_model_embeds_and_says_it_serves_nothing_else(tmp_path: Path) -> None:
    async with running_stack(tmp_path, upstream_url=None) as stack:
        client = sdk(stack)
        embedded = await client.embeddings.create(
            model="echo", input=["green tea please", "Green TEA, please!", "the stock market"]
        )
        again = await client.embeddings.create(model="echo", input="green tea please")
        small = await client.embeddings.create(model="echo", input="tea", dimensions=8)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.embeddings.create(model="echo", input=[{"not": "text"}])  # type: ignore[list-item]
        with pytest.raises(openai.NotFoundError) as other:
            await client.completions.create(model="echo", prompt="tea")
        echo = await client.models.retrieve("echo")
        await client.close()
        rows = await _rows(stack)
    vectors = [e.embedding for e in embedded.data]
    # Deterministic, unit length, and texts with the same words are the same vector.
    assert again.data[0].embedding == vectors[0]
    assert len(vectors[0]) == 1536 and len(small.data[0].embedding) == 8
    assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-5)
    assert vectors[1] == vectors[0] and vectors[2] != vectors[0]
    assert embedded.usage.prompt_tokens == 3 + 3 + 3
    assert "'input'" in bad.value.message
    assert other.value.code == "model_not_supported"
    assert "does not answer POST /v1/completions" in other.value.message
    assert echo.owned_by == "arona"
    assert rows == {("anonymous", "echo", "echo"): (3, 9 + 3 + 1, 0)}


async def test_bad_bodies_get_clear_400s(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        post = stack.http.post
        answers = [
            await post("/v1/embeddings", content=b"{not json", headers=_json()),
            await post("/v1/embeddings", json=["a list"]),
            await post("/v1/embeddings", json={"input": "no model"}),
            await post("/v1/audio/transcriptions", files={"file": ("a.mp3", AUDIO)}),
        ]
        not_a_form = await post("/v1/audio/transcriptions", json={"model": "whisper-1"})
        assert stack.upstream.requests == []
    assert [r.status_code for r in answers] == [400] * 4
    assert [r.json()["error"]["type"] for r in answers] == ["invalid_request_error"] * 4
    assert "model" in answers[3].json()["error"]["message"]
    assert not_a_form.status_code == 415


async def test_a_client_that_leaves_cancels_the_upstream_request(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        hang = Hang()
        stack.upstream.script_routes(hang)
        async with httpx.AsyncClient(base_url=stack.base_url) as http:
            request = asyncio.ensure_future(
                http.post("/v1/images/generations", json={"prompt": "slow"})
            )
            await asyncio.wait_for(hang.arrived.wait(), 5)
            request.cancel()
        await asyncio.wait_for(hang.closed.wait(), 5)


async def test_completions_are_metered_reported_or_counted(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        client = sdk(stack)
        await client.completions.create(model="whole", prompt="Say tea")
        asked = await client.completions.create(
            model="asked", prompt="Say tea", stream=True, stream_options={"include_usage": True}
        )
        said = [chunk async for chunk in asked]
        counted = await client.completions.create(model="counted", prompt="Say tea", stream=True)
        text = "".join([choice.text async for chunk in counted for choice in chunk.choices])
        await client.close()
        rows = await _rows(stack)
        estimated = await _estimated(stack)
    # The usage chunk the client asked for reached it.
    assert said[-1].usage is not None and said[-1].usage.completion_tokens == 3
    counter = TokenCounter()
    assert rows == {
        ("anonymous", "whole", "upstream"): (1, 2, 3),
        ("anonymous", "asked", "upstream"): (1, 2, 3),
        # No usage in the stream: counted by the gateway from the prompt and the text streamed.
        ("anonymous", "counted", "upstream"): (
            1,
            counter.prompt([{"role": "user", "content": "Say tea"}]),
            counter.reply(text),
        ),
    }
    assert estimated == {"counted"}


async def test_a_stream_that_breaks_off_is_never_taken_for_whole(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        half = SPEECH[: len(SPEECH) // 2]
        chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "Hel"}]}
        event = b"data: " + orjson.dumps(chunk) + b"\n\n"
        stack.upstream.script_routes(Cut(data=half), Cut(b"text/event-stream", event))
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with stack.http.stream(
                "POST", "/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "a"}
            ) as speech:
                async for piece in speech.aiter_bytes():
                    received += piece
        completion = await stack.http.post(
            "/v1/completions", json={"model": "c", "prompt": "Hello", "stream": True}
        )
    # What arrived of the audio is the upstream's, and no more.
    assert received and half.startswith(received)
    events = [line for line in completion.text.split("\n\n") if line]
    assert events[0] == event.decode().strip()
    assert orjson.loads(events[1].removeprefix("data: "))["error"]["type"] == "upstream_error"
    assert events[2] == "data: [DONE]"


async def test_an_upload_over_the_body_limit_is_refused_before_the_upstream(
    tmp_path: Path,
) -> None:
    # The form around the file takes a few hundred bytes.
    limit = len(AUDIO) + 1000
    async with running_stack(tmp_path, http_overrides={"http_max_body_bytes": limit}) as stack:
        client = sdk(stack)
        small = await client.audio.transcriptions.create(
            model="whisper-1", file=("a.mp3", AUDIO, "audio/mpeg")
        )
        with pytest.raises(openai.APIStatusError) as large:
            await client.audio.transcriptions.create(
                model="whisper-1", file=("a.mp3", AUDIO * 2, "audio/mpeg")
            )
        # A JSON body meets the same limit.
        with pytest.raises(openai.APIStatusError) as long_input:
            await client.embeddings.create(model="e", input="tea " * (limit // 4))
        await client.close()
        assert len(stack.upstream.requests) == 1
    assert small.text.startswith("transcriptions of")
    assert large.value.status_code == long_input.value.status_code == 413


async def test_a_client_that_leaves_a_stream_closes_the_upstream_request(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        trickle = Trickle(data=SPEECH[:4096])
        stack.upstream.script_routes(trickle)
        body = {"model": "tts-1", "input": "a long story", "voice": "alloy"}
        async with stack.http.stream("POST", "/v1/audio/speech", json=body) as speech:
            first = await anext(speech.aiter_raw())
        # The client closed its response after the first bytes: the upstream request ends.
        await asyncio.wait_for(trickle.closed.wait(), 5)
    assert SPEECH.startswith(first)


async def test_a_passed_through_request_is_one_trace_with_its_upstream_call(
    tmp_path: Path,
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with OtlpReceiver() as receiver, traced_here(receiver), running_stack(tmp_path) as stack:
        response = await stack.http.post(
            "/v1/embeddings",
            json={"model": "text-embedding-3-small", "input": "tea"},
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
        await exported()
        [upstream] = stack.upstream.requests_to("embeddings")
    assert response.status_code == 200
    assert receiver.tree(trace_id, show=lambda s: f"{s.name} [{s.kind}]") == "\n".join(
        [
            "POST /v1/embeddings [server]",
            "  embeddings text-embedding-3-small [client]",
        ]
    )
    [server] = named(receiver.spans, "POST /v1/embeddings")
    [client] = named(receiver.spans, "embeddings text-embedding-3-small")
    assert server.attributes["http.response.status_code"] == 200
    assert client.attributes["gen_ai.system"] == "upstream"
    assert client.attributes["arona.upstream.outcome"] == "answered"
    # The upstream continues the same trace, under the attempt's span.
    assert upstream.headers["traceparent"].split("-")[1:3] == [trace_id, client.span_id]
