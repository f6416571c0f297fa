"""The HTTP layer's channels to ``MemoryService``: replicas, options, TLS, call credentials.

:func:`resolve_replicas` turns ``ARONA_GRPC_TARGET`` (one target or a comma-separated list)
into the replicas to spread calls over: a name that resolves to several addresses is one
replica per address. :func:`open_memory_channel` is the only place that creates a channel to
one: plaintext, or TLS trusting ``ARONA_GRPC_TLS_CA`` when it is set.
:func:`memory_call_metadata` is what every MemoryService call carries:
``authorization: Bearer <ARONA_GRPC_TOKEN>`` when a token is set. The health check needs
neither token nor metadata.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from arona_grpc.config import Settings
from arona_grpc.security import read_pem

# In a split deployment the connection to the gRPC service crosses machines, and a NAT or
# firewall may drop it while idle without a word: the next turn's recall would then wait out
# its whole budget, and so would every turn after it until TCP gave up. Pinged every 30 s
# (idle or not), a dead connection is found within 40 s and replaced before a turn needs it.
# The service accepts pings this often (arona_grpc.server.MIN_PING_INTERVAL_MS).
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(
    keepalive_time_ms: int = KEEPALIVE_TIME_MS, keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS
) -> list[tuple[str, int]]:
    """The options of the channel to the gRPC service."""
    return [
        # Reconnect quickly once the gRPC service is back; a refused connection still
        # fails an RPC at once (no wait_for_ready), which recall reports as offline.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        # grpcio 1.85 waits this long for any ping's answer (60 s by default), keepalive or not.
        ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Without this, gRPC stops pinging after two pings with no call in between.
        ("grpc.http2.max_pings_without_data", 0),
    ]


def memory_channel_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting ``ARONA_GRPC_TLS_CA``; None (plaintext) when it is unset.

    Raises :class:`~arona_grpc.config.ConfigError` (one line) when the file is unusable.
    """
    if settings.grpc_tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem("ARONA_GRPC_TLS_CA", settings.grpc_tls_ca)
    )


@dataclass(frozen=True)
class Replica:
    """One gRPC service replica: the target to dial, and the ``host:port`` it was named by
    when that is not the target (an address a name resolved to)."""

    target: str
    authority: str | None = None


Resolve = Callable[[str, int], Awaitable[Sequence[str]]]

# Targets in gRPC's own URI syntax are dialled as given.
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


async def _addresses(host: str, port: int) -> Sequence[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _split(target: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` as (host, port); None for anything else."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port)) if host else None


async def resolve_replicas(targets: Sequence[str], resolve: Resolve = _addresses) -> list[Replica]:
    """The replicas ``targets`` name: each target, and a name that resolves to several
    addresses as one replica per address (a name with one address stays a name, so gRPC
    resolves it again when its address changes). A name that does not resolve now is
    left to gRPC, which reports it when a call is made."""
    replicas: list[Replica] = []
    for target in targets:
        parts = _split(target) if not target.startswith(_SCHEMES) else None
        if parts is None:
            replicas.append(Replica(target))
            continue
        host, port = parts
        try:
            ipaddress.ip_address(host)
            replicas.append(Replica(target))
            continue
        except ValueError:
            pass
        try:
            found = list(dict.fromkeys(await resolve(host, port)))
        except OSError:
            found = []
        if len(found) < 2:
            replicas.append(Replica(target))
            continue
        for address in found:
            if ":" in address:
                replicas.append(Replica(f"ipv6:[{address}]:{port}", target))
            else:
                replicas.append(Replica(f"ipv4:{address}:{port}", target))
    return replicas


def open_memory_channel(settings: Settings, replica: Replica | None = None) -> grpc.aio.Channel:
    """The channel to ``replica`` (the first of ``ARONA_GRPC_TARGET`` by default); call
    from a running event loop.

    With ``ARONA_GRPC_TLS_CA`` the service's certificate must be signed by that CA and
    name the host dialled (``127.0.0.1`` for the local listener of ``up`` and ``serve``; the
    name for an address a name resolved to).
    """
    if replica is None:
        replica = Replica(settings.grpc_targets[0])
    options: list[tuple[str, int | str]] = [*channel_options()]
    credentials = memory_channel_credentials(settings)
    if replica.authority is not None:
        options.append(("grpc.default_authority", replica.authority))
        if credentials is not None:
            host = _split(replica.authority)
            if host is not None:
                options.append(("grpc.ssl_target_name_override", host[0]))
    if credentials is None:
        return grpc.aio.insecure_channel(replica.target, options=options)
    return grpc.aio.secure_channel(replica.target, credentials, options=options)


def memory_call_metadata(settings: Settings) -> tuple[tuple[str, str], ...]:
    """The metadata of every MemoryService call: the bearer token, when one is set."""
    if not settings.grpc_token:
        return ()
    return (("authorization", f"Bearer {settings.grpc_token}"),)
