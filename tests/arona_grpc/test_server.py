"""MemoryService on a real grpc.aio server (port 0), called through the generated stub."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.server import GrpcBindError, GrpcServer
from arona_grpc.service import MemoryDomain
from tests.support.fake_philia import DELETE, QUERY, STORE, FakePhilia, Step
from tests.support.grpcurl import run_grpcurl

TOKEN = "grpc-t0ken"


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=TOKEN) as server:
        yield server


def enabled_settings(fake: FakePhilia) -> Settings:
    return Settings(memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=1.0, grpc_port=0)


@pytest_asyncio.fixture
async def server(fake: FakePhilia) -> AsyncIterator[GrpcServer]:
    running = await GrpcServer.start(enabled_settings(fake))
    yield running
    await running.stop(grace=1)


@pytest_asyncio.fixture
async def disabled_server() -> AsyncIterator[GrpcServer]:
    running = await GrpcServer.start(Settings(grpc_port=0))
    yield running
    await running.stop(grace=1)


@pytest_asyncio.fixture
async def stub(server: GrpcServer) -> AsyncIterator[pb_grpc.MemoryServiceAsyncStub]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        yield pb_grpc.MemoryServiceStub(channel)


async def status_code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code()


# --- the four RPCs -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_recall(fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub) -> None:
    fake.memories = [{"node_type": "entity", "text": "I prefer oolong tea", "score": 0.834}]
    reply = await stub.Recall(pb.RecallRequest(query="what tea?"))
    assert reply.state == pb.MEMORY_STATE_ENABLED
    assert [(m.text, round(m.score, 3), m.node_type) for m in reply.memories] == [
        ("I prefer oolong tea", 0.834, "entity")
    ]
    assert reply.section == "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea"
    assert fake.frames_of(QUERY)[0]["params"] == {"query": "what tea?", "limit": 5}


@pytest.mark.asyncio
async def test_recall_offline_is_not_an_error(
    fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub
) -> None:
    fake.script(QUERY, Step(action="hang"))
    reply = await stub.Recall(pb.RecallRequest(query="q", limit=2))
    assert (reply.state, list(reply.memories), reply.section) == (pb.MEMORY_STATE_OFFLINE, [], "")


@pytest.mark.asyncio
async def test_writeback_and_delete(fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub) -> None:
    stored = await stub.Writeback(pb.WritebackRequest(user="hi", assistant="hello"))
    assert (stored.stored, stored.node_id) == (True, "n-1")
    assert fake.frames_of(STORE)[0]["params"] == {
        "text": "User: hi\nAssistant: hello",
        "node_type": "episode",
    }
    empty = await stub.Writeback(pb.WritebackRequest())
    assert (empty.stored, empty.node_id) == (False, "")

    assert (await stub.Delete(pb.DeleteRequest(node_id="n-1"))).deleted is True
    assert (await stub.Delete(pb.DeleteRequest(node_id="n-9"))).deleted is False
    assert [f["params"]["node_id"] for f in fake.frames_of(DELETE)] == ["n-1", "n-9"]


@pytest.mark.asyncio
async def test_an_episode_sent_again_after_it_was_stored_is_not_stored_twice(
    fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub
) -> None:
    # Its caller never got the first answer (killed, a lost reply) and sends it again.
    request = pb.WritebackRequest(user="once", assistant="only", episode_id="ep-7")
    first = await stub.Writeback(request)
    again = await stub.Writeback(request)
    assert (again.stored, again.node_id) == (True, first.node_id)
    assert len(fake.frames_of(STORE)) == 1
    other = await stub.Writeback(pb.WritebackRequest(user="once", assistant="only"))
    assert other.node_id != first.node_id  # without an id, no such check


@pytest.mark.asyncio
async def test_status_reports_events_newest_first(stub: pb_grpc.MemoryServiceAsyncStub) -> None:
    await stub.Recall(pb.RecallRequest(query="first"))
    await stub.Writeback(pb.WritebackRequest(user="u"))
    await stub.Delete(pb.DeleteRequest(node_id="n-1"))

    status = await stub.Status(pb.StatusRequest())
    assert (status.enabled, status.writeback) == (True, True)
    assert [(e.kind, e.detail) for e in status.events] == [
        (pb.EVENT_KIND_DELETE, "n-1"),
        (pb.EVENT_KIND_WRITEBACK, "n-1"),
        (pb.EVENT_KIND_RECALL, "first"),
    ]
    assert all(e.at.seconds > 0 for e in status.events)
    assert status.breaker == pb.BREAKER_STATE_CLOSED
    limited = await stub.Status(pb.StatusRequest(limit=1))
    assert [e.kind for e in limited.events] == [pb.EVENT_KIND_DELETE]


@pytest.mark.asyncio
async def test_disabled_server(disabled_server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(disabled_server.target) as channel:
        stub: pb_grpc.MemoryServiceAsyncStub = pb_grpc.MemoryServiceStub(channel)
        recall = await stub.Recall(pb.RecallRequest(query="q"))
        assert recall.state == pb.MEMORY_STATE_DISABLED
        assert (await stub.Writeback(pb.WritebackRequest(user="u"))).stored is False
        status = await stub.Status(pb.StatusRequest())
        assert (status.enabled, status.writeback, list(status.events)) == (False, False, [])
        code = await status_code_of(stub.Delete(pb.DeleteRequest(node_id="n-1")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION


# --- error codes -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_missing_node_id_is_invalid_argument(stub: pb_grpc.MemoryServiceAsyncStub) -> None:
    assert await status_code_of(stub.Delete(pb.DeleteRequest())) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


@pytest.mark.parametrize(
    ("step", "code"),
    [
        (Step(error=(-32603, "boom")), grpc.StatusCode.UNAVAILABLE),
        (Step(action="close"), grpc.StatusCode.UNAVAILABLE),
        (Step(action="hang"), grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
@pytest.mark.asyncio
async def test_philia_faults_map_to_status_codes(
    fake: FakePhilia, stub: pb_grpc.MemoryServiceAsyncStub, step: Step, code: grpc.StatusCode
) -> None:
    fake.script(STORE, step)
    assert await status_code_of(stub.Writeback(pb.WritebackRequest(user="u"))) == code
    fake.script(DELETE, step)
    assert await status_code_of(stub.Delete(pb.DeleteRequest(node_id="n-1"))) == code


@pytest.mark.asyncio
async def test_unexpected_error_is_internal_with_a_generic_message(
    fake: FakePhilia, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(MemoryDomain):
        async def delete(self, node_id: str, scope: str = "", *, own: bool = False) -> bool:
            raise KeyError(f"secret detail {node_id}")

    running = await GrpcServer.start(enabled_settings(fake), Broken(enabled_settings(fake)))
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub: pb_grpc.MemoryServiceAsyncStub = pb_grpc.MemoryServiceStub(channel)
            with caplog.at_level(logging.ERROR, logger="arona_grpc"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Delete(pb.DeleteRequest(node_id="n-1"))
    finally:
        await running.stop(grace=1)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "internal error"
    assert any(r.exc_info and "secret detail" in str(r.exc_info[1]) for r in caplog.records)


# --- health, reflection, lifecycle ------------------------------------------------


@pytest.mark.asyncio
async def test_health_check_is_serving(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "arona.memory.v1.MemoryService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio
async def test_stop_finishes_in_flight_calls_and_closes_philia(fake: FakePhilia) -> None:
    gate = asyncio.Event()
    fake.script(STORE, Step(gate=gate))
    running = await GrpcServer.start(
        Settings(memory_url=fake.url, memory_token=TOKEN, memory_timeout_s=5, grpc_port=0)
    )
    try:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub: pb_grpc.MemoryServiceAsyncStub = pb_grpc.MemoryServiceStub(channel)
            in_flight = asyncio.ensure_future(stub.Writeback(pb.WritebackRequest(user="u")))
            await fake.wait_frames(STORE)
            stopping = asyncio.create_task(running.stop(grace=5))
            gate.set()
            assert (await in_flight).stored is True
            await stopping
            code = await status_code_of(stub.Status(pb.StatusRequest(), timeout=2))
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(grace=1)
    # stop() also closed the Philia link.
    await asyncio.wait_for(fake.wait_all_closed(), timeout=5)


@pytest.mark.asyncio
async def test_busy_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GrpcBindError, match=f"127.0.0.1:{port}"):
            await GrpcServer.start(Settings(grpc_port=port))


async def _run_grpcurl(*args: str) -> str:
    done = await run_grpcurl(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.asyncio
async def test_grpcurl_lists_and_calls_status(server: GrpcServer) -> None:
    listed = await _run_grpcurl("-plaintext", server.target, "list")
    assert "arona.memory.v1.MemoryService" in listed.split()
    assert "grpc.health.v1.Health" in listed.split()

    answer = json.loads(
        await _run_grpcurl("-plaintext", server.target, "arona.memory.v1.MemoryService/Status")
    )
    assert answer["enabled"] is True
    assert answer["writeback"] is True
