"""WritebackRequest.occurred_at: when a turn happened reaches Philia as the store request's
``occurred_at`` property (unary and Exchange), is refused when impossible, and is kept by the
outbox through a replay and a restart. A real grpc.aio server over a scripted Philia."""

from __future__ import annotations

import calendar
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.server import GrpcServer
from tests.support.fake_philia import STORE, FakePhilia, Step

pytestmark = pytest.mark.asyncio

TOKEN = "grpc-t0ken"
# 2023-05-08T13:56:00Z and a fraction of a second (dropped on the wire).
MAY_8 = 1683554160


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


def settings_for(fake: FakePhilia, cooldown_s: float = 60.0) -> Settings:
    # A breaker that opens on the first failure: an outage queues every later writeback.
    return Settings(
        memory_url=fake.url,
        memory_token=TOKEN,
        memory_timeout_s=1.0,
        grpc_port=0,
        memory_breaker_failures=1,
        memory_breaker_cooldown_s=cooldown_s,
    )


@pytest_asyncio.fixture
async def stub(fake: FakePhilia) -> AsyncIterator[pb_grpc.MemoryServiceAsyncStub]:
    server = await GrpcServer.start(settings_for(fake))
    async with grpc.aio.insecure_channel(server.target) as channel:
        yield pb_grpc.MemoryServiceStub(channel)
    await server.stop(grace=1)


def dated(user: str, seconds: int, nanos: int = 0, **fields: str) -> pb.WritebackRequest:
    request = pb.WritebackRequest(user=user, assistant="noted", **fields)
    request.occurred_at.seconds = seconds
    request.occurred_at.nanos = nanos
    return request


def sent_time(frame: dict[str, object]) -> int:
    """The POSIX seconds of a store request's occurred_at property."""
    params = frame["params"]
    assert isinstance(params, dict)
    text = params["properties"]["occurred_at"]
    assert text.endswith("Z") and len(text) == len("2023-05-08T13:56:00Z"), text
    return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))


async def test_occurred_at_reaches_philia_as_a_property(
    fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub
) -> None:
    reply = await stub.Writeback(dated("I moved to Lisbon", MAY_8, 750_000_000))
    assert reply.stored
    undated = await stub.Writeback(pb.WritebackRequest(user="today's turn", assistant="ok"))
    assert undated.stored
    first, second = fake.frames_of(STORE)
    assert first["params"] == {
        "text": "User: I moved to Lisbon\nAssistant: noted",
        "node_type": "episode",
        "properties": {"occurred_at": "2023-05-08T13:56:00Z"},
    }
    # Unset: no property, Philia dates it now (the healthy path sends what it always did).
    assert "properties" not in second["params"]


async def test_occurred_at_over_an_exchange_stream(
    fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub
) -> None:
    async def calls() -> AsyncIterator[pb.ExchangeRequest]:
        request = pb.ExchangeRequest()
        request.calls.add(id=7, writeback=dated("we met in Porto", MAY_8 - 86_400))
        yield request

    replies = []
    async for response in stub.Exchange(calls()):
        replies.extend(response.replies)
    assert [(r.id, r.writeback.stored) for r in replies] == [(7, True)]
    [frame] = fake.frames_of(STORE)
    assert frame["params"]["properties"] == {"occurred_at": "2023-05-07T13:56:00Z"}


@pytest.mark.parametrize(
    ("seconds", "nanos", "message"),
    [
        (-1, 0, "occurred_at is before 1970-01-01T00:00:00Z"),
        (int(time.time()) + 86_400, 0, "is in the future (more than 300 s from now)"),
        (MAY_8, -5, "occurred_at.nanos must be from 0 to 999999999"),
    ],
)
async def test_an_impossible_time_is_invalid_argument(
    fake: FakePhilia,
    stub: pb_grpc.MemoryServiceAsyncStub,
    seconds: int,
    nanos: int,
    message: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Writeback(dated("when?", seconds, nanos))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (caught.value.details() or "")
    assert fake.frames_of(STORE) == []


async def test_a_time_slightly_ahead_counts_as_now(
    fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub
) -> None:
    before = int(time.time())
    assert (await stub.Writeback(dated("clock skew", before + 120))).stored
    after = time.time()
    [frame] = fake.frames_of(STORE)
    assert before <= sent_time(frame) <= after


async def test_an_outage_replay_keeps_each_episodes_time(fake: FakePhilia) -> None:
    # Philia fails once: the breaker opens (one failure), the episode and the next one wait
    # in the outbox, and the replay stores both once the cooldown is over.
    fake.script(STORE, Step(error=(-32603, "boom")))
    server = await GrpcServer.start(settings_for(fake, cooldown_s=0.3))
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            before = int(time.time())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Writeback(dated("dated turn", MAY_8))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert dict(caught.value.trailing_metadata() or ())["arona-queued"] == "1"
            try:
                # Queued behind the first: it fails as queued, or waits for the replay.
                await stub.Writeback(pb.WritebackRequest(user="undated turn", assistant="ok"))
            except grpc.aio.AioRpcError as exc:
                assert dict(exc.trailing_metadata() or ())["arona-queued"] == "1"
            received = time.time()
            await fake.wait_stored(2)
    finally:
        await server.stop(grace=1)
    failed, *replayed = fake.frames_of(STORE)
    assert failed["params"]["properties"] == {"occurred_at": "2023-05-08T13:56:00Z"}
    assert [f["params"]["text"] for f in replayed] == [
        "User: dated turn\nAssistant: noted",
        "User: undated turn\nAssistant: ok",
    ]
    assert sent_time(replayed[0]) == MAY_8
    # Undated: the time the service received it, not the time of the replay.
    assert before <= sent_time(replayed[1]) <= received


async def test_a_restart_replays_the_outbox_with_each_episodes_time() -> None:
    async with FakePhilia(token=TOKEN) as down:
        down.script(STORE, Step(error=(-32603, "boom")))
        server = await GrpcServer.start(settings_for(down))
        async with grpc.aio.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.MemoryServiceStub(channel).Writeback(
                    dated("kept over a restart", MAY_8, scope="alice")
                )
        await server.stop(grace=1)
    async with FakePhilia(token=TOKEN) as up:
        server = await GrpcServer.start(settings_for(up))
        try:
            await up.wait_stored(1)
        finally:
            await server.stop(grace=1)
    [frame] = up.frames_of(STORE)
    assert frame["params"]["text"] == "User: kept over a restart\nAssistant: noted"
    assert sent_time(frame) == MAY_8
