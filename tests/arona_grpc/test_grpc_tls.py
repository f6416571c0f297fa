"""MemoryService on a TLS listener (``ARONA_GRPC_TLS_CERT`` / ``_KEY``), 127.0.0.1 port 0.

The certificate authority and the server certificate are made by the test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.security import GrpcSecurityError
from arona_grpc.server import GrpcServer
from arona_grpc.service import MemoryDomain
from tests.support.grpcurl import run_grpcurl
from tests.support.tls import TlsFiles, make_tls_files

GRPC_TOKEN = "grpc-tls-test-token-0123456789"
STATUS = "arona.memory.v1.MemoryService/Status"


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    return make_tls_files(tmp_path / "tls")


@pytest_asyncio.fixture
async def server(tls: TlsFiles) -> AsyncIterator[GrpcServer]:
    running = await GrpcServer.start(
        Settings(grpc_port=0, grpc_tls_cert=tls.cert, grpc_tls_key=tls.key)
    )
    yield running
    await running.stop(grace=1)


@pytest.mark.asyncio
async def test_grpcurl_calls_status_over_tls_and_plaintext_fails(
    server: GrpcServer, tls: TlsFiles, tmp_path: Path
) -> None:
    answered = await run_grpcurl("-cacert", str(tls.ca), server.target, STATUS)
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["breaker"] == "BREAKER_STATE_CLOSED"

    # It can only fail, at the latest at its connect timeout (grpcurl's default, 10 s, is a
    # third of what run_grpcurl allows); a plaintext service would answer within 3 s.
    plaintext = await run_grpcurl("-plaintext", "-connect-timeout", "3", server.target, STATUS)
    assert plaintext.returncode != 0
    assert "Failed to dial" in plaintext.stderr  # refused at connecting, not over its flags

    other_ca = make_tls_files(tmp_path / "other", "another test CA").ca
    untrusted = await run_grpcurl("-cacert", str(other_ca), server.target, STATUS)
    assert untrusted.returncode != 0
    assert "certificate" in untrusted.stderr


@pytest.mark.asyncio
async def test_a_channel_trusting_the_ca_calls_the_service(
    server: GrpcServer, tls: TlsFiles
) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca.read_bytes())
    async with grpc.aio.secure_channel(server.target, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub: pb_grpc.MemoryServiceAsyncStub = pb_grpc.MemoryServiceStub(channel)
        recall = await stub.Recall(pb.RecallRequest(query="q"))
        assert recall.state == pb.MEMORY_STATE_DISABLED


@pytest.mark.asyncio
async def test_grpcurl_with_tls_and_a_token(tls: TlsFiles) -> None:
    running = await GrpcServer.start(
        Settings(grpc_port=0, grpc_tls_cert=tls.cert, grpc_tls_key=tls.key, grpc_token=GRPC_TOKEN)
    )
    try:
        refused = await run_grpcurl("-cacert", str(tls.ca), running.target, STATUS)
        assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
        answered = await run_grpcurl(
            "-cacert",
            str(tls.ca),
            "-H",
            f"authorization: Bearer {GRPC_TOKEN}",
            running.target,
            STATUS,
        )
        assert answered.returncode == 0, answered.stderr
    finally:
        await running.stop(grace=1)


# --- unusable TLS settings: one line at start-up, before anything binds --------------


def _unusable(tls: TlsFiles, tmp_path: Path) -> dict[str, tuple[Settings, str]]:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    other_key = make_tls_files(tmp_path / "other").key
    return {
        "cert without key": (Settings(grpc_tls_cert=tls.cert), "must be set together"),
        "key without cert": (Settings(grpc_tls_key=tls.key), "must be set together"),
        "missing cert": (
            Settings(grpc_tls_cert=tmp_path / "absent.pem", grpc_tls_key=tls.key),
            f"ARONA_GRPC_TLS_CERT: cannot read {tmp_path / 'absent.pem'}",
        ),
        "unreadable key": (
            Settings(grpc_tls_cert=tls.cert, grpc_tls_key=tmp_path),
            "ARONA_GRPC_TLS_KEY: cannot read",
        ),
        "not PEM": (
            Settings(grpc_tls_cert=not_pem, grpc_tls_key=tls.key),
            "ARONA_GRPC_TLS_CERT: ",
        ),
        "swapped": (
            Settings(grpc_tls_cert=tls.key, grpc_tls_key=tls.cert),
            "not a certificate and its unencrypted private key",
        ),
        "key of another certificate": (
            Settings(grpc_tls_cert=tls.cert, grpc_tls_key=other_key),
            "not a certificate and its unencrypted private key",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "cert without key",
        "key without cert",
        "missing cert",
        "unreadable key",
        "not PEM",
        "swapped",
        "key of another certificate",
    ],
)
@pytest.mark.asyncio
async def test_unusable_tls_files_are_one_line_at_start_up(
    tls: TlsFiles, tmp_path: Path, case: str
) -> None:
    settings, expected = _unusable(tls, tmp_path)[case]
    domain = MemoryDomain(settings)
    with pytest.raises(GrpcSecurityError) as raised:
        await GrpcServer.start(settings, domain)
    message = str(raised.value)
    assert expected in message and "\n" not in message
