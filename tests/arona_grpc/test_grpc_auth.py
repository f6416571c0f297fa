"""MemoryService behind ``ARONA_GRPC_TOKEN``, on a real grpc.aio server (127.0.0.1, port 0)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.security import (
    UNAUTHENTICATED_DETAILS,
    GrpcSecurityError,
    check_exposure,
    is_loopback,
)
from arona_grpc.server import GrpcServer, build_server
from arona_grpc.service import MemoryDomain
from tests.support.fake_philia import DELETE, QUERY, STORE, FakePhilia
from tests.support.grpcurl import run_grpcurl

PHILIA_TOKEN = "philia-t0ken"
GRPC_TOKEN = "grpc-bearer-Secret-0123456789"
WRONG_TOKEN = "grpc-bearer-Guess-9876543210"

Metadata = tuple[tuple[str, str], ...]
if TYPE_CHECKING:
    Stub = pb_grpc.MemoryServiceAsyncStub

# Each MemoryService RPC, called with the given metadata.
RPCS: dict[str, Callable[[Stub, Metadata], Awaitable[Any]]] = {
    "Recall": lambda stub, md: stub.Recall(pb.RecallRequest(query="tea"), metadata=md),
    "Writeback": lambda stub, md: stub.Writeback(pb.WritebackRequest(user="u"), metadata=md),
    "Delete": lambda stub, md: stub.Delete(pb.DeleteRequest(node_id="n-1"), metadata=md),
    "Status": lambda stub, md: stub.Status(pb.StatusRequest(), metadata=md),
}

REFUSED_METADATA: dict[str, Metadata] = {
    "none": (),
    "wrong token": (("authorization", f"Bearer {WRONG_TOKEN}"),),
    "token without scheme": (("authorization", GRPC_TOKEN),),
    "other scheme": (("authorization", f"Basic {GRPC_TOKEN}"),),
    "token as a prefix": (("authorization", f"Bearer {GRPC_TOKEN[:-1]}"),),
    "right and wrong": (
        ("authorization", f"Bearer {GRPC_TOKEN}"),
        ("authorization", f"Bearer {WRONG_TOKEN}"),
    ),
    "another key": (("x-token", f"Bearer {GRPC_TOKEN}"),),
}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakePhilia]:
    async with FakePhilia(token=PHILIA_TOKEN) as server:
        yield server


@pytest_asyncio.fixture
async def server(fake: FakePhilia) -> AsyncIterator[GrpcServer]:
    settings = Settings(
        memory_url=fake.url,
        memory_token=PHILIA_TOKEN,
        memory_timeout_s=2,
        grpc_port=0,
        grpc_token=GRPC_TOKEN,
    )
    running = await GrpcServer.start(settings)
    yield running
    await running.stop(grace=1)


@pytest_asyncio.fixture
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.target) as opened:
        yield opened


@pytest.mark.parametrize("case", REFUSED_METADATA)
@pytest.mark.parametrize("rpc", RPCS)
@pytest.mark.asyncio
async def test_a_call_without_the_right_token_is_unauthenticated(
    fake: FakePhilia,
    channel: grpc.aio.Channel,
    rpc: str,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stub: Stub = pb_grpc.MemoryServiceStub(channel)
    with caplog.at_level(logging.DEBUG), pytest.raises(grpc.aio.AioRpcError) as caught:
        await RPCS[rpc](stub, REFUSED_METADATA[case])
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == UNAUTHENTICATED_DETAILS
    # Neither the expected token nor the guess shows anywhere.
    shown = f"{caught.value.details()} {caught.value.debug_error_string()} {caplog.text}"
    assert GRPC_TOKEN not in shown and WRONG_TOKEN not in shown
    assert GRPC_TOKEN[:-1] not in shown
    # Refused before the memory backend saw anything.
    assert (fake.frames_of(QUERY), fake.frames_of(STORE), fake.frames_of(DELETE)) == ([], [], [])


@pytest.mark.asyncio
async def test_the_right_token_reaches_every_rpc(
    fake: FakePhilia, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    fake.memories = [{"node_type": "entity", "text": "I prefer oolong tea", "score": 0.9}]
    stub: Stub = pb_grpc.MemoryServiceStub(channel)
    token: Metadata = (("authorization", f"Bearer {GRPC_TOKEN}"),)
    with caplog.at_level(logging.DEBUG):
        recall = await RPCS["Recall"](stub, token)
        stored = await RPCS["Writeback"](stub, token)
        deleted = await RPCS["Delete"](stub, token)
        # The scheme is case-insensitive (RFC 7235).
        status = await RPCS["Status"](stub, (("authorization", f"bearer {GRPC_TOKEN}"),))
    assert recall.state == pb.MEMORY_STATE_ENABLED
    assert [m.text for m in recall.memories] == ["I prefer oolong tea"]
    assert (stored.stored, stored.node_id) == (True, "n-1")
    assert deleted.deleted is True
    assert [e.kind for e in status.events] == [
        pb.EVENT_KIND_DELETE,
        pb.EVENT_KIND_WRITEBACK,
        pb.EVENT_KIND_RECALL,
    ]
    assert GRPC_TOKEN not in caplog.text


@pytest.mark.asyncio
async def test_health_stays_open_without_a_token(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "arona.memory.v1.MemoryService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio
async def test_grpcurl_lists_without_a_token_and_calls_status_with_one(
    server: GrpcServer,
) -> None:
    # Reflection stays open: it describes the schema, not the memories.
    listed = await run_grpcurl("-plaintext", server.target, "list")
    assert listed.returncode == 0, listed.stderr
    assert "arona.memory.v1.MemoryService" in listed.stdout.split()

    refused = await run_grpcurl("-plaintext", server.target, "arona.memory.v1.MemoryService/Status")
    assert refused.returncode != 0
    assert "Unauthenticated" in refused.stderr
    assert GRPC_TOKEN not in refused.stdout + refused.stderr

    answered = await run_grpcurl(
        "-plaintext",
        "-H",
        f"authorization: Bearer {GRPC_TOKEN}",
        server.target,
        "arona.memory.v1.MemoryService/Status",
    )
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["enabled"] is True


@pytest.mark.asyncio
async def test_without_a_token_no_interceptor_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[dict[str, Any]] = []
    real_server = grpc.aio.server

    def recording_server(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        built.append(kwargs)
        return real_server(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", recording_server)
    domain = MemoryDomain(Settings())
    try:
        build_server(domain)
        build_server(domain, token=GRPC_TOKEN)
    finally:
        await domain.aclose()
    assert built[0]["interceptors"] is None
    [interceptor] = built[1]["interceptors"]
    assert GRPC_TOKEN not in repr(interceptor)


# --- where the service may listen without a token ----------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.0.2.10", False),
        ("10.0.0.1", False),
        ("memory.internal", False),
        ("::ffff:192.0.2.10", False),
    ],
)
def test_loopback_is_127_8_ipv6_one_and_localhost(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_a_non_loopback_listener_needs_a_token(host: str) -> None:
    with pytest.raises(GrpcSecurityError) as raised:
        check_exposure(Settings(grpc_host=host))
    message = str(raised.value)
    assert "ARONA_GRPC_TOKEN" in message and "\n" not in message
    check_exposure(Settings(grpc_host=host, grpc_token=GRPC_TOKEN))


@pytest.mark.asyncio
async def test_the_refusal_comes_before_anything_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_server(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        raise AssertionError("a server was built")

    monkeypatch.setattr(grpc.aio, "server", no_server)
    with pytest.raises(GrpcSecurityError, match="ARONA_GRPC_TOKEN"):
        await GrpcServer.start(Settings(grpc_host="0.0.0.0", grpc_port=0))
