"""Composition root of the gRPC side: MemoryService, health and reflection on one server.

:func:`build_server` assembles a ``grpc.aio`` server; :class:`GrpcServer` is the
handle the command line and the tests use: it binds the configured address (port 0
picks a free port), reports ``SERVING`` through ``grpc.health.v1.Health`` and, on
:meth:`GrpcServer.stop`, turns health to ``NOT_SERVING``, lets in-flight calls
finish within the grace period and closes the Philia link.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

# The asyncio health servicer; the typing stubs only know the threaded one.
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection

from arona_common.database import open_pool
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2 as pb
from arona_grpc._gen.arona.memory.v1 import memory_service_pb2_grpc as pb_grpc
from arona_grpc.config import Settings
from arona_grpc.metrics import start_metrics_server
from arona_grpc.security import BearerTokenInterceptor, check_exposure, server_credentials
from arona_grpc.service import MemoryDomain, ScopeModeRefused
from arona_grpc.servicer import MemoryServicer

logger = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MemoryService"].full_name

# The HTTP layer pings its connection every 30 s, with or without calls, to find one a
# network dropped silently (gateway_http.grpc_channel.channel_options). By default gRPC
# refuses pings without calls, or closer than 5 minutes apart, and then closes the connection.
MIN_PING_INTERVAL_MS = 1_000

# gRPC sets SO_REUSEPORT by default on Linux, which lets a second server "bind" a
# port that is already taken; turned off, a busy port is a clear start-up error.
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
]


class GrpcBindError(RuntimeError):
    """The gRPC listener could not bind its address (one line, for the operator)."""


def build_server(
    domain: MemoryDomain,
    health_servicer: health_aio.HealthServicer | None = None,
    *,
    token: str | None = None,
    servicer: MemoryServicer | None = None,
) -> grpc.aio.Server:
    """A ``grpc.aio`` server with MemoryService, health and reflection; not yet bound.

    ``health_servicer`` is created when not given; pass one to change the serving
    status later. With a ``token``, every MemoryService call must carry it as
    ``authorization: Bearer <token>``; without one no interceptor is installed at all.
    """
    interceptors = [BearerTokenInterceptor(token, SERVICE_NAME)] if token else None
    server = grpc.aio.server(options=_SERVER_OPTIONS, interceptors=interceptors)
    pb_grpc.add_MemoryServiceServicer_to_server(servicer or MemoryServicer(domain), server)
    health_pb2_grpc.add_HealthServicer_to_server(
        health_servicer or health_aio.HealthServicer(), server
    )
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server


class GrpcServer:
    """A running MemoryService listener; create with :meth:`start`."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health_aio.HealthServicer,
        domain: MemoryDomain,
        target: str,
        owned_pool: Any | None = None,
        metrics_server: WSGIServer | None = None,
        servicer: MemoryServicer | None = None,
    ) -> None:
        self._server = server
        self._servicer = servicer
        # A database pool the server opened itself (closed with it).
        self._owned_pool = owned_pool
        self._health = health_servicer
        self.domain = domain
        self.target = target
        self.port = int(target.rsplit(":", 1)[1])
        self._metrics_server = metrics_server
        self.metrics_port: int | None = (
            metrics_server.server_port if metrics_server is not None else None
        )
        """The port of the service's own ``/metrics`` listener (None when it is off)."""
        self._stopped = False

    @classmethod
    async def start(
        cls, settings: Settings, domain: MemoryDomain | None = None, *, pool: Any | None = None
    ) -> GrpcServer:
        """Bind ``settings.grpc_host:settings.grpc_port`` and start serving.

        With ``ARONA_DATABASE_URL`` the episode index and the outbox use ``pool``, or a pool
        opened here (:class:`~arona_common.database.DatabaseUnavailable` when the database
        cannot be reached). Raises :class:`~arona_grpc.security.GrpcSecurityError` before
        binding anything when the address is not loopback and no token is set, or the TLS
        files are unusable; :class:`~arona_grpc.service.ScopeModeRefused` when shared mode
        meets an index of per-user episodes; :class:`GrpcBindError` when the address cannot
        be bound.
        """
        try:
            check_exposure(settings)
            credentials = server_credentials(settings)
        except Exception:
            if domain is not None:
                await domain.aclose()
            raise
        owned_pool = None
        if domain is None:
            if pool is None and settings.database_url and settings.memory_enabled:
                pool = owned_pool = await open_pool(settings.database_url)
            domain = MemoryDomain(settings, pool=pool)
        try:
            # Before anything listens: shared mode over one user's episodes is refused.
            await domain.check_scope_mode()
        except ScopeModeRefused:
            await domain.aclose()
            if owned_pool is not None:
                await owned_pool.close()
            raise
        health_servicer = health_aio.HealthServicer()
        servicer = MemoryServicer(domain)
        server = build_server(domain, health_servicer, token=settings.grpc_token, servicer=servicer)
        address = _bind_address(settings.grpc_host, settings.grpc_port)
        problem = _bind_problem(settings.grpc_host, settings.grpc_port)
        if problem is not None:
            await domain.aclose()
            if owned_pool is not None:
                await owned_pool.close()
            raise GrpcBindError(f"cannot listen for gRPC on {address}: {problem}")
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError:
            port = 0
        if port == 0:
            await domain.aclose()
            if owned_pool is not None:
                await owned_pool.close()
            raise GrpcBindError(f"cannot listen for gRPC on {address}: address in use or invalid")
        metrics_server: WSGIServer | None = None
        if settings.grpc_metrics_port is not None and domain.metrics is not None:
            try:
                metrics_server = start_metrics_server(
                    domain.metrics.registry(), settings.grpc_host, settings.grpc_metrics_port
                )
            except OSError as exc:
                await server.stop(None)
                await domain.aclose()
                if owned_pool is not None:
                    await owned_pool.close()
                raise GrpcBindError(
                    f"cannot listen for metrics on {settings.grpc_host}:"
                    f"{settings.grpc_metrics_port}: {exc.strerror or exc}"
                ) from None
        await server.start()
        # An outbox left by an earlier run starts replaying now.
        await domain.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        # The address a client dials: wildcard hosts become loopback.
        target = dataclasses.replace(
            settings, grpc_port=port, grpc_target=None
        ).effective_grpc_target
        logger.info(
            "MemoryService listening on %s (memory %s, %s, %s)",
            target,
            "enabled" if domain.enabled else "disabled",
            "TLS" if credentials is not None else "plaintext",
            "bearer token required" if settings.grpc_token else "no token",
        )
        if metrics_server is not None:
            logger.info(
                "MemoryService metrics on http://%s:%d/metrics",
                target.rsplit(":", 1)[0],
                metrics_server.server_port,
            )
        return cls(server, health_servicer, domain, target, owned_pool, metrics_server, servicer)

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, finish in-flight calls within ``grace`` seconds, close Philia.

        Writebacks cut off by the grace period, and the outbox replay if it is still
        running after another ``grace``, are kept in the outbox for the next start.
        """
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        if self._servicer is not None:
            # Exchange streams never end by themselves: ask their callers to close them
            # (and to send their next calls elsewhere), so the grace period is not spent
            # waiting for them.
            self._servicer.say_goodbye()
        await self._server.stop(grace)
        await self.domain.aclose(grace)
        if self._metrics_server is not None:
            # serve_forever ends within its poll interval (0.5 s): not on the event loop.
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
        if self._owned_pool is not None:
            await self._owned_pool.close()
        logger.info("MemoryService stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (in use, no such address), tried with a plain socket
    first: gRPC's own failure prints a C-core log line to stderr before it raises, and a
    port in use is one line of ours. None when it can be (gRPC's bind may still fail: it
    then raises as before)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        return f"no such address ({exc.strerror or exc})"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                # As gRPC binds: a port whose last connections linger in TIME_WAIT is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
        except OSError as exc:
            return (exc.strerror or str(exc)).lower()
    return None


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
