"""The HTTP layer against a gRPC service that wants a token, TLS, or both.

Every hop is a real socket on 127.0.0.1: the HTTP layer sends ``ARONA_GRPC_TOKEN`` on every
MemoryService call and trusts ``ARONA_GRPC_TLS_CA``; with the wrong credentials a chat turn
still answers, with memory ``offline``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.e2e.stack import ASK_TEXT, SURFACES, running_stack
from tests.support.fake_philia import QUERY, STORE
from tests.support.tls import make_tls_files

pytestmark = pytest.mark.asyncio

GRPC_TOKEN = "grpc-token-for-the-e2e-tests-0123"
WRONG_TOKEN = "grpc-token-that-is-not-it-4567"
MEMORIES = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.834}]
SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
ASK = [{"role": "user", "content": ASK_TEXT}]


@pytest.mark.parametrize("surface", SURFACES)
async def test_the_http_layer_sends_the_token_and_recalls(
    tmp_path: Path, surface: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        async with running_stack(tmp_path, grpc_token=GRPC_TOKEN) as stack:
            stack.philia.memories = list(MEMORIES)
            turn = await stack.turn(surface, ASK)
            assert (turn.status, turn.memory) == (200, "enabled")
            assert stack.upstream.last_body["messages"] == [
                {"role": "system", "content": SECTION},
                *ASK,
            ]
    assert GRPC_TOKEN not in caplog.text


async def test_writeback_status_and_delete_carry_the_token_too(tmp_path: Path) -> None:
    async with running_stack(tmp_path, grpc_token=GRPC_TOKEN) as stack:
        assert (await stack.turn("rest", ASK)).status == 200
        await stack.philia.wait_frames(STORE)
        status = await stack.rpc("memory.status")
        assert [e["kind"] for e in status["result"]["events"]] == ["writeback", "recall"]
        deleted = await stack.rpc("memory.delete", {"node_id": "n-1"})
        assert deleted["result"] == {"deleted": True}
        # The health check needs no token.
        assert (await stack.http.get("/readyz")).status_code == 200


@pytest.mark.parametrize("http_token", [WRONG_TOKEN, None], ids=["wrong", "missing"])
@pytest.mark.parametrize("surface", SURFACES)
async def test_without_the_right_token_a_turn_still_answers_offline(
    tmp_path: Path, surface: str, http_token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        async with running_stack(
            tmp_path, grpc_token=GRPC_TOKEN, http_overrides={"grpc_token": http_token}
        ) as stack:
            stack.philia.memories = list(MEMORIES)
            turn = await stack.turn(surface, ASK)
            assert (turn.status, turn.memory) == (200, "offline")
            assert turn.content == "reply to: what tea do I like?"
            assert stack.upstream.last_body["messages"] == ASK
            status = await stack.rpc("memory.status")
            assert status["error"]["code"] == -32005
            assert stack.philia.frames_of(QUERY) == []
    assert "UNAUTHENTICATED" in caplog.text
    assert GRPC_TOKEN not in caplog.text and WRONG_TOKEN not in caplog.text
    assert GRPC_TOKEN not in str(status) and WRONG_TOKEN not in str(status)


async def test_the_http_layer_trusts_the_ca_and_reaches_the_tls_service(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    async with running_stack(
        tmp_path,
        grpc_tls_cert=tls.cert,
        grpc_tls_key=tls.key,
        grpc_tls_ca=tls.ca,
        grpc_token=GRPC_TOKEN,
    ) as stack:
        stack.philia.memories = list(MEMORIES)
        for surface in SURFACES:
            turn = await stack.turn(surface, ASK)
            assert (turn.status, turn.memory) == (200, "enabled")
        assert (await stack.http.get("/readyz")).status_code == 200
        assert "result" in await stack.rpc("memory.status")


@pytest.mark.parametrize("trust", ["nothing", "another CA"])
async def test_a_tls_service_the_http_layer_cannot_verify_is_offline(
    tmp_path: Path, trust: str
) -> None:
    tls = make_tls_files(tmp_path / "tls")
    other_ca = make_tls_files(tmp_path / "other", "another test CA").ca
    async with running_stack(
        tmp_path,
        grpc_tls_cert=tls.cert,
        grpc_tls_key=tls.key,
        http_overrides={"grpc_tls_ca": None if trust == "nothing" else other_ca},
    ) as stack:
        stack.philia.memories = list(MEMORIES)
        turn = await stack.turn("rest", ASK)
        assert (turn.status, turn.memory) == (200, "offline")
        assert (await stack.http.get("/readyz")).status_code == 503
        assert stack.philia.frames_of(QUERY) == []
