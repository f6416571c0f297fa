"""Forget means gone: what a user asked to forget is in no file, table, index or answer.

``arona-gateway up`` runs as a user runs it (the embedded store, the gRPC service, the HTTP
gateway, the ``echo`` model), in ``user`` mode, on SQLite files or with PostgreSQL. Alice tells
it a made-up word on every surface — REST JSON, SSE with a conversation, ``chat.send``, a gRPC
``Writeback``, ``arona-gateway import`` — and Bob one of his own. Every turn's question holds
its word, so the status events hold them too. Alice forgets; then not one of her words is found
by ``memory.list``, ``memory.status``, ``memory.recall``, her conversations, a raw recall of
the store from this (another) process, any table, or — byte for byte — any file of the data
directory, after a clean stop or a SIGKILL; a restart recalls none of them. Bob's word is
found where it should be all along: the search would see one left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.philia import PhiliaClient
from gateway_http.auth import mint_token
from tests.support.erasure import files_holding, tables_holding

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.timeout(300)]

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
BANNER_END = "Ctrl-C stops everything."
JWT_SECRET = "an-hs256-secret-for-the-erasure-test-0123456789"
STORE_TOKEN = "store-token-of-the-erasure-test"
# One made-up word a surface, so a leftover says where it came from.
WORDS = {
    "rest": "Quorvandel",
    "sse": "Plimsoxter",
    "rpc": "Drezzlewick",
    "grpc": "Vantrobule",
    "import": "Skelloquin",
}
KEPT = "Marrowfinch"


def _jwt(sub: str, *, admin: bool = False) -> str:
    return mint_token(JWT_SECRET, sub, 3600, admin=admin)


ALICE, BOB, ADMIN = _jwt("alice"), _jwt("bob"), _jwt("ops", admin=True)


@dataclass
class Up:
    process: asyncio.subprocess.Process
    http: str
    grpc: str
    store: str
    banner: str = ""
    stderr: list[str] = field(default_factory=list)


def _env(data_dir: Path, database_url: str | None, scope: str = "user") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(
        ARONA_DATA_DIR=str(data_dir),
        ARONA_HTTP_PORT="0",
        ARONA_GRPC_PORT="0",
        ARONA_MEMORY_SCOPE=scope,
        ARONA_JWT_SECRET=JWT_SECRET,
        ARONA_MEMORY_TOKEN=STORE_TOKEN,
        ARONA_LOG_LEVEL="info",
    )
    if database_url is not None:
        env["ARONA_DATABASE_URL"] = database_url
    return env


@asynccontextmanager
async def running(env: dict[str, str], *, kill: bool = False) -> AsyncIterator[Up]:
    """``arona-gateway up``, stopped by Ctrl-C (or SIGKILL with ``kill``) at the end."""
    process = await asyncio.create_subprocess_exec(
        COMMAND, "up", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    lines: list[str] = []

    async def banner() -> None:
        assert process.stdout is not None
        while not lines or lines[-1] != BANNER_END:
            raw = await process.stdout.readline()
            assert raw, "arona-gateway up exited before it was ready"
            lines.append(raw.decode().rstrip("\n"))

    try:
        await asyncio.wait_for(banner(), 60)
        text = "\n".join(lines)
        found = [
            re.search(pattern, text)
            for pattern in (r"HTTP\s+(http://\S+)", r"gRPC\s+(\S+)", r"memory\s+(ws://\S+)")
        ]
        assert all(found), text
        http, grpc_target, store = (m.group(1) for m in found if m is not None)
        up = Up(process, http, grpc_target, store, text)
        yield up
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), 60)
    log = err.decode()
    assert "Traceback" not in log
    if kill:
        assert process.returncode == -signal.SIGKILL
    else:
        assert process.returncode == 0, log
    up.stderr.append(log)


async def _rpc(
    client: httpx.AsyncClient, up: Up, bearer: str, method: str, params: Any = None
) -> Any:
    reply = (
        await client.post(
            f"{up.http}/api/rpc",
            json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}},
            headers={"Authorization": f"Bearer {bearer}"},
        )
    ).json()
    assert "result" in reply, reply
    return reply["result"]


async def _command(up: Up, env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    """``arona-gateway ARGV`` against the running ``up``: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        COMMAND,
        *argv,
        env={**env, "ARONA_GRPC_TARGET": up.grpc},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def _chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}], **fields}


async def _tell_everything(client: httpx.AsyncClient, up: Up, env: dict[str, str]) -> None:
    """Alice's word on every surface (each question holds it), and Bob's one."""
    alice = {"Authorization": f"Bearer {ALICE}"}
    rest = await client.post(
        f"{up.http}/v1/chat/completions",
        json=_chat(f"Remember that my bike lock word is {WORDS['rest']}"),
        headers=alice,
    )
    assert rest.status_code == 200, rest.text
    conversation = (await client.post(f"{up.http}/v1/conversations", json={}, headers=alice)).json()
    async with client.stream(
        "POST",
        f"{up.http}/v1/chat/completions",
        json=_chat(
            f"Remember that my hamster is called {WORDS['sse']}",
            stream=True,
            conversation_id=conversation["id"],
        ),
        headers=alice,
    ) as streamed:
        assert streamed.status_code == 200
        assert WORDS["sse"] in "".join([line async for line in streamed.aiter_lines()])
    said = await _rpc(
        client, up, ALICE, "chat.send", _chat(f"Remember my locker code {WORDS['rpc']}")
    )
    assert WORDS["rpc"] in said["content"]
    async with grpc.aio.insecure_channel(up.grpc) as channel:
        stored = await pb_grpc.MemoryServiceStub(channel).Writeback(
            pb.WritebackRequest(
                user=f"My boat is named {WORDS['grpc']}", assistant="Noted", scope="alice"
            )
        )
        assert stored.stored
    history = Path(env["ARONA_DATA_DIR"]).parent / "import" / "history.jsonl"
    history.parent.mkdir(exist_ok=True)
    line = {
        "messages": [
            {"role": "user", "content": f"My grandmother's village is {WORDS['import']}"},
            {"role": "assistant", "content": "What a lovely name"},
        ]
    }
    history.write_text(json.dumps(line) + "\n")
    code, out, err = await _command(up, env, "import", str(history), "--user", "alice")
    assert code == 0, (out, err)
    kept = await _rpc(client, up, BOB, "chat.send", _chat(f"My dog is called {KEPT}"))
    assert KEPT in kept["content"]


def _holding(text: str, words: Iterable[str]) -> list[str]:
    folded = text.lower()
    return [word for word in words if word.lower() in folded]


async def _store_recall(up: Up, words: Iterable[str]) -> list[str]:
    """The texts the store itself recalls for ``words``, asked from this process."""
    client = PhiliaClient(up.store, STORE_TOKEN, 10.0)
    try:
        texts: list[str] = []
        for word in words:
            texts += [m.text for m in await client.query(word, 20)]
        return texts
    finally:
        await client.aclose()


@pytest.mark.parametrize("stop", ["clean", "sigkill"])
async def test_a_forgotten_word_is_found_nowhere(
    tmp_path: Path, backend: str | None, stop: str
) -> None:
    await _forgotten_nowhere(tmp_path, backend, stop)


async def test_a_forgotten_word_is_found_nowhere_with_the_store_on_postgresql(
    tmp_path: Path, store_database_url: str
) -> None:
    await _forgotten_nowhere(tmp_path, None, "sigkill", store_database_url)


async def _forgotten_nowhere(
    tmp_path: Path, backend: str | None, stop: str, store_url: str | None = None
) -> None:
    """Alice's words told on every surface, then forgotten: found nowhere (module docstring);
    ``store_url``: the store keeps its memories in that PostgreSQL database."""
    data_dir = tmp_path / "data"
    env = _env(data_dir, backend)
    if store_url is not None:
        env["ARONA_STORE_DATABASE_URL"] = store_url
    words = list(WORDS.values())
    logs: list[str] = []
    async with httpx.AsyncClient(timeout=60) as client:
        async with running(env, kill=stop == "sigkill") as up:
            # The banner names the store's database (never its password).
            kept_in = "PostgreSQL postgresql://***@127.0.0.1" if store_url else "SQLite"
            assert f"(embedded Philia-compatible store, memories in {kept_in}" in up.banner
            await _tell_everything(client, up, env)
            listed = await _rpc(client, up, ALICE, "memory.list")
            assert len(listed["memories"]) == 5
            status = json.dumps(await _rpc(client, up, ADMIN, "memory.status", {"limit": 100}))
            # The events hold every chat turn's question (Writeback and import recall nothing).
            assert _holding(status, words) == [WORDS["rest"], WORDS["sse"], WORDS["rpc"]]
            if backend is None:
                # In the store, the index and the conversations (or their logs) for now.
                held = {name.split(".")[0] for name in files_holding(data_dir, words)}
                in_files = {"episodes", "conversations"} | (
                    {"memory"} if store_url is None else set()
                )
                assert held >= in_files
            if store_url is not None:
                assert set(await tables_holding(store_url, words)) == {"memory_nodes"}

            forgotten = await _rpc(client, up, ALICE, "memory.forget")
            assert forgotten == {"deleted": 5, "conversations": 1, "target": {"scope": "alice"}}

            assert (await _rpc(client, up, ALICE, "memory.list"))["memories"] == []
            status = json.dumps(await _rpc(client, up, ADMIN, "memory.status", {"limit": 100}))
            assert _holding(status, [*words, KEPT]) == [KEPT]
            for word in words:
                for scope in ("alice", "bob"):
                    recall = await _rpc(
                        client, up, ADMIN, "memory.recall", {"query": word, "scope": scope}
                    )
                    assert _holding(json.dumps(recall), words) == []
            conversations = await client.get(
                f"{up.http}/v1/conversations", headers={"Authorization": f"Bearer {ALICE}"}
            )
            assert conversations.json()["data"] == []
            recalled = await _store_recall(up, [*words, KEPT])
            assert _holding(" ".join(recalled), [*words, KEPT]) == [KEPT]
            if backend is not None:
                assert await tables_holding(backend, [*words, KEPT]) == {"episodes": [KEPT]}
            if store_url is not None:
                assert await tables_holding(store_url, [*words, KEPT]) == {"memory_nodes": [KEPT]}
            assert files_holding(data_dir, words) == {}
        logs += up.stderr

        # Stopped (cleanly or killed): nothing was left to come back, in the files or later.
        assert files_holding(data_dir, words) == {}
        assert files_holding(data_dir, [KEPT])
        assert files_holding(tmp_path / "import", words) == {"history.jsonl": [WORDS["import"]]}
        async with running(env) as again:
            for question in ("What is my bike lock word?", "What is my hamster called?"):
                said = await _rpc(client, again, ALICE, "chat.send", _chat(question))
                assert _holding(said["content"], words) == []
            listed = await _rpc(client, again, ALICE, "memory.list")
            assert _holding(json.dumps(listed), words) == []
            assert _holding(" ".join(await _store_recall(again, words)), words) == []
        logs += again.stderr
    assert files_holding(data_dir, words) == {}
    if backend is not None:
        assert await tables_holding(backend, [*words, KEPT]) == {"episodes": [KEPT]}
    if store_url is not None:
        assert await tables_holding(store_url, [*words, KEPT]) == {"memory_nodes": [KEPT]}
    # Nor did the logs ever carry them.
    assert _holding("\n".join(logs), [*words, KEPT]) == []


async def test_the_default_mode_lists_searches_and_forgets_the_turns_of_no_principal(
    tmp_path: Path,
) -> None:
    # `make run`: shared mode, REST open. Anonymous turns are stored; the banner's JWT (not an
    # admin's) finds and forgets them, and the command line forgets what is left.
    data_dir = tmp_path / "data"
    env = _env(data_dir, None, scope="shared")
    dev = _jwt("dev")
    turns = ["My spare key is under the Brindlestone", "The wifi password is Cobbleflint"]
    async with httpx.AsyncClient(timeout=60) as client, running(env) as up:
        for text in turns:
            said = await client.post(f"{up.http}/v1/chat/completions", json=_chat(text))
            assert said.status_code == 200
        await _rpc(client, up, dev, "chat.send", _chat("Note my plant is a Sorrelwing"))
        # dev's own memory is dev's turn only; the turns of no principal are asked for.
        own = await _rpc(client, up, dev, "memory.list")
        assert [m["preview"] for m in own["memories"]] == [
            "User: Note my plant is a Sorrelwing Assistant: Echo: Note my plant is a Sorrelwing"
        ]
        anonymous = await _rpc(client, up, dev, "memory.list", {"anonymous": True})
        assert len(anonymous["memories"]) == 2
        found = await _rpc(
            client, up, dev, "memory.list", {"anonymous": True, "contains": "cobbleFLINT"}
        )
        [match] = found["memories"]
        assert "Cobbleflint" in match["preview"]
        assert await _rpc(client, up, dev, "memory.delete", {"node_id": match["node_id"]}) == {
            "deleted": True
        }
        code, out, err = await _command(up, env, "forget", "--anonymous")
        assert (code, err) == (0, "")
        assert out == "forgot 1 episode(s) of the turns of no principal and 0 conversation(s)\n"
        assert (await _rpc(client, up, dev, "memory.list", {"anonymous": True}))["memories"] == []
        for question in ("Where is my spare key?", "What is the wifi password?"):
            said = await _rpc(client, up, dev, "chat.send", _chat(question))
            assert _holding(said["content"], ["Brindlestone", "Cobbleflint"]) == []
        # dev's own turn was nobody else's to forget.
        assert len((await _rpc(client, up, dev, "memory.list"))["memories"]) == 3
    assert files_holding(data_dir, ["Brindlestone", "Cobbleflint"]) == {}
    assert files_holding(data_dir, ["Sorrelwing"])
