"""``arona-gateway up`` as a user runs it: one process, embedded store, echo model.

A fact stated in one turn is written back, recalled in the next turn, and both
the memory and the conversation survive a restart of the process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.grpcurl import grpcurl_path, run_grpcurl

# Up to 17 s a test on a loaded 2-core box.
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

BANNER_END = "Ctrl-C stops everything."
FACT = "My favourite tea is oolong"
QUESTION = "Which tea is my favourite?"


@dataclass
class Up:
    process: asyncio.subprocess.Process
    banner: str
    http_url: str
    jwt: str
    # Everything the process logged, once it has stopped.
    stderr: str = ""

    async def rpc(self, client: httpx.AsyncClient, method: str, params: Any = None) -> Any:
        request = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}
        response = await client.post(
            f"{self.http_url}/api/rpc",
            json=request,
            headers={"Authorization": f"Bearer {self.jwt}"},
        )
        reply = response.json()
        assert "result" in reply, reply
        return reply["result"]


def _env(data_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(
        ARONA_DATA_DIR=str(data_dir),
        ARONA_HTTP_PORT="0",
        ARONA_GRPC_PORT="0",
        ARONA_LOG_LEVEL="warning",
    )
    env.update(extra or {})
    return env


@asynccontextmanager
async def gateway_up(data_dir: Path, extra_env: dict[str, str] | None = None) -> AsyncIterator[Up]:
    command = Path(sys.executable).parent / "arona-gateway"
    process = await asyncio.create_subprocess_exec(
        str(command),
        "up",
        env=_env(data_dir, extra_env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    up: Up | None = None
    try:
        lines: list[str] = []

        async def read_banner() -> None:
            assert process.stdout is not None
            while not lines or lines[-1] != BANNER_END:
                raw = await process.stdout.readline()
                assert raw, "arona-gateway up exited before it was ready"
                lines.append(raw.decode().rstrip("\n"))

        await asyncio.wait_for(read_banner(), 60)
        banner = "\n".join(lines)
        http = re.search(r"HTTP\s+(http://127\.0\.0\.1:\d+)", banner)
        jwt = re.search(r"JWT for JSON-RPC .*: (\S+)$", banner, re.MULTILINE)
        assert http and jwt, banner
        up = Up(process, banner, http.group(1), jwt.group(1))
        yield up
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
        if up is not None:
            up.stderr = stderr.decode()
    assert process.returncode == 0, stderr.decode()
    assert "Traceback" not in stderr.decode()


async def wait_for_writebacks(up: Up, client: httpx.AsyncClient, count: int) -> None:
    # Another process: there is no event to await, so ask memory.status, bounded.
    for _ in range(200):
        status = await up.rpc(client, "memory.status")
        if sum(e["kind"] == "writeback" for e in status["events"]) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} writebacks: {status}")


async def test_up_remembers_and_survives_a_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with httpx.AsyncClient(timeout=30) as client:
        async with gateway_up(data_dir) as up:
            assert "echo" in up.banner and "grpcurl -plaintext" in up.banner
            assert "curl " in up.banner
            assert "scope    shared  (one memory pool for every caller" in up.banner
            assert f"console  {up.http_url}/console" in up.banner
            console = await client.get(f"{up.http_url}/console")
            assert console.status_code == 200 and "Arona console" in console.text
            conversation = (await up.rpc(client, "conversations.create", {"title": "tea"}))["id"]
            first = await up.rpc(
                client,
                "chat.send",
                {
                    "model": "echo",
                    "conversation_id": conversation,
                    "messages": [{"role": "user", "content": FACT}],
                },
            )
            assert first["memory"] == "disabled"
            await wait_for_writebacks(up, client, 1)

            second = await client.post(
                f"{up.http_url}/v1/chat/completions",
                json={
                    "model": "echo",
                    "messages": [{"role": "user", "content": QUESTION}],
                },
            )
            assert second.status_code == 200
            assert second.headers["X-Arona-Memory"] == "enabled"
            reply = second.json()["choices"][0]["message"]["content"]
            # The echo model shows the section it was given: the first turn is in it.
            assert "## Relevant Long-Term Memories" in reply
            assert f"User: {FACT}" in reply

        async with gateway_up(data_dir) as again:
            assert again.jwt != ""
            after = await client.post(
                f"{again.http_url}/v1/chat/completions",
                json={
                    "model": "echo",
                    "messages": [{"role": "user", "content": QUESTION}],
                },
            )
            assert after.headers["X-Arona-Memory"] == "enabled"
            assert f"User: {FACT}" in after.json()["choices"][0]["message"]["content"]
            stored = await again.rpc(client, "conversations.get", {"conversation_id": conversation})
            assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
            assert stored["messages"][0]["content"] == FACT


async def test_a_short_memory_token_works_is_warned_about_once_and_garbles_no_line(
    tmp_path: Path,
) -> None:
    """Any non-empty token enables memory (the contract's example is CHANGE_ME); one this
    short is warned about, and masked only where it stands whole, never inside a word."""
    extra = {"ARONA_MEMORY_TOKEN": "x", "ARONA_LOG_LEVEL": "info"}
    async with gateway_up(tmp_path / "data", extra) as up, httpx.AsyncClient(timeout=30) as client:
        chat = {"model": "echo", "messages": [{"role": "user", "content": FACT}]}
        reply = await client.post(f"{up.http_url}/v1/chat/completions", json=chat)
        assert reply.status_code == 200
        await wait_for_writebacks(up, client, 1)
    warnings = [line for line in up.stderr.splitlines() if "ARONA_MEMORY_TOKEN is" in line]
    assert len(warnings) == 1, up.stderr
    assert "1 character(s) long" in warnings[0]
    assert "(memory enabled, plaintext, no token)" in up.stderr
    assert "***" not in up.stderr


async def test_up_reuses_its_dev_secrets(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with gateway_up(data_dir):
        pass
    secrets_file = data_dir / "dev-secrets.json"
    first = secrets_file.read_text()
    assert oct(secrets_file.stat().st_mode & 0o777) == "0o600"
    async with gateway_up(data_dir) as up, httpx.AsyncClient(timeout=30) as client:
        # A JWT minted by the second start verifies against the same secret.
        status = await up.rpc(client, "memory.status")
        assert status["enabled"] is True
    assert secrets_file.read_text() == first


async def test_an_idle_client_connection_outlives_the_clients_own_keep_alive(
    tmp_path: Path,
) -> None:
    # Clients keep idle connections for 5 s (the OpenAI SDK) or 60 s (load balancers): the
    # gateway must not close one first, or a request sent as it closes is lost.
    async with gateway_up(tmp_path / "data") as up:
        host, port = up.http_url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        request = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
        try:
            for turn in range(2):
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
                assert length is not None, head
                await reader.readexactly(int(length.group(1)))
                if turn == 0:
                    # Idle for longer than a 5 s client pool: the connection stays open
                    # (an end of stream here is the gateway closing it), and the second
                    # request goes out on it.
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(reader.read(1), 6.0)
        finally:
            writer.close()


async def test_up_shows_both_parts_metrics_on_one_listener(tmp_path: Path) -> None:
    async with httpx.AsyncClient(timeout=30) as client, gateway_up(tmp_path / "data") as up:
        assert f"metrics  {up.http_url}/metrics" in up.banner
        turn = await client.post(
            f"{up.http_url}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": FACT}]},
        )
        assert turn.status_code == 200
        text = (await client.get(f"{up.http_url}/metrics")).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        turns = (
            "arona_turns_total",
            (("memory", "disabled"), ("outcome", "ok"), ("surface", "rest")),
        )
        assert samples[turns] == 1
        recalls = ("arona_philia_calls_total", (("method", "query"), ("outcome", "ok")))
        assert samples[recalls] == 1
        assert samples["arona_memory_breaker_state", (("state", "closed"),)] == 1


def _hints(banner: str) -> list[str]:
    """The lines under "Try it", as printed (without their indent)."""
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Try it")) + 1
    hints: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            break
        hints.append(line.strip())
    return hints


def forget_hint(banner: str) -> str:
    """The command line under "Forget what the chat line stored", as printed."""
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Forget what")) + 1
    return lines[start].strip()


async def run_in_shell(line: str, exported: dict[str, str] | None = None) -> str:
    """``line`` run by bash in this directory with no ARONA_* variable set but ``exported``;
    its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(exported or {})
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-ec",
        line,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()


def _is_the_installed_grpcurl(path: str) -> bool:
    return Path(path).is_file() and os.path.samefile(path, grpcurl_path())


@dataclass
class CurlReply:
    status: int
    headers: dict[str, str]
    body: str


async def _curl(assignment: str, line: str, jwt: str) -> CurlReply:
    """Run a banner's curl line as a user would: in a shell after the JWT line (or, on a
    machine without curl, the same request through httpx)."""
    if shutil.which("curl") is not None:
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-ec",
            f"{assignment}\n{line}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, err.decode()
        text = out.decode()
    else:
        args = shlex.split(line.replace("$JWT", jwt))
        assert args[0] == "curl"
        url = next(a for a in args[1:] if a.startswith("http"))
        headers = dict(args[i + 1].split(": ", 1) for i, a in enumerate(args) if a == "-H")
        data = args[args.index("-d") + 1]
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(url, content=data, headers=headers)
        head = "".join(f"{k}: {v}\r\n" for k, v in response.headers.items())
        text = f"HTTP/1.1 {response.status_code}\r\n{head}\r\n{response.text}"
        if "-i" not in line.split():
            text = response.text
    if not text.startswith("HTTP/"):
        return CurlReply(200, {}, text)
    head, _, body = text.partition("\r\n\r\n")
    status_line, *header_lines = head.split("\r\n")
    headers = {}
    for header in header_lines:
        name, _, value = header.partition(":")
        headers[name.strip().lower()] = value.strip()
    return CurlReply(int(status_line.split()[1]), headers, body)


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"ARONA_API_KEYS": "team-a=sk-team-a"},
        {"ARONA_MEMORY_SCOPE": "user"},
        {"ARONA_MEMORY_SCOPE": "user", "ARONA_API_KEYS": "team-a=sk-team-a"},
    ],
    ids=["shared", "shared-keys", "user", "user-keys"],
)
async def test_the_banners_hints_work_as_printed(tmp_path: Path, mode: dict[str, str]) -> None:
    async with gateway_up(tmp_path / "data", mode) as up, httpx.AsyncClient(timeout=30) as client:
        assignment, chat, status, grpcurl = _hints(up.banner)
        assert assignment == f"JWT={up.jwt}"
        first = await _curl(assignment, chat, up.jwt)
        assert first.status == 200, first
        assert first.headers["x-arona-memory"] == "disabled"
        await wait_for_writebacks(up, client, 1)
        # The same line again recalls the first turn: it was a caller's, stored and recalled
        # in that caller's memory.
        again = await _curl(assignment, chat, up.jwt)
        assert (again.status, again.headers["x-arona-memory"]) == (200, "enabled"), again
        assert (
            "User: I prefer oolong tea"
            in json.loads(again.body)["choices"][0]["message"]["content"]
        )
        # The JWT line may read memory.status, in user mode too.
        reply = json.loads((await _curl(assignment, status, up.jwt)).body)
        assert reply["result"]["enabled"] is True, reply
        assert reply["result"]["scope"] == mode.get("ARONA_MEMORY_SCOPE", "shared")
        # grpcurl by the path printed, relative to where `up` runs (here, this directory).
        args = shlex.split(grpcurl)
        assert _is_the_installed_grpcurl(args[0]), args[0]
        ran = await run_grpcurl(*args[1:])
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["enabled"] is True
        await wait_for_writebacks(up, client, 2)
        anonymous = "ARONA_API_KEYS" not in mode and "ARONA_MEMORY_SCOPE" not in mode
        if anonymous:
            # The JWT's own forget reaches none of them (they are no principal's), and says
            # what it acted on and how to reach them.
            own = await up.rpc(client, "memory.forget")
            assert (own["deleted"], own["target"]) == (0, {"scope": "dev"}), own
            assert 'memory.forget {"anonymous": true}' in own["hint"]
        # The forget line as printed, in a shell without the gateway's environment: this
        # gateway's address and data directory are on it.
        forget = forget_hint(up.banner)
        assert forget.endswith("--anonymous" if anonymous else "--principal dev"), forget
        done = await run_in_shell(forget)
        # The two turns were one episode: the same turn again moves it, adds no copy.
        assert done.startswith("forgot 1 episode(s) of "), done
        # Nothing left to recall: the same line again injects nothing.
        third = await _curl(assignment, chat, up.jwt)
        assert (third.status, third.headers["x-arona-memory"]) == (200, "disabled"), third
