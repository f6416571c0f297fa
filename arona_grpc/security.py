"""Who may call MemoryService, and how its listener is protected.

- :class:`BearerTokenInterceptor` refuses every ``arona.memory.v1.MemoryService`` call
  whose ``authorization`` metadata is not ``Bearer <ARONA_GRPC_TOKEN>`` with
  ``UNAUTHENTICATED``. The health service stays open (probes carry no credentials), and
  so does reflection: it only describes the schema. The server installs the interceptor
  only when a token is set, so an open service pays nothing per call.
- :func:`server_credentials` turns ``ARONA_GRPC_TLS_CERT`` / ``ARONA_GRPC_TLS_KEY`` into
  TLS credentials for the listener.
- :func:`check_exposure` refuses to listen beyond loopback without a token;
  :func:`check_listener` runs both checks for the command line before anything starts.

Start-up problems raise :class:`GrpcSecurityError`, one line for the operator; the token
never appears in a message or a log line.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from arona_grpc.config import ConfigError, Settings

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
BEARER = "bearer"
# The same words whatever was sent: a caller learns nothing about the expected token.
UNAUTHENTICATED_DETAILS = "missing or wrong 'authorization: Bearer' metadata"


class GrpcSecurityError(ConfigError):
    """The listener's token or TLS settings cannot be used (one line, for the operator)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``ARONA_GRPC_HOST``) is reachable from this machine only.

    Loopback is ``localhost``, 127.0.0.0/8 and ``::1``; the wildcards ``0.0.0.0`` and
    ``::``, other addresses and other names are not.
    """
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> None:
    """Refuse a non-loopback listener without ``ARONA_GRPC_TOKEN``, before anything binds."""
    if settings.grpc_token or is_loopback(settings.grpc_host):
        return
    host = settings.grpc_host or "*"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    raise GrpcSecurityError(
        f"refusing to listen for gRPC on {host}:{settings.grpc_port} "
        "without ARONA_GRPC_TOKEN: set it (ideally with ARONA_GRPC_TLS_CERT/KEY too), "
        "or listen on 127.0.0.1"
    )


def check_listener(settings: Settings) -> None:
    """Everything :func:`check_exposure` and :func:`server_credentials` refuse, checked early.

    The command line runs this before it starts any part, so a refused listener is one
    line on stderr rather than other parts starting and stopping around it.
    """
    check_exposure(settings)
    server_credentials(settings)


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from ``ARONA_GRPC_TLS_CERT`` and ``_KEY``; None when neither is set."""
    cert, key = settings.grpc_tls_cert, settings.grpc_tls_key
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise GrpcSecurityError(
            "ARONA_GRPC_TLS_CERT and ARONA_GRPC_TLS_KEY must be set together (or neither)"
        )
    key_pem, cert_pem = read_pem("ARONA_GRPC_TLS_KEY", key), read_pem("ARONA_GRPC_TLS_CERT", cert)
    # gRPC itself would only report "cannot bind" (and print its own lines) for a key that
    # does not fit the certificate, or an encrypted one: check the pair with OpenSSL first.
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            cert, key, password=lambda: b""
        )
    except ssl.SSLError:
        raise GrpcSecurityError(
            "ARONA_GRPC_TLS_CERT and ARONA_GRPC_TLS_KEY are not a certificate and its "
            "unencrypted private key"
        ) from None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def read_pem(name: str, path: Path) -> bytes:
    """The contents of the PEM file named by the variable ``name``; one line when unusable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GrpcSecurityError(
            f"{name}: cannot read {path}: {exc.strerror or type(exc).__name__}"
        ) from None
    if b"-----BEGIN " not in data:
        raise GrpcSecurityError(f"{name}: {path} is not a PEM file")
    return data


if TYPE_CHECKING:
    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    _Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
else:
    # At run time neither class is generic; only the typing stubs say so.
    _Interceptor = grpc.aio.ServerInterceptor


async def _refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


# One refusing handler per call shape. None of them deserializes the request: nothing a
# caller without the token sends is parsed.
_REFUSALS: dict[tuple[bool, bool], _Handler] = {
    (False, False): grpc.unary_unary_rpc_method_handler(_refuse),
    (False, True): grpc.unary_stream_rpc_method_handler(_refuse),
    (True, False): grpc.stream_unary_rpc_method_handler(_refuse),
    (True, True): grpc.stream_stream_rpc_method_handler(_refuse),
}


class BearerTokenInterceptor(_Interceptor):
    """Lets a call to ``service`` through only with ``authorization: Bearer <token>``."""

    def __init__(self, token: str, service: str) -> None:
        if not token:
            raise ValueError("an empty token protects nothing")
        self._token = token.encode()
        self._prefix = f"/{service}/"

    def __repr__(self) -> str:
        # Never the token.
        return f"{type(self).__name__}(service={self._prefix.strip('/')!r})"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        logger.debug("refused %s: no valid bearer token", handler_call_details.method)
        return _REFUSALS[(handler.request_streaming, handler.response_streaming)]

    def _authorized(self, metadata: Any) -> bool:
        values = [value for key, value in metadata or () if key == AUTHORIZATION]
        # Exactly one header: two could disagree about who is calling.
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        scheme, _, credential = values[0].strip().partition(" ")
        if scheme.lower() != BEARER:
            return False
        # Constant time: how much of a guess matches does not show in the answer's timing.
        return hmac.compare_digest(credential.strip().encode(), self._token)
