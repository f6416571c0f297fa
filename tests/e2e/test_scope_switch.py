"""Per-user memories are never shared memory.

After ``ARONA_MEMORY_SCOPE=user`` stored one user's episodes, a restart without it would
have shown them to every caller. ``up`` and ``serve`` refuse to start in one line that says
why and what to set; with the scope set again, the same directory serves its users. And a
shared-mode recall, wherever it runs, drops the episodes Philia holds for one user alone.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import grpc
import httpx
import pytest

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.server import GrpcServer
from tests.e2e.scoped import jwt, scoped_stack
from tests.e2e.test_up import gateway_up
from tests.support.served import run, run_both

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

FACT = "My locker code is 4417"
ASK = "What is my locker code?"


def chat(text: str) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}]}


async def test_per_user_memories_refuse_a_shared_start_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    user_mode = {"ARONA_MEMORY_SCOPE": "user"}
    async with httpx.AsyncClient(timeout=30) as client:
        async with gateway_up(data_dir, user_mode) as up:
            assert (await up.rpc(client, "chat.send", chat(FACT)))["memory"] == "disabled"
            # memory.list waits for the caller's own writebacks: the episode is stored.
            assert len((await up.rpc(client, "memory.list"))["memories"]) == 1

        line = (
            f"arona-gateway: error: {data_dir / 'episodes.db'} holds per-user memories (stored "
            "with ARONA_MEMORY_SCOPE=user), which shared mode would show to every caller: set "
            "ARONA_MEMORY_SCOPE=user; or forget them (run it with ARONA_MEMORY_SCOPE=user, then "
            "`arona-gateway forget --all` beside it) and start again; or, for a new shared "
            "memory, use another ARONA_DATA_DIR\n"
        )
        assert await run(data_dir, "up") == (2, line)
        # serve refuses before it listens or reaches Philia (nothing answers at this URL).
        philia = {
            "ARONA_MEMORY_URL": "ws://127.0.0.1:9/ws",
            "ARONA_MEMORY_TOKEN": "a-memory-token-of-24-chars",
        }
        assert await run(data_dir, "serve", env=philia) == (2, line)
        assert await run(data_dir, "serve", "--workers", "2", env=philia) == (2, line)

        async with gateway_up(data_dir, user_mode) as up:
            again = await up.rpc(client, "chat.send", chat(ASK))
            assert again["memory"] == "enabled" and "4417" in again["content"]
            # The way out the line offers, followed as written.
            grpc_address = re.search(r"gRPC\s+(\S+)", up.banner)
            assert grpc_address is not None
            code, out, err = await run_both(
                data_dir, "forget", "--all", env={"ARONA_GRPC_TARGET": grpc_address.group(1)}
            )
            assert (code, err) == (0, "")
            # The fact and the question asked since: both turns of that user.
            assert out == "forgot 2 episode(s) of everyone and 0 conversation(s)\n"
        async with gateway_up(data_dir) as up:
            shared = await up.rpc(client, "chat.send", chat(ASK))
            assert shared["memory"] == "disabled" and "4417" not in shared["content"]


async def test_shared_recall_never_returns_an_episode_stored_for_one_user(
    tmp_path: Path,
) -> None:
    """Another gateway in shared mode on the same Philia (its own, empty data directory, so it
    starts): Philia answers its unfiltered query with every node, one user's episodes too."""
    async with scoped_stack(tmp_path / "user-mode") as stack:
        assert (await stack.say("rest", jwt("alice"), FACT)).status == 200
        await stack.settle()
        shared = dataclasses.replace(
            stack.settings, memory_scope="shared", grpc_port=0, data_dir=tmp_path / "shared"
        )
        service = await GrpcServer.start(shared)
        try:
            async with grpc.aio.insecure_channel(service.target) as channel:
                stub = pb_grpc.MemoryServiceStub(channel)
                found = await stub.Recall(pb.RecallRequest(query=ASK))
                assert found.state == pb.MEMORY_STATE_DISABLED and "4417" not in str(found)
                await stub.Writeback(pb.WritebackRequest(user="The office code is 9021"))
                found = await stub.Recall(pb.RecallRequest(query="What is the office code?"))
                assert [m.node_type for m in found.memories] == ["episode"]
                assert "9021" in found.section and "4417" not in found.section
        finally:
            await service.stop(0.5)
        # The user's own recall still finds it in user mode.
        said = await stack.say("rest", jwt("alice"), ASK)
        assert said.memory == "enabled" and "4417" in said.section
