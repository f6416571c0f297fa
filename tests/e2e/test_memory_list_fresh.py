"""``memory.list`` shows the turn its caller was just answered (read-your-write), end to end.

A turn's writeback runs after its reply, in the background: a client that lists its
memories the moment it has the reply must still see that turn. The HTTP layer waits for
the caller's writebacks on their way, and the gRPC service answers a writeback only once
its episode is in the index, so the list shows it, even from another gRPC replica sharing
the PostgreSQL index. No test here waits for the writebacks itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from arona_grpc.episodes import preview_of
from arona_grpc.service import EventKind
from tests.e2e.scoped import jwt, scoped_stack

pytestmark = pytest.mark.asyncio

ALICE = jwt("alice")
ROUNDS = 6


def _preview(text: str) -> str:
    return preview_of(f"User: {text}\nAssistant: reply to: {text}")


@pytest.mark.parametrize("surface", ["rest", "rpc", "rpc_ws"])
@pytest.mark.parametrize("scope", ["shared", "user"])
async def test_a_turn_is_listed_as_soon_as_it_is_answered(
    tmp_path: Path, surface: str, scope: str
) -> None:
    async with scoped_stack(tmp_path, scope=scope) as stack:
        for i in range(ROUNDS):
            text = f"zebra note number {i}"
            assert (await stack.say(surface, ALICE, text)).status == 200
            listed = await stack.result(ALICE, "memory.list")
            previews = [m["preview"] for m in listed["memories"]]
            assert previews == [_preview(f"zebra note number {n}") for n in reversed(range(i + 1))]
        # Forgetting right after a turn takes that turn too.
        assert (await stack.say(surface, ALICE, "one more zebra note")).status == 200
        forgot = await stack.result(ALICE, "memory.forget")
        assert (forgot["deleted"], forgot["conversations"]) == (ROUNDS + 1, 0)
        assert forgot["target"] == {"scope": "alice"}
        assert (await stack.result(ALICE, "memory.list"))["memories"] == []


async def test_a_narrowed_turn_is_listed_at_once_in_its_own_scope(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack:
        assert (await stack.say("rpc", ALICE, "zebra note for mia", user="mia")).status == 200
        listed = await stack.result(ALICE, "memory.list", {"scope": "alice/mia"})
        assert [m["preview"] for m in listed["memories"]] == [_preview("zebra note for mia")]


async def test_another_grpc_replica_lists_what_one_stored(
    tmp_path: Path, database_url: str
) -> None:
    # Two gRPC replicas on one PostgreSQL index: writebacks spread over both streams'
    # replicas, while memory.list goes to one of them.
    async with scoped_stack(tmp_path, grpc_replicas=2, database_url=database_url) as stack:
        for i in range(ROUNDS):
            text = f"zebra note number {i}"
            assert (await stack.say("rpc", ALICE, text)).status == 200
            listed = await stack.result(ALICE, "memory.list")
            assert listed["memories"][0]["preview"] == _preview(text)
            assert len(listed["memories"]) == i + 1
        stored_by = [
            sum(e.kind is EventKind.WRITEBACK for e in replica.domain.status(100).events)
            for replica in stack.replicas
        ]
        # Both replicas stored some of them: the list read what the other one wrote.
        assert sum(stored_by) == ROUNDS and all(stored_by), stored_by
