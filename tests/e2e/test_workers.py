"""``arona-gateway serve --workers 2``: two HTTP processes on one port, the gRPC service in a
third, the SQLite files shared, SIGTERM draining all of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.support.fake_philia import FakePhilia
from tests.support.fake_upstream import FakeUpstream, Stream
from tests.support.served import served

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
PHILIA_TOKEN = "philia-secret-token"


def _children(pid: int) -> list[str]:
    """The command lines of a process's children (from /proc)."""
    return [argv for _, argv in _child_pids(pid)]


async def test_two_workers_share_one_port_and_one_conversation_database(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(tmp_path), ARONA_HTTP_PORT="0", ARONA_GRPC_PORT="0")
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "serve",
        "--workers",
        "2",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    log: list[str] = []
    url = None
    try:
        while url is None:
            raw = await asyncio.wait_for(process.stderr.readline(), 60)
            assert raw, "\n".join(log)
            log.append(raw.decode().rstrip())
            found = re.search(r"serving on (http://\S+) \(2 HTTP workers\)", log[-1])
            url = found.group(1) if found else None
        drain = asyncio.create_task(_drain(process, log))
        children = _children(process.pid)
        assert sum("--only http" in c for c in children) == 2, children
        assert sum("--only grpc" in c for c in children) == 1, children

        # Fresh connections land on either worker; the conversation is one for both.
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            conversation = (await client.post("/v1/conversations", json={})).json()["id"]
        for i in range(20):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "echo",
                        "conversation_id": conversation,
                        "memory": False,
                        "messages": [{"role": "user", "content": f"turn {i}"}],
                    },
                )
                assert response.status_code == 200
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            history = (await client.get(f"/v1/conversations/{conversation}")).json()["messages"]
        assert [m["content"] for m in history if m["role"] == "user"] == [
            f"turn {i}" for i in range(20)
        ]
        # Both workers started their app (each logs its own start-up).
        assert sum("Application startup complete" in line for line in log) == 2
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 60)
    await drain
    assert process.returncode == 0, "\n".join(log)
    assert _children(process.pid) == []
    assert "Traceback" not in "\n".join(log)
    assert sum("Application shutdown complete" in line for line in log) == 2


async def _drain(process: asyncio.subprocess.Process, log: list[str]) -> None:
    assert process.stderr is not None
    async for raw in process.stderr:
        log.append(raw.decode().rstrip())


async def test_sigterm_to_the_process_group_drains_the_workers_before_the_grpc_service(
    tmp_path: Path,
) -> None:
    """What systemd's default ``KillMode=control-group`` and Ctrl-C in a terminal do: every
    process gets the signal at once. Turns in flight still finish, their writebacks reach
    Philia through the gRPC service, and that service stops only after both workers."""
    turns = 4
    async with FakePhilia(token=PHILIA_TOKEN) as philia, FakeUpstream.start() as upstream:
        streams = [Stream(pieces=["one ", "two ", "three"], pause_after=1) for _ in range(turns)]
        upstream.script(*streams)
        philia.memories = [{"text": "I prefer oolong tea", "score": 0.8, "node_type": "entity"}]
        env = {
            "ARONA_MEMORY_URL": philia.url,
            "ARONA_MEMORY_TOKEN": PHILIA_TOKEN,
            "ARONA_UPSTREAM_URL": upstream.base_url,
        }
        # A process group of its own, as under systemd.
        async with served(tmp_path, "--workers", "2", env=env, new_session=True) as gateway:
            process = gateway.process
            try:
                async with asyncio.TaskGroup() as group:
                    replies = [
                        group.create_task(_streamed_turn(gateway.url, f"turn {i}"))
                        for i in range(turns)
                    ]
                    for stream in streams:
                        await asyncio.wait_for(stream.paused.wait(), 30)
                    os.killpg(process.pid, signal.SIGTERM)
                    # Both workers have the signal (and wait for their open streams).
                    await gateway.wait_for("uvicorn.error: Shutting down", 2)
                    for stream in streams:
                        stream.resume.set()
                for reply in replies:
                    assert reply.result() == (200, "one two three")
                await gateway.ended()
            finally:
                if process.returncode is None:
                    os.killpg(process.pid, signal.SIGKILL)
        text = "\n".join(gateway.log)
        assert process.returncode == 0, text
        # Every answered turn reached Philia now, none waits in a journal for the next start.
        assert sorted(s["text"] for s in philia.stored) == sorted(
            f"User: turn {i}\nAssistant: one two three" for i in range(turns)
        ), text
        assert "no stream to the memory service is open" not in text
        assert "Traceback" not in text
        # By the time on each line (the three processes' lines interleave as they are copied).
        worker_ends = [_logged_at(x) for x in gateway.matching("Application shutdown complete")]
        (service_end,) = [_logged_at(x) for x in gateway.matching("MemoryService stopped")]
        assert len(worker_ends) == 2 and max(worker_ends) <= service_end, text


def _logged_at(line: str) -> datetime:
    """The time at the start of a log line (``2026-12-02 04:24:56,757 INFO …``)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


async def _streamed_turn(url: str, text: str) -> tuple[int, str]:
    """One streamed chat turn on a connection of its own, in a conversation of its own (a
    streamed REST turn is written back in a conversation): its status and its content."""
    content = ""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        created = await client.post("/v1/conversations", json={})
        body = {
            "model": "fake-model",
            "stream": True,
            "conversation_id": created.json()["id"],
            "messages": [{"role": "user", "content": text}],
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        content += choice["delta"].get("content") or ""
        return response.status_code, content


async def test_the_grpc_service_does_not_outlive_a_killed_supervisor(tmp_path: Path) -> None:
    """It ignores stop signals, so it must end by itself when ``serve`` is SIGKILLed."""
    async with served(tmp_path, "--workers", "2", new_session=True) as gateway:
        process = gateway.process
        try:
            (service,) = [p for p, argv in _child_pids(process.pid) if "--only grpc" in argv]
            ended = _process_end(service)
            process.kill()
            await asyncio.wait_for(ended, 30)
        finally:
            os.killpg(process.pid, signal.SIGKILL)  # the HTTP workers, orphaned


def _child_pids(pid: int) -> list[tuple[int, str]]:
    """Each child of a process: its pid and command line (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append((int(entry.name), argv))
    return found


def _process_end(pid: int) -> asyncio.Future[None]:
    """Done when process ``pid`` (not a child of ours) has ended: its pidfd turns readable."""
    loop = asyncio.get_running_loop()
    fd = os.pidfd_open(pid)
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, readable)
    return ended


async def test_a_second_sigterm_while_turns_drain_changes_nothing_a_second_ctrl_c_forces(
    tmp_path: Path,
) -> None:
    """A supervisor (or an impatient script) repeating SIGTERM must not cut the streams the
    first one let finish; a second Ctrl-C, as in uvicorn, stops without waiting for them."""
    async with FakeUpstream.start() as upstream:
        streams = [Stream(pieces=["one ", "two ", "three"], pause_after=1) for _ in range(2)]
        upstream.script(*streams)
        env = {"ARONA_MEMORY_URL": "", "ARONA_UPSTREAM_URL": upstream.base_url}
        async with served(tmp_path / "term", env=env) as gateway:
            reply = asyncio.create_task(_streamed_turn(gateway.url, "turn"))
            await asyncio.wait_for(streams[0].paused.wait(), 30)
            gateway.process.send_signal(signal.SIGTERM)
            await gateway.wait_for("uvicorn.error: Shutting down")
            gateway.process.send_signal(signal.SIGTERM)
            await gateway.wait_for("Waiting for connections to close")
            streams[0].resume.set()
            assert await asyncio.wait_for(reply, 60) == (200, "one two three")
            await gateway.ended()
            assert gateway.process.returncode == 0, "\n".join(gateway.log)
        async with served(tmp_path / "int", env=env) as gateway:
            reply = asyncio.create_task(_streamed_turn(gateway.url, "turn"))
            await asyncio.wait_for(streams[1].paused.wait(), 30)
            gateway.process.send_signal(signal.SIGINT)
            await gateway.wait_for("Waiting for connections to close")
            gateway.process.send_signal(signal.SIGINT)
            # Forced: the paused stream is cut and the process ends without it.
            await gateway.ended()
            assert gateway.process.returncode == 0, "\n".join(gateway.log)
            with pytest.raises(httpx.HTTPError):
                await asyncio.wait_for(reply, 60)
