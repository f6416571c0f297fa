"""The HTTP layer against a gRPC service that wants a token, TLS, or both.

Every hop is a real socket on 127.0.0.1: the HTTP layer sends ``ARONA_GRPC_TOKEN`` on every
MemoryService call and trusts ``ARONA_GRPC_TLS_CA``; with the wrong credentials a chat turn
still answers, with memory ``offline``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import ASK_TEXT, SURFACES, running_stack
from tests.e2e.test_up import forget_hint, gateway_up, run_in_shell, wait_for_writebacks
from tests.support.fake_philia import QUERY, STORE
from tests.support.grpcurl import run_grpcurl
from tests.support.tls import make_tls_files

COMMAND = str(Path(sys.executable).parent / "arona-gateway")

GRPC_TOKEN = "grpc-token-for-the-e2e-tests-0123"
WRONG_TOKEN = "grpc-token-that-is-not-it-4567"
MEMORIES = [{"node_type": "episode", "text": "I prefer oolong tea", "score": 0.834}]
SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
ASK = [{"role": "user", "content": ASK_TEXT}]


@pytest.mark.asyncio
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


@pytest.mark.asyncio
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


@pytest.mark.asyncio
@pytest.mark.parametrize("http_token", [WRONG_TOKEN, None], ids=["wrong", "missing"])
@pytest.mark.asyncio
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


@pytest.mark.asyncio
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


@pytest.mark.asyncio
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


# --- the command line ----------------------------------------------------------------


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(data_dir), ARONA_LOG_LEVEL="info", **extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
@pytest.mark.parametrize("args", [["serve", "--only", "grpc"], ["serve"], ["up"]])
def test_no_grpc_listener_beyond_loopback_without_a_token(
    tmp_path: Path, args: list[str], host: str
) -> None:
    # Refused before anything binds: nothing listens on, or connects to, that address.
    result = _run(args, _env(tmp_path, ARONA_GRPC_HOST=host, ARONA_GRPC_PORT="0"))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("arona-gateway: error: refusing to listen for gRPC on ")
    assert "ARONA_GRPC_TOKEN" in line
    assert result.stdout == ""
    assert not (tmp_path / "memory.db").exists()  # `up` started no store either


@pytest.mark.asyncio
async def test_an_http_only_gateway_needs_no_token(tmp_path: Path) -> None:
    # No gRPC listener in this process, whatever ARONA_GRPC_HOST says: nothing to refuse.
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "serve",
        "--only",
        "http",
        env=_env(tmp_path, ARONA_GRPC_HOST="0.0.0.0", ARONA_HTTP_PORT="0"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    seen: list[str] = []

    async def wait_ready() -> None:
        assert process.stdout is not None
        while not seen or "serving on http://127.0.0.1:" not in seen[-1]:
            raw = await process.stdout.readline()
            assert raw, "\n".join(seen)
            seen.append(raw.decode().rstrip())

    try:
        await asyncio.wait_for(wait_ready(), 60)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, "\n".join(seen) + out.decode()


@pytest.mark.parametrize(
    ("args", "extra", "message"),
    [
        (["serve", "--only", "grpc"], {"ARONA_GRPC_TLS_CERT": "server.pem"}, "set together"),
        (
            ["serve", "--only", "grpc"],
            {"ARONA_GRPC_TLS_CERT": "absent.pem", "ARONA_GRPC_TLS_KEY": "absent-key.pem"},
            "ARONA_GRPC_TLS_KEY: cannot read absent-key.pem",
        ),
        # Both parts in one process: the HTTP layer could not check its own listener.
        (["up"], {}, "ARONA_GRPC_TLS_CA must be set with ARONA_GRPC_TLS_CERT"),
        (["serve"], {}, "ARONA_GRPC_TLS_CA must be set with ARONA_GRPC_TLS_CERT"),
    ],
)
def test_unusable_tls_settings_are_one_line(
    tmp_path: Path, args: list[str], extra: dict[str, str], message: str
) -> None:
    if not extra:
        tls = make_tls_files(tmp_path / "tls")
        extra = {"ARONA_GRPC_TLS_CERT": str(tls.cert), "ARONA_GRPC_TLS_KEY": str(tls.key)}
    result = _run(args, _env(tmp_path, ARONA_GRPC_PORT="0", ARONA_GRPC_TOKEN=GRPC_TOKEN, **extra))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("arona-gateway: error: ") and message in line
    assert GRPC_TOKEN not in result.stderr


@pytest.mark.asyncio
@pytest.mark.timeout(180)  # up to 13 s on a loaded 2-core box
async def test_up_serves_grpc_over_tls_with_a_token_and_still_remembers(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls")
    extra = {
        "ARONA_GRPC_TLS_CERT": str(tls.cert),
        "ARONA_GRPC_TLS_KEY": str(tls.key),
        "ARONA_GRPC_TLS_CA": str(tls.ca),
        "ARONA_GRPC_TOKEN": GRPC_TOKEN,
        "ARONA_LOG_LEVEL": "info",
    }
    async with (
        gateway_up(tmp_path / "data", extra) as up,
        httpx.AsyncClient(timeout=30) as client,
    ):
        # The banner shows how to call the service, naming the token, not showing it.
        assert '-H "authorization: Bearer $ARONA_GRPC_TOKEN"' in up.banner
        assert f"-cacert {tls.ca}" in up.banner and "-plaintext" not in up.banner
        assert GRPC_TOKEN not in up.banner
        target = re.search(r"gRPC\s+(127\.0\.0\.1:\d+)", up.banner)
        assert target, up.banner

        fact = {"model": "echo", "messages": [{"role": "user", "content": "I live in Lyon"}]}
        first = await client.post(f"{up.http_url}/v1/chat/completions", json=fact)
        assert first.status_code == 200
        await wait_for_writebacks(up, client, 1)
        ask = {"model": "echo", "messages": [{"role": "user", "content": "Where do I live?"}]}
        second = await client.post(f"{up.http_url}/v1/chat/completions", json=ask)
        assert second.headers["X-Arona-Memory"] == "enabled"
        assert "User: I live in Lyon" in second.json()["choices"][0]["message"]["content"]
        assert (await client.get(f"{up.http_url}/readyz")).status_code == 200

        status_rpc = "arona.memory.v1.MemoryService/Status"
        answered = await run_grpcurl(
            "-cacert",
            str(tls.ca),
            "-H",
            f"authorization: Bearer {GRPC_TOKEN}",
            target.group(1),
            status_rpc,
        )
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["enabled"] is True
        # It can only fail, at the latest at its connect timeout (grpcurl's default, 10 s, is a
        # third of what run_grpcurl allows); a plaintext service would answer within 3 s.
        plaintext = await run_grpcurl(
            "-plaintext",
            "-connect-timeout",
            "3",
            "-H",
            f"authorization: Bearer {GRPC_TOKEN}",
            target.group(1),
            status_rpc,
        )
        assert plaintext.returncode != 0
        assert "Failed to dial" in plaintext.stderr
        # The banner's forget line reaches the service over TLS (its CA is on the line), with
        # the token exported as the grpcurl line expects it.
        await wait_for_writebacks(up, client, 2)
        forget = forget_hint(up.banner)
        assert GRPC_TOKEN not in forget
        done = await run_in_shell(forget, {"ARONA_GRPC_TOKEN": GRPC_TOKEN})
        assert done.startswith("forgot 2 episode(s) of the turns of no principal"), done
    assert "TLS, bearer token required" in up.stderr
    assert GRPC_TOKEN not in up.stderr
