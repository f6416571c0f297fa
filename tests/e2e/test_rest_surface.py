"""The REST surface's contract beyond memory: errors in OpenAI's shape, limits,
auth, upstream failures, forwarding, streaming cancellation, the openai SDK."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from arona_grpc.config import DEFAULT_MAX_BODY_BYTES
from gateway_http.usage.records import Budget
from tests.e2e.stack import ASK_TEXT, running_stack
from tests.support.fake_philia import STORE
from tests.support.fake_upstream import Fail, Hang, Stream
from tests.support.usage import usage_record

pytestmark = pytest.mark.asyncio

ASK = [{"role": "user", "content": ASK_TEXT}]


def _error(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"{not json", "JSON"),
        (b"[1, 2]", "object"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}', "role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "content"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "memory": "false"}',
            "memory",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "memory": 0}', "memory"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
            "stream",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
            b' "conversation_id": 12}',
            "conversation_id",
        ),
        # The optional fields chat.send checks, checked alike.
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
            b' "temperature": "hot"}',
            "'temperature'",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
            "'max_tokens'",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": 7}',
            "'user'",
        ),
    ],
)
async def test_bad_requests_are_400_in_openai_shape(
    tmp_path: Path, payload: bytes, field: str
) -> None:
    async with running_stack(tmp_path) as stack:
        response = await stack.http.post(
            "/v1/chat/completions",
            content=payload,
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 400
        error = _error(response)
        assert error["type"] == "invalid_request_error"
        assert field in error["message"]
        assert stack.upstream.chat_requests == []


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",  # what a cross-site form or fetch() sends
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,  # a fetch() of a Blob without a type
    ],
)
async def test_a_chat_body_that_is_not_declared_json_is_415_and_writes_nothing(
    tmp_path: Path, content_type: str | None
) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "my locker code is 4417"}]}'
    async with running_stack(tmp_path) as stack:
        request = stack.http.build_request("POST", "/v1/chat/completions", content=body)
        if content_type is not None:
            request.headers["content-type"] = content_type
        assert request.headers.get("content-type") == content_type
        response = await stack.http.send(request)
        assert response.status_code == 415
        assert _error(response)["code"] == "unsupported_media_type"
        assert stack.upstream.chat_requests == []
        await stack.drain_writebacks()
        assert stack.philia.stored == []
        # Declared JSON (with a charset) is a turn like any other.
        accepted = await stack.http.post(
            "/v1/chat/completions",
            content=body,
            headers={"Content-Type": "Application/JSON; charset=utf-8"},
        )
        assert accepted.status_code == 200


async def test_body_over_the_limit_is_413(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        # The default limit (32 MiB) takes a 20 MB photo as a data URL; one byte more is refused.
        content = "x" * DEFAULT_MAX_BODY_BYTES
        big = {"model": "m", "messages": [{"role": "user", "content": content}]}
        response = await stack.http.post("/v1/chat/completions", json=big)
        assert response.status_code == 413
        assert _error(response)["code"] == "request_too_large"
        assert stack.upstream.chat_requests == []


async def test_api_keys_guard_rest(tmp_path: Path) -> None:
    async with running_stack(tmp_path, api_keys=("k-one", "k-two")) as stack:
        body = {"model": "m", "messages": ASK}
        missing = await stack.http.post("/v1/chat/completions", json=body)
        wrong = await stack.http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        right = await stack.http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k-two"}
        )
        assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
        assert _error(missing)["type"] == "authentication_error"
        assert "k-one" not in missing.text and "nope" not in wrong.text
        models = await stack.http.get("/v1/models")
        assert models.status_code == 401


async def test_unknown_fields_are_forwarded_untouched(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        extra = {"top_p": 0.25, "seed": 7, "vendor_knob": {"nested": [1, "two"]}}
        response = await stack.http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": ASK, "memory": False, **extra},
        )
        assert response.status_code == 200
        sent = stack.upstream.last_body
        assert {k: sent[k] for k in extra} == extra
        assert "memory" not in sent and "conversation_id" not in sent


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_server_error_is_502(tmp_path: Path, stream: bool) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = [{"node_type": "episode", "text": "likes oolong", "score": 0.5}]
        stack.upstream.script(Fail(status=503, message="overloaded"))
        response = await stack.http.post(
            "/v1/chat/completions", json={"model": "m", "messages": ASK, "stream": stream}
        )
        assert response.status_code == 502
        assert _error(response)["code"] == "upstream_error"
        # The turn had recalled before the upstream failed: the answer says so.
        assert response.headers["X-Arona-Memory"] == "enabled"
        assert response.headers["X-Arona-Memory-Count"] == "1"


async def test_unreachable_upstream_is_502(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    async with running_stack(tmp_path, upstream_url=dead) as stack:
        response = await stack.http.post(
            "/v1/chat/completions", json={"model": "m", "messages": ASK}
        )
        assert response.status_code == 502
        error = _error(response)
        assert error["code"] == "upstream_error"
        assert dead not in error["message"]


async def test_mid_stream_failure_is_one_error_event_then_done(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        stack.upstream.script(Stream(pieces=["one ", "two ", "three"], end="break"))
        turn = await stack.turn("sse", ASK)
        assert turn.status == 200
        contents = [e for e in turn.events if isinstance(e, dict) and "choices" in e]
        errors = [e for e in turn.events if isinstance(e, dict) and "error" in e]
        assert contents and len(errors) == 1
        assert turn.events[-1] == "[DONE]"
        assert turn.events[-2] is errors[0]


async def test_client_disconnect_cancels_the_upstream_request(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        conversation = await stack.create_conversation("sse")
        reply = Stream(pieces=["a ", "b ", "c"], pause_after=1)
        stack.upstream.script(reply)
        body = {"model": "m", "messages": ASK, "stream": True, "conversation_id": conversation}
        async with stack.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            await asyncio.wait_for(reply.paused.wait(), 5)
        # Leaving the block closed the connection mid-stream.
        await asyncio.wait_for(reply.closed.wait(), 5)
        ok = await stack.turn("rest", [{"role": "user", "content": "after"}], memory=False)
        assert ok.status == 200
        stores = await stack.philia.wait_frames(STORE)
        assert [s["params"]["text"] for s in stores] == ["User: after\nAssistant: reply to: after"]
        stored = await stack.http.get(f"/v1/conversations/{conversation}")
        # The user turn was persisted on arrival; no assistant reply for a cancelled stream.
        assert [m["role"] for m in stored.json()["messages"]] == ["user"]


async def test_hanging_upstream_is_cancelled_when_the_client_leaves(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        hang = Hang()
        stack.upstream.script(hang)
        request = asyncio.create_task(
            stack.http.post("/v1/chat/completions", json={"model": "m", "messages": ASK})
        )
        await asyncio.wait_for(hang.arrived.wait(), 5)
        request.cancel()
        await asyncio.wait_for(hang.closed.wait(), 5)


async def test_models_health_and_readiness(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        models = await stack.http.get("/v1/models")
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["fake-model"]
        assert (await stack.http.get("/healthz")).status_code == 200
        assert (await stack.http.get("/readyz")).status_code == 200
        assert stack.grpc is not None
        await stack.grpc.stop(0)
        not_ready = await stack.http.get("/readyz")
        assert not_ready.status_code == 503
        assert (await stack.http.get("/healthz")).status_code == 200


async def test_unknown_route_is_openai_shaped_404(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        response = await stack.http.get("/v1/nothing-here")
        assert response.status_code == 404
        _error(response)


async def test_every_rest_answer_says_what_memory_did(tmp_path: Path) -> None:
    team = {"Authorization": "Bearer sk-team-0123456789"}
    spent = {"Authorization": "Bearer sk-spent-0123456789"}
    chat = {"model": "m", "messages": ASK}
    async with running_stack(
        tmp_path, api_keys=("team=sk-team-0123456789", "spent=sk-spent-0123456789")
    ) as stack:
        usage = stack.app.state.gateway.usage
        await usage.store.add([usage_record("key:spent", 10, 10)])
        await usage.store.set_budget("key:spent", Budget(tokens=5))
        await usage.budgets.refresh()
        post = stack.http.post
        answers = {
            "no key": await post("/v1/chat/completions", json=chat),
            "no key on models": await stack.http.get("/v1/models"),
            "bad JSON": await post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={**team, "Content-Type": "application/json"},
            ),
            "not declared JSON": await post("/v1/chat/completions", content=b"{}", headers=team),
            "unknown route": await stack.http.get("/v1/nothing-here", headers=team),
            "the prefix alone": await stack.http.get("/v1", headers=team),
            "wrong method": await stack.http.get("/v1/chat/completions", headers=team),
            "no such conversation": await stack.http.get("/v1/conversations/nope", headers=team),
            "budget spent": await post("/v1/chat/completions", json=chat, headers=spent),
            "budget spent, streamed": await post(
                "/v1/chat/completions", json={**chat, "stream": True}, headers=spent
            ),
            "models": await stack.http.get("/v1/models", headers=team),
            "conversations": await stack.http.get("/v1/conversations", headers=team),
        }
        outside = [await stack.http.get("/healthz"), await stack.http.get("/nothing-here")]
        assert stack.upstream.chat_requests == []

    assert {
        why: (r.status_code, r.headers.get("X-Arona-Memory")) for why, r in answers.items()
    } == {
        "no key": (401, "disabled"),
        "no key on models": (401, "disabled"),
        "bad JSON": (400, "disabled"),
        "not declared JSON": (415, "disabled"),
        "unknown route": (404, "disabled"),
        "the prefix alone": (404, "disabled"),
        "wrong method": (404, "disabled"),
        "no such conversation": (404, "disabled"),
        "budget spent": (429, "disabled"),
        "budget spent, streamed": (429, "disabled"),
        "models": (200, "disabled"),
        "conversations": (200, "disabled"),
    }
    # Said once, beside the request id every answer has.
    assert all(len(r.headers.get_list("X-Arona-Memory")) == 1 for r in answers.values())
    assert all(r.headers.get("X-Request-Id") for r in answers.values())
    # Not a REST answer, not a memory state.
    assert [r.headers.get("X-Arona-Memory") for r in outside] == [None, None]


async def test_openai_sdk_works_unchanged(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = [{"node_type": "episode", "text": "likes oolong", "score": 0.5}]
        client = openai.AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0
        )
        conversation = await stack.create_conversation("rest")
        raw = await client.chat.completions.with_raw_response.create(
            model="fake-model",
            messages=[{"role": "user", "content": ASK_TEXT}],
            extra_body={"memory": True, "conversation_id": conversation},
        )
        assert raw.headers["X-Arona-Memory"] == "enabled"
        completion = raw.parse()
        assert completion.choices[0].message.content == f"reply to: {ASK_TEXT}"

        async with client.chat.completions.with_streaming_response.create(
            model="fake-model",
            messages=[{"role": "user", "content": "stream please"}],
            stream=True,
            extra_body={"memory": False, "conversation_id": conversation},
        ) as streamed:
            assert streamed.headers["X-Arona-Memory"] == "disabled"
            pieces = [
                chunk.choices[0].delta.content or ""
                async for chunk in await streamed.parse()
                if chunk.choices
            ]
        assert "".join(pieces) == "reply to: stream please"
        await client.close()


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", "hot"), ("max_tokens", 0), ("memory", "yes")]
)
async def test_rest_and_chat_send_refuse_the_same_optional_fields(
    tmp_path: Path, field: str, value: Any
) -> None:
    body = {"model": "m", "messages": ASK, field: value}
    async with running_stack(tmp_path) as stack:
        rest = await stack.http.post("/v1/chat/completions", json=body)
        rpc = await stack.rpc("chat.send", body)
        assert rest.status_code == 400
        assert _error(rest)["message"].startswith(f"'{field}': ")
        assert rpc["error"]["code"] == -32602
        assert field in rpc["error"]["message"]
        assert stack.upstream.chat_requests == []
