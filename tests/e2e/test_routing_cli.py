"""``ARONA_BACKENDS`` through the command line, as real processes: a file with mistakes stops
start-up with one line per mistake, and ``serve`` on a good one routes each model to its
backend (two fake upstreams) and says which answered, in a header and in its log."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.fake_upstream import Fail, FakeUpstream

pytestmark = pytest.mark.timeout(120)

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
KEY = "sk-cli-routing-secret-0123456789"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(
        ARONA_DATA_DIR=str(tmp_path / "data"),
        ARONA_HTTP_PORT="0",
        ARONA_GRPC_PORT="0",
        ARONA_LOG_LEVEL="info",
        **extra,
    )
    return env


@pytest.mark.parametrize("command", [["serve"], ["serve", "--only", "http"], ["up"]])
def test_a_backends_file_with_mistakes_is_one_line_each_and_nothing_starts(
    tmp_path: Path, command: list[str]
) -> None:
    path = tmp_path / "backends.toml"
    path.write_text(
        f"""
[backends.openai]
base_url = "https://api.openai.com/v1"
api_key = "{KEY}"
api_key_env = "UNSET_OPENAI_KEY"
models = ["gpt-*"]

[backends.local]
base_url = "localhost:11434"
models = ["llama*"]
timeout_s = -1

[fallbacks]
"gpt-4o" = ["anthropic"]
"""
    )
    done = subprocess.run(
        [COMMAND, *command],
        env=_env(tmp_path, ARONA_BACKENDS=str(path), UNSET_OPENAI_KEY=""),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    prefix = f"arona-gateway: error: {path}: "
    assert done.stderr.splitlines() == [
        prefix + "backends.openai.api_key: keys never go in this file: put the key in an "
        "environment variable and name the variable in api_key_env",
        prefix + "backends.openai.api_key_env: the environment variable UNSET_OPENAI_KEY is not "
        "set or empty",
        prefix + "backends.local.timeout_s: Input should be greater than 0",
        prefix + "backends.local.base_url: must be an http:// or https:// URL with a host",
        prefix + "fallbacks.gpt-4o[0]: no backend named 'anthropic' (backends: openai, local)",
    ]
    assert KEY not in done.stderr
    # Nothing was started: no data directory was even made.
    assert not (tmp_path / "data").exists()


def test_a_glob_fallback_to_a_backend_not_serving_its_models_stops_start_up(
    tmp_path: Path,
) -> None:
    path = tmp_path / "backends.toml"
    path.write_text(
        """
[backends.anthropic]
base_url = "http://127.0.0.1:1/v1"
models = ["claude-*"]

[backends.alpha]
base_url = "http://127.0.0.1:2/v1"
models = ["gpt-4o"]

[fallbacks]
"claude-*" = ["alpha"]
"""
    )
    done = subprocess.run(
        [COMMAND, "serve"],
        env=_env(tmp_path, ARONA_BACKENDS=str(path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"arona-gateway: error: {path}: fallbacks.\"claude-*\"[0]: backend 'alpha' does not "
        "serve 'claude-', which 'claude-*' matches: add 'claude-*' to its models, or write "
        '{ backend = "alpha", model = "…" }\n'
    )
    assert not (tmp_path / "data").exists()


def test_a_backends_file_and_an_upstream_url_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "backends.toml"
    path.write_text('[backends.a]\nbase_url = "http://127.0.0.1:1/v1"\nmodels = ["m"]\n')
    done = subprocess.run(
        [COMMAND, "serve"],
        env=_env(tmp_path, ARONA_BACKENDS=str(path), ARONA_UPSTREAM_URL="http://127.0.0.1:2/v1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "arona-gateway: error: ARONA_BACKENDS and ARONA_UPSTREAM_URL are both set: the backends "
        "file names every upstream, so unset ARONA_UPSTREAM_URL (and ARONA_UPSTREAM_API_KEY)\n"
    )


@pytest.mark.asyncio
async def test_serve_routes_each_model_to_its_backend_and_logs_who_answered(
    tmp_path: Path,
) -> None:
    async with FakeUpstream.start(api_key=KEY) as first, FakeUpstream.start() as second:
        path = tmp_path / "backends.toml"
        path.write_text(
            f"""
[backends.first]
base_url = "{first.base_url}"
api_key_env = "FIRST_API_KEY"
models = ["gpt-*"]

[backends.second]
base_url = "{second.base_url}"
models = ["claude-*", "gpt-*"]
aliases = {{ "gpt-4o" = "claude-stand-in" }}

[fallbacks]
"gpt-*" = ["second"]
"""
        )
        env = _env(tmp_path, ARONA_BACKENDS=str(path), FIRST_API_KEY=KEY)
        process = await asyncio.create_subprocess_exec(
            COMMAND,
            "serve",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert process.stdout is not None
        seen: list[str] = []

        async def line_matching(pattern: str) -> re.Match[str]:
            assert process.stdout is not None
            while True:
                raw = await process.stdout.readline()
                assert raw, "serve exited early:\n" + "\n".join(seen)
                seen.append(raw.decode().rstrip())
                if found := re.search(pattern, seen[-1]):
                    return found

        try:
            port = (await asyncio.wait_for(line_matching(r"serving on http://[^:]+:(\d+)"), 60))[1]
            routing = await asyncio.wait_for(line_matching(r"routing models to .*"), 10)
            assert routing.group(0) == (
                f"routing models to 2 backends (first, second) from {path} (ARONA_BACKENDS)"
            )
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                ask = [{"role": "user", "content": "hello"}]
                # gpt-3.5-turbo is first's (glob); first is overloaded, second stands in.
                first.script(Fail(503, "overloaded"))
                reply = await client.post(
                    "/v1/chat/completions", json={"model": "gpt-3.5-turbo", "messages": ask}
                )
                assert reply.status_code == 200
                assert reply.headers["x-arona-backend"] == "second"
                assert second.last_body["model"] == "gpt-3.5-turbo"
                await asyncio.wait_for(line_matching(r"answered by backend"), 10)
                answered = "model gpt-3.5-turbo answered by backend second as gpt-3.5-turbo"
                assert f"{answered} (2 attempts, " in seen[-1]
                # gpt-4o is second's by alias (a name wins over first's glob), renamed.
                reply = await client.post(
                    "/v1/chat/completions", json={"model": "gpt-4o", "messages": ask}
                )
                assert reply.headers["x-arona-backend"] == "second"
                assert second.last_body["model"] == "claude-stand-in"
                reply = await client.post(
                    "/v1/chat/completions", json={"model": "gpt-4-turbo", "messages": ask}
                )
                assert reply.headers["x-arona-backend"] == "first"
                assert first.last_body["model"] == "gpt-4-turbo"
                assert first.chat_requests[-1].authorization == f"Bearer {KEY}"
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] == ["gpt-4o"]
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            rest = await asyncio.wait_for(process.stdout.read(), 30)
            seen += rest.decode().splitlines()
            await asyncio.wait_for(process.wait(), 30)
    output = "\n".join(seen)
    assert process.returncode == 0, output
    assert "Traceback" not in output
    assert KEY not in output
