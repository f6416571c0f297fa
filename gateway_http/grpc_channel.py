"""The HTTP layer's channels to ``MemoryService``: replicas, options, TLS, call credentials.

:func:`resolve_replicas` turns ``ARONA_GRPC_TARGET`` (one target or a comma-separated list)
into the replicas to spread calls over: a name is one replica per address it resolves to.
:class:`ReplicaWatch` resolves the names again every :data:`RESOLVE_EVERY_S` seconds and
whenever a replica cannot be reached, and moves the stream pool onto the replicas found, so
replicas that are replaced or added (a rolling update behind a DNS name) are followed without
a restart. :func:`open_memory_channel` is the only place that creates a channel to one:
plaintext, or TLS trusting ``ARONA_GRPC_TLS_CA`` when it is set.
:func:`memory_call_metadata` is what every MemoryService call carries:
``authorization: Bearer <ARONA_GRPC_TOKEN>`` when a token is set. The health check needs
neither token nor metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from arona_grpc.config import Settings
from arona_grpc.security import read_pem
from gateway_http.memory_stream import StreamPool

logger = logging.getLogger(__name__)

# In a split deployment the connection to the gRPC service crosses machines, and a NAT or
# firewall may drop it while idle without a word: the next turn's recall would then wait out
# its whole budget, and so would every turn after it until TCP gave up. Pinged every 30 s
# (idle or not), a dead connection is found within 40 s and replaced before a turn needs it.
# The service accepts pings this often (arona_grpc.server.MIN_PING_INTERVAL_MS).
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

# How often the names in ARONA_GRPC_TARGET are resolved again, and the least time between two
# resolutions when a replica cannot be reached.
RESOLVE_EVERY_S = 30.0
RESOLVE_MIN_GAP_S = 1.0
# How long a replica that left the resolution keeps its channel for the calls it still has.
GONE_GRACE_S = 10.0


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

    @property
    def address(self) -> str:
        """The target as an operator writes it (gRPC's ``ipv4:``/``ipv6:`` prefix off)."""
        return shown_address(self.target)


def shown_address(target: str) -> str:
    """A gRPC target as an operator writes it: ``ipv4:10.0.0.5:50051`` → ``10.0.0.5:50051``."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return target[len(scheme) :]
    return target


def replica_view(
    address: str, name: str | None = None, streams: int = 0, streams_open: int = 0
) -> dict[str, Any]:
    """One replica as ``memory.status`` shows it (no streams: the unary calls' target)."""
    return {"address": address, "name": name, "streams": streams, "streams_open": streams_open}


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


async def resolve_replicas(
    targets: Sequence[str], resolve: Resolve = _addresses, previous: Sequence[Replica] = ()
) -> list[Replica]:
    """The replicas ``targets`` name: an address as it is, and a name as one replica per
    address it resolves to. A name that does not resolve now keeps the replicas it had in
    ``previous``, or (none) is left to gRPC, which reports it when a call is made. Targets in
    gRPC's own syntax (``dns:///…``) are left to gRPC."""
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
        if not found:
            had = [r for r in previous if target in (r.authority, r.target)]
            replicas.extend(had or [Replica(target)])
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


class ReplicaWatch:
    """The stream pool's channels, kept on the replicas ``ARONA_GRPC_TARGET`` names now."""

    def __init__(
        self,
        settings: Settings,
        resolve: Resolve = _addresses,
        *,
        every_s: float = RESOLVE_EVERY_S,
        min_gap_s: float = RESOLVE_MIN_GAP_S,
    ) -> None:
        self._settings = settings
        self._resolve = resolve
        self._every_s = every_s
        self._min_gap_s = min_gap_s
        self.channels: dict[Replica, grpc.aio.Channel] = {}
        self.pool: StreamPool | None = None
        self._resolved_at = 0.0
        self._resolving: asyncio.Task[None] | None = None
        self._timer: asyncio.Task[None] | None = None
        # Channels of replicas that left, closing once their calls are answered.
        self._leaving: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    async def start(self, per_channel: int, metadata: tuple[tuple[str, str], ...]) -> StreamPool:
        """Resolve the targets, open a channel per replica and a pool of streams over them."""
        replicas = await resolve_replicas(self._settings.grpc_targets, self._resolve)
        self._resolved_at = time.monotonic()
        self.channels = {r: open_memory_channel(self._settings, r) for r in replicas}
        self.pool = StreamPool(list(self.channels.values()), per_channel, metadata)
        self.pool.refresh = self.refresh
        self._timer = asyncio.get_running_loop().create_task(self._every())
        return self.pool

    @property
    def replicas(self) -> list[Replica]:
        return list(self.channels)

    def view(self) -> list[dict[str, Any]]:
        """The replicas calls are spread over now, as ``memory.status`` shows them: each one's
        address, the ``ARONA_GRPC_TARGET`` name it came from (None for an address given as
        such) and its open streams."""
        shown = []
        for replica, channel in self.channels.items():
            open_now, streams = self.pool.streams_on(channel) if self.pool else (0, 0)
            shown.append(replica_view(replica.address, replica.authority, streams, open_now))
        return shown

    def address_of(self, channel: grpc.aio.Channel) -> str | None:
        """The address of the replica ``channel`` reaches (None for one no longer watched)."""
        for replica, mine in self.channels.items():
            if mine is channel:
                return replica.address
        return None

    async def refresh(self) -> None:
        """Resolve again now, unless that was done less than ``min_gap_s`` ago; callers at
        the same time share one resolution."""
        if self._resolving is None or self._resolving.done():
            if time.monotonic() - self._resolved_at < self._min_gap_s:
                return
            self._resolving = asyncio.get_running_loop().create_task(self._refresh())
        try:
            await asyncio.shield(self._resolving)
        except Exception as exc:  # a turn never fails for it: the replicas stay as they were
            logger.warning("resolving the memory service replicas failed: %r", exc)

    async def _refresh(self) -> None:
        self._resolved_at = time.monotonic()
        previous = list(self.channels)
        replicas = await resolve_replicas(self._settings.grpc_targets, self._resolve, previous)
        if self.pool is None or set(replicas) == set(previous):
            return
        channels = {
            r: self.channels.get(r) or open_memory_channel(self._settings, r) for r in replicas
        }
        gone = [channel for r, channel in self.channels.items() if r not in channels]
        self.channels = channels
        self.pool.replace(list(channels.values()))
        logger.info("memory service replicas are now %s", ", ".join(r.target for r in replicas))
        for channel in gone:
            # Its streams answer what they have, then the channel closes.
            task = asyncio.get_running_loop().create_task(channel.close(grace=GONE_GRACE_S))
            self._leaving[task] = channel
            task.add_done_callback(lambda done: self._leaving.pop(done, None))

    async def _every(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            await self.refresh()

    async def aclose(self) -> None:
        """Stop watching, close the streams and every channel."""
        for task in (self._timer, self._resolving):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.pool is not None:
            self.pool.close()
        for channel in self.channels.values():
            await channel.close(grace=None)
        for task, channel in list(self._leaving.items()):
            task.cancel()
            await channel.close(grace=None)


def memory_call_metadata(settings: Settings) -> tuple[tuple[str, str], ...]:
    """The metadata of every MemoryService call: the bearer token, when one is set."""
    if not settings.grpc_token:
        return ()
    return (("authorization", f"Bearer {settings.grpc_token}"),)
