"""``arona-gateway import FILE`` as a real process, against a real gRPC service (a grpc.aio
server on port 0) over a scripted Philia or the embedded store: dated episodes, scopes,
progress output (a terminal and a pipe), bad lines, and a SIGKILL mid-import then a re-run."""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import pty
import signal
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.scopes import scope_id, scoped_node_type
from arona_grpc.server import GrpcServer
from arona_store.server import StoreServer
from tests.support.fake_philia import STORE, FakePhilia, Step
from tests.support.raw_philia import closed_port

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
TOKEN = "import-t0ken"
# 2023-05-08T13:56:00Z
MAY_8 = 1683554160


@dataclass
class Service:
    philia: FakePhilia
    grpc: GrpcServer


async def start_service(memory_url: str, data_dir: Path, scope: str = "shared") -> GrpcServer:
    """The gRPC service (port 0) in front of the Philia at ``memory_url``."""
    return await GrpcServer.start(
        Settings(
            memory_url=memory_url,
            memory_token=TOKEN,
            memory_timeout_s=5.0,
            grpc_port=0,
            memory_scope=scope,
            data_dir=data_dir,
        )
    )


@pytest_asyncio.fixture
async def service(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Service]:
    scope = getattr(request, "param", "shared")
    async with FakePhilia(token=TOKEN) as philia:
        server = await start_service(philia.url, tmp_path / "service", scope)
        try:
            yield Service(philia, server)
        finally:
            await server.stop(grace=1)


def env_for(tmp_path: Path, target: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(tmp_path / "cli"), ARONA_GRPC_TARGET=target)
    return env


@dataclass
class Run:
    code: int
    out: str
    err: str


async def run_import(tmp_path: Path, target: str, *args: str) -> Run:
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "import",
        *args,
        env=env_for(tmp_path, target),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return Run(process.returncode, out.decode(), err.decode())


def write_lines(path: Path, *lines: Any) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def conversation(*texts: str, **fields: Any) -> dict[str, Any]:
    """A conversation of alternating user and assistant messages."""
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(texts)]
    return {"messages": messages, **fields}


def sent_at(params: dict[str, Any]) -> int:
    return calendar.timegm(time.strptime(params["properties"]["occurred_at"], "%Y-%m-%dT%H:%M:%SZ"))


async def test_conversations_and_turns_are_stored_with_their_times(
    tmp_path: Path, service: Service
) -> None:
    history = write_lines(
        tmp_path / "history.jsonl",
        {
            "conversation_id": "c-1",
            "time": "2023-05-08T13:56:00Z",
            "messages": [
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "I moved to Lisbon last week."},
                {"role": "assistant", "content": "Congratulations on the move!"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "My cat is called Miso."}],
                    "time": "2023-05-08T16:02:00+02:00",
                },
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "looked it up", "tool_call_id": "t1"},
                {"role": "assistant", "content": "Miso is a lovely name."},
            ],
        },
        "",
        {
            "request": {"model": "m", "messages": [{"role": "user", "content": "I like oolong."}]},
            "response": {
                "created": MAY_8 + 60,
                "choices": [{"message": {"role": "assistant", "content": "Noted: oolong."}}],
            },
        },
        conversation("an undated turn", "ok"),
    )
    run = await run_import(tmp_path, service.grpc.target, str(history))
    assert run.code == 0, run.err
    assert run.out.strip() == "imported 3 lines (4 episodes)"
    stored = service.philia.stored
    # Undated: no property, the service's own time, as for a chat turn.
    assert {s["text"]: s.get("properties") for s in stored} == {
        "User: I moved to Lisbon last week.\nAssistant: Congratulations on the move!": {
            "occurred_at": "2023-05-08T13:56:00Z"
        },
        "User: My cat is called Miso.\nAssistant: Miso is a lovely name.": {
            "occurred_at": "2023-05-08T14:02:00Z"
        },
        "User: I like oolong.\nAssistant: Noted: oolong.": {"occurred_at": "2023-05-08T13:57:00Z"},
        "User: an undated turn\nAssistant: ok": None,
    }
    assert {s["node_type"] for s in stored} == {"episode"}
    # Not a terminal: plain progress lines, the last one at 100 %.
    progress = [line for line in run.err.splitlines() if line.startswith("import: ")]
    assert progress[-1].startswith("import: 3/3 lines (100%), 4 episodes"), run.err
    assert len(progress) == 3
    # The progress file sits beside the input: the same import again sends nothing.
    assert (tmp_path / "history.jsonl.progress").exists()
    again = await run_import(tmp_path, service.grpc.target, str(history))
    assert (again.code, again.out.strip()) == (
        0,
        "imported 0 lines (0 episodes); 3 lines already imported",
    )
    assert len(service.philia.frames_of(STORE)) == 4


async def test_bad_lines_are_reported_and_nothing_of_them_is_stored(
    tmp_path: Path, service: Service
) -> None:
    history = write_lines(
        tmp_path / "history.jsonl",
        conversation("first good line", "ok", time="2023-05-08T13:56:00Z"),
        '{"messages": [',
        # Its first turn is fine; the second's time is not: none of it may be stored.
        {
            "messages": [
                {"role": "user", "content": "half a conversation"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "later", "time": "next tuesday"},
                {"role": "assistant", "content": "ok"},
            ]
        },
        conversation("from the future", "ok", time="2999-01-01T00:00:00Z"),
        conversation("before 1970", "ok", time=-5),
        conversation("naive time", "ok", time="2023-05-08T13:56:00"),
        {"messages": [{"role": "robot", "content": "beep"}]},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        ["not", "an", "object"],
        {"mesages": []},
        conversation("a bad user", "ok", user=7),
        # Without --user a line's user is a principal, which has at most 128 characters.
        conversation("a long user", "ok", user="u" * 200),
        {
            "request": {"messages": [{"role": "user", "content": "q"}]},
            "response": {"choices": [{"message": {"role": "user", "content": "a"}}]},
        },
        conversation("last good line", "ok"),
    )
    run = await run_import(tmp_path, service.grpc.target, str(history))
    assert run.code == 1
    reports = [line for line in run.err.splitlines() if line.startswith(str(history))]
    assert reports == [
        f"{history}:2: not JSON: Expecting value (column 15)",
        f"{history}:3: 'messages[2].time' is not an RFC 3339 time "
        """("2023-05-08T13:56:00Z"): 'next tuesday'""",
        f"{history}:4: 'time' is in the future (more than 300 s from now): '2999-01-01T00:00:00Z'",
        f"{history}:5: 'time' is before 1970-01-01T00:00:00Z",
        f"{history}:6: 'time' needs a time zone (\"2023-05-08T13:56:00Z\"): '2023-05-08T13:56:00'",
        f"{history}:7: 'messages[0].role' must be one of assistant, developer, function, "
        "system, tool, user",
        f"{history}:8: no user or assistant text to import",
        f"{history}:9: a line must be a JSON object",
        f"{history}:10: a line needs 'messages' (a conversation) or 'request' and 'response' "
        "(a turn)",
        f"{history}:11: 'user' must be a string",
        f"{history}:12: 'user' cannot be a memory scope: scope: its principal (before the "
        "first '/') must be 1 to 128 characters, not blank",
        f"{history}:13: 'response.choices[0].message.role' must be assistant",
    ]
    assert run.out.strip() == (
        "imported 2 lines (2 episodes); 12 bad lines (listed above; nothing of them is stored)"
    )
    assert sorted(s["text"] for s in service.philia.stored) == [
        "User: first good line\nAssistant: ok",
        "User: last good line\nAssistant: ok",
    ]
    # --check reads the same file, stores nothing and says the same; its progress counts
    # lines checked, not episodes stored.
    checked = await run_import(tmp_path, service.grpc.target, "--check", str(history))
    assert checked.code == 1
    assert checked.out.strip() == "checked 14 lines: 2 valid, 12 bad"
    assert [line for line in checked.err.splitlines() if line.startswith(str(history))] == reports
    progress = [line for line in checked.err.splitlines() if not line.startswith(str(history))]
    assert progress[-1].startswith("check: 14/14 lines (100%), 2 valid, 12 bad, "), checked.err
    assert all(line.startswith("check: ") for line in progress), checked.err
    assert "episode" not in checked.out + checked.err
    assert len(service.philia.frames_of(STORE)) == 2


async def test_a_line_nested_too_deeply_is_bad_and_the_rest_is_imported(
    tmp_path: Path, service: Service
) -> None:
    depth = 200_000
    history = write_lines(
        tmp_path / "history.jsonl",
        conversation("before the deep line", "ok"),
        "[" * depth + "]" * depth,
        '{"messages": ' + "[" * depth + "]" * depth + "}",
        conversation("after the deep line", "ok"),
    )
    reason = "nested too deeply (more than about 1,000 arrays and objects within one another)"
    checked = await run_import(tmp_path, service.grpc.target, "--check", str(history))
    assert (checked.code, checked.out.strip()) == (1, "checked 4 lines: 2 valid, 2 bad")
    assert "Traceback" not in checked.err
    reports = [f"{history}:2: {reason}", f"{history}:3: {reason}"]
    assert [line for line in checked.err.splitlines() if line.startswith(str(history))] == reports
    run = await run_import(tmp_path, service.grpc.target, str(history))
    assert "Traceback" not in run.err
    assert [line for line in run.err.splitlines() if line.startswith(str(history))] == reports
    assert (run.code, run.out.strip()) == (
        1,
        "imported 2 lines (2 episodes); 2 bad lines (listed above; nothing of them is stored)",
    )
    assert sorted(s["text"] for s in service.philia.stored) == [
        "User: after the deep line\nAssistant: ok",
        "User: before the deep line\nAssistant: ok",
    ]


@pytest.mark.parametrize("service", ["user"], indirect=True)
async def test_a_users_history_goes_into_their_scope(tmp_path: Path, service: Service) -> None:
    history = write_lines(
        tmp_path / "history.jsonl",
        conversation("I am Bob and I play the cello", "Nice!", user="bob", time=MAY_8),
        conversation("a turn of the principal itself", "ok", time=MAY_8),
    )
    run = await run_import(tmp_path, service.grpc.target, "--user", "key:team-a", str(history))
    assert run.code == 0, run.err
    node_types = {s["text"]: s["node_type"] for s in service.philia.stored}
    # The scopes a chat of key team-a with "user": "bob", and without, would have.
    assert node_types == {
        "User: I am Bob and I play the cello\nAssistant: Nice!": scoped_node_type(
            scope_id("key:team-a/bob")
        ),
        "User: a turn of the principal itself\nAssistant: ok": scoped_node_type(
            scope_id("key:team-a")
        ),
    }
    async with grpc.aio.insecure_channel(service.grpc.target) as channel:
        page = await pb_grpc.MemoryServiceStub(channel).List(pb.ListRequest(scope="key:team-a/bob"))
    assert [e.preview for e in page.episodes] == [
        "User: I am Bob and I play the cello Assistant: Nice!"
    ]

    # Without --user, a line without a user has no scope on a service that keeps users apart.
    bare = write_lines(tmp_path / "bare.jsonl", conversation("whose is this?", "nobody's"))
    refused = await run_import(tmp_path, service.grpc.target, str(bare))
    assert refused.code == 1
    assert f"{bare}:1: no user: the memory service keeps each user's memory apart" in refused.err
    assert len(service.philia.stored) == 2


async def test_a_terminal_gets_a_progress_bar(tmp_path: Path, service: Service) -> None:
    history = write_lines(
        tmp_path / "history.jsonl", *(conversation(f"fact {i}", "ok") for i in range(30))
    )
    leader, follower = pty.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            COMMAND,
            "import",
            str(history),
            env=env_for(tmp_path, service.grpc.target),
            stdout=asyncio.subprocess.PIPE,
            stderr=follower,
        )
        os.close(follower)
        follower = -1
        out, _ = await asyncio.wait_for(process.communicate(), 120)
        screen = _read_all(leader)
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)
    assert process.returncode == 0
    assert out.decode().strip() == "imported 30 lines (30 episodes)"
    frames = screen.split("\r\x1b[K")
    # Redrawn in place, never a line per step; it ends full.
    assert "importing [" in frames[1], screen
    assert frames[-1].startswith("importing [" + "█" * 28 + "] 30/30 lines (100%), 30 episodes")
    assert "import: " not in screen


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed (EIO on Linux)
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


async def test_a_sigkill_mid_import_then_a_rerun_stores_each_turn_once(
    tmp_path: Path, service: Service
) -> None:
    lines, turns = 20, 3
    history = write_lines(
        tmp_path / "history.jsonl",
        *(
            conversation(
                *(text for t in range(turns) for text in (f"line {i} turn {t}", "ok")),
                time=MAY_8 + i * 86_400,
            )
            for i in range(lines)
        ),
    )
    expected = {
        f"User: line {i} turn {t}\nAssistant: ok": MAY_8 + i * 86_400
        for i in range(lines)
        for t in range(turns)
    }
    # Philia stalls after 25 stores: the next 32 (as many as the import sends at a time,
    # from line 8's second turn on) get no answer, and the import is killed while they wait,
    # half-way through conversations. (A store Philia makes after its caller left is a lost
    # answer: the service keeps the episode in its outbox, and a Philia that does not
    # recognise the same episode, unlike the embedded store, may then keep two copies.)
    answered, stalled = 25, 32
    service.philia.script(
        STORE, *(Step() for _ in range(answered)), *(Step(action="hang") for _ in range(stalled))
    )
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "import",
        str(history),
        env=env_for(tmp_path, service.grpc.target),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await asyncio.wait_for(service.philia.wait_frames(STORE, answered + stalled), 60)
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    assert process.returncode == -signal.SIGKILL
    assert len(service.philia.stored) == answered

    run = await run_import(tmp_path, service.grpc.target, str(history))
    assert run.code == 0, run.err
    assert "lines already imported" in run.out
    await asyncio.wait_for(service.philia.wait_stored(len(expected)), 30)
    texts = Counter(s["text"] for s in service.philia.stored)
    assert set(texts) == set(expected)
    assert max(texts.values()) == 1, [t for t, n in texts.items() if n > 1]
    assert all(sent_at(s) == expected[s["text"]] for s in service.philia.stored)


async def test_ctrl_c_finishes_the_line_under_way_and_a_rerun_goes_on(
    tmp_path: Path, service: Service
) -> None:
    history = write_lines(
        tmp_path / "history.jsonl",
        *(conversation(f"line {i} asks", "ok", f"line {i} again", "ok") for i in range(6)),
    )
    # One turn at a time. The third store (line 1, its first turn) hangs until the service
    # gives up on it (5 s) and keeps it in its outbox; Ctrl-C comes meanwhile.
    service.philia.script(STORE, Step(), Step(), Step(action="hang"))
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        "import",
        "--concurrency",
        "1",
        str(history),
        env=env_for(tmp_path, service.grpc.target),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.wait_for(service.philia.wait_frames(STORE, 3), 60)
    process.send_signal(signal.SIGINT)
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 130
    # The turn under way ends (queued); no other is started: line 1 is half done.
    assert out.decode().splitlines() == [
        "imported 1 line (3 episodes, 1 of them queued in the memory service's outbox)",
        "stopped after 1 of 6 lines; run the same command again to go on",
    ]
    run = await run_import(tmp_path, service.grpc.target, str(history))
    assert (run.code, run.out.strip()) == (
        0,
        "imported 5 lines (9 episodes); 1 line already imported",
    )
    texts = Counter(s["text"] for s in service.philia.stored)
    assert sorted(texts) == sorted(
        f"User: line {i} {word}\nAssistant: ok" for i in range(6) for word in ("asks", "again")
    )
    assert set(texts.values()) == {1}


async def test_an_import_into_the_embedded_store_keeps_each_turns_time(tmp_path: Path) -> None:
    store = await StoreServer.start(
        db_path=tmp_path / "memory.db", token=TOKEN, host="127.0.0.1", port=0
    )
    server = await start_service(store.url, tmp_path / "service")
    try:
        history = write_lines(
            tmp_path / "history.jsonl",
            *(conversation(f"fact number {i}", "noted", time=MAY_8 + i * 3600) for i in range(12)),
        )
        process = await asyncio.create_subprocess_exec(
            COMMAND,
            "import",
            str(history),
            env=env_for(tmp_path, server.target),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None
        # Killed once it says it has begun (a tenth of the lines).
        first = await asyncio.wait_for(process.stderr.readline(), 60)
        assert first.startswith(b"import: ")
        process.send_signal(signal.SIGKILL)
        await process.wait()
        run = await run_import(tmp_path, server.target, str(history))
        assert run.code == 0, run.err
    finally:
        await server.stop(grace=1)
        await store.stop()
    with sqlite3.connect(tmp_path / "memory.db") as db:
        rows = db.execute("SELECT text, properties FROM nodes ORDER BY text").fetchall()
    assert sorted(text for text, _ in rows) == sorted(
        f"User: fact number {i}\nAssistant: noted" for i in range(12)
    )
    times = {text: json.loads(properties)["occurred_at"] for text, properties in rows}
    assert times["User: fact number 3\nAssistant: noted"] == "2023-05-08T16:56:00Z"


async def test_an_unreachable_service_is_one_clear_line(tmp_path: Path) -> None:
    history = write_lines(tmp_path / "history.jsonl", conversation("hello", "hi"))
    port = closed_port()
    run = await run_import(tmp_path, f"127.0.0.1:{port}", str(history))
    assert run.code == 2
    assert run.err.strip() == (
        f"arona-gateway: error: cannot reach the memory service at 127.0.0.1:{port} "
        "(is `arona-gateway up` or `serve` running? ARONA_GRPC_TARGET names it)"
    )


async def test_a_logged_tool_loop_is_one_episode(tmp_path: Path, service: Service) -> None:
    asked = {"role": "user", "content": "What's the weather in Lyon?"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Lyon"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}
    history = write_lines(
        tmp_path / "loop.jsonl",
        # The loop's first step, as a request log has it: the model calls a tool.
        {
            "request": {"model": "m", "messages": [asked]},
            "response": {"created": MAY_8, "choices": [{"message": call}]},
        },
        # Its last: the tool's result sent back, the final answer.
        {
            "request": {"model": "m", "messages": [asked, call, result]},
            "response": {
                "created": MAY_8 + 5,
                "choices": [{"message": {"role": "assistant", "content": "Sunny, 21 °C."}}],
            },
        },
    )
    run = await run_import(tmp_path, service.grpc.target, str(history))
    assert run.code == 0, run.err
    # The step is no bad line: it is the loop's, stored with its final answer.
    assert run.out.strip() == "imported 2 lines (1 episode)"
    assert [s["text"] for s in service.philia.stored] == [
        "User: What's the weather in Lyon?\nAssistant: Sunny, 21 °C."
    ]
