"""The HTTP layer's one channel to ``MemoryService``: options, TLS and call credentials.

:func:`open_memory_channel` is the only place that creates that channel: plaintext, or TLS
trusting ``ARONA_GRPC_TLS_CA`` when it is set. :func:`memory_call_metadata` is what every
MemoryService call carries: ``authorization: Bearer <ARONA_GRPC_TOKEN>`` when a token is set.
The health check needs neither token nor metadata.
"""

from __future__ import annotations

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


def open_memory_channel(settings: Settings) -> grpc.aio.Channel:
    """The channel to ``settings.effective_grpc_target``; call from a running event loop.

    With ``ARONA_GRPC_TLS_CA`` the service's certificate must be signed by that CA and
    name the host dialled (``127.0.0.1`` for the local listener of ``up`` and ``serve``).
    """
    target = settings.effective_grpc_target
    credentials = memory_channel_credentials(settings)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=channel_options())
    return grpc.aio.secure_channel(target, credentials, options=channel_options())


def memory_call_metadata(settings: Settings) -> tuple[tuple[str, str], ...]:
    """The metadata of every MemoryService call: the bearer token, when one is set."""
    if not settings.grpc_token:
        return ()
    return (("authorization", f"Bearer {settings.grpc_token}"),)
