"""``/mcp``: the memory tools over MCP Streamable HTTP, on the gateway's HTTP port.

:class:`McpEndpoint` is an ASGI app mounted by :func:`gateway_http.app.create_app`. It settles
who the caller is before any MCP message is read, with the bearers ``/v1`` and ``/api/rpc`` take:
one of ``ARONA_API_KEYS`` (principal ``key:<name>``) or a JWT signed with ``ARONA_JWT_SECRET``
(its ``sub``). A bearer that is neither, or none where one is required, is answered 401 with a
JSON-RPC error body and ``WWW-Authenticate: Bearer``. A bearer is required unless the gateway
is open (no API keys) in shared scope mode; there, a caller without one is nobody, as REST's
anonymous turns are, and shares their memory.

Then the SDK's Streamable HTTP session manager serves the request, **stateless** and with
JSON answers: every POST stands alone, so any replica behind a load balancer can take any
request, and nothing waits on a server-sent stream (the tools never call back). The manager
runs inside the app's lifespan (:meth:`McpEndpoint.lifespan`), after the gateway it serves is
built and stopped before it is torn down. Request bodies are bounded by
``ARONA_HTTP_MAX_BODY_BYTES``, as every other route's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from importlib import metadata
from typing import Any

import orjson
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.requests import ClientDisconnect, Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from arona_grpc.config import Settings
from arona_grpc.logs import REQUEST_ID
from gateway_http.auth import (
    AUTH_REQUIRED_MESSAGE,
    ApiKeys,
    AuthError,
    JwtVerifier,
    Principal,
    RpcAuth,
    bearer,
)
from gateway_http.bodies import read_limited
from gateway_http.errors import TABLE, ErrorKind
from gateway_http.mcp import direct
from gateway_http.mcp.server import CALLER_KEY, REQUEST_ID_KEY, ToolCalls, build_server
from gateway_http.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

MCP_PATH = "/mcp"
_AUTH_CODE = TABLE[ErrorKind.AUTH].jsonrpc_code

Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


def _version() -> str:
    try:
        return metadata.version("arona-memory-gateway")
    except metadata.PackageNotFoundError:
        return "0"


def _refusal(message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = orjson.dumps(
        {"jsonrpc": "2.0", "id": None, "error": {"code": _AUTH_CODE, "message": message}}
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Bearer realm="arona"'),
    ]
    return body, headers


class McpEndpoint:
    """The ASGI app of ``/mcp``: authentication, then the SDK's session manager."""

    def __init__(self, settings: Settings, metrics: GatewayMetrics) -> None:
        keys = ApiKeys(settings.api_keys)
        self._auth = RpcAuth(JwtVerifier(settings.jwt_secret), keys)
        # As REST: open without keys; but in user mode memory is a principal's, so an agent
        # without one would have none at all.
        self._anonymous = keys.open and not settings.user_scoped
        self._max_body = settings.http_max_body_bytes
        self._calls = ToolCalls(metrics)
        self._server = build_server(self._calls, _version())
        self._manager: StreamableHTTPSessionManager | None = None

    def lifespan(self, inner: Lifespan) -> Lifespan:
        """``inner`` (the app's lifespan), with the session manager running inside it."""

        @contextlib.asynccontextmanager
        async def both(app: Any) -> AsyncIterator[None]:
            async with inner(app):
                # One manager per run: the SDK's cannot be started twice.
                manager = StreamableHTTPSessionManager(
                    self._server,
                    json_response=True,
                    stateless=True,
                    max_request_body_size=self._max_body,
                )
                async with manager.run():
                    self._manager = manager
                    try:
                        yield
                    finally:
                        self._manager = None

        return both

    def route(self) -> Route:
        """The route of ``/mcp`` (the SDK's client posts, may open a GET stream and deletes)."""
        return Route(MCP_PATH, self, methods=["GET", "POST", "DELETE"], include_in_schema=False)

    def caller(self, authorization: str | None) -> Principal | None:
        """The caller of a request; :class:`AuthError` when it must not go on."""
        credential = bearer(authorization)
        if credential is None:
            if self._anonymous:
                return None
            raise AuthError(AUTH_REQUIRED_MESSAGE, reason="no bearer")
        return self._auth.principal(credential)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        manager = self._manager
        if scope["type"] != "http" or manager is None:
            raise RuntimeError("/mcp serves HTTP requests while the app runs")
        authorization = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            principal = self.caller(authorization)
        except AuthError as exc:
            logger.debug("MCP request refused: %s", exc.reason)
            refusal, headers = _refusal(exc.message)
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": refusal})
            return
        scope[CALLER_KEY] = principal
        scope[REQUEST_ID_KEY] = REQUEST_ID.get()
        if scope["method"] == "POST" and direct.eligible(scope["headers"]):
            request = Request(scope, receive)
            try:
                body = await read_limited(request, self._max_body)
            except ClientDisconnect:
                return
            if body is None:
                await direct.too_large(self._max_body)(scope, receive, send)
                return
            call = direct.tool_call(body)
            if call is not None:
                response = await direct.answer(self._calls, scope, call)
                await response(scope, receive, send)
                return
            # Anything else is the SDK's, with the body it was sent.
            receive = direct.replayed(body, receive)
        await manager.handle_request(scope, receive, send)
