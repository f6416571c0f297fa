"""The FastAPI application factory.

``create_app(settings)`` builds the app; its lifespan opens ONE gRPC channel to
``MemoryService`` (the only way this layer reaches memory), one upstream
client, the conversation database and the usage meter, and closes them on shutdown
after giving pending writebacks a short grace period.

Every HTTP request gets its request id in :class:`GatewayApp` (returned as
``X-Request-Id``), every REST chat turn its server span there (arona_common.tracing), and
``GET /metrics`` serves the Prometheus exposition of :mod:`gateway_http.metrics` (unless
``ARONA_METRICS=false``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from opentelemetry.trace import Span
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from arona_common import tracing
from arona_common.database import DatabaseUnavailable, open_pool
from arona_common.storage import StorageFaults
from arona_grpc.config import Settings
from arona_grpc.logs import REQUEST_ID, request_id_or_new
from gateway_http.auth import ApiKeys, AuthError, JwtVerifier, RestAuth, RpcAuth, bearer
from gateway_http.bodies import DisconnectLog
from gateway_http.conversations import open_conversations
from gateway_http.errors import MEMORY_HEADER, NO_RECALL, ErrorKind, GatewayError, is_rest
from gateway_http.grpc_channel import (
    ReplicaWatch,
    memory_call_metadata,
    memory_channel_credentials,
    open_memory_channel,
    shown_address,
)
from gateway_http.journal import Journal, journal_path
from gateway_http.jsonrpc import Dispatcher, rpc_router
from gateway_http.mcp.endpoint import MCP_PATH, McpEndpoint
from gateway_http.memory_client import MemoryClient
from gateway_http.memory_stream import StreamPool
from gateway_http.metrics import GatewayMetrics, NoMetrics
from gateway_http.openapi import published
from gateway_http.responses import route as responses
from gateway_http.routes import console, passthrough, rest
from gateway_http.routes.rpc import register_methods
from gateway_http.state import Gateway
from gateway_http.turns import TurnPipeline
from gateway_http.upstream.backend import ChatBackend
from gateway_http.upstream.backends_file import BackendsFile
from gateway_http.upstream.routing import Router, build_router
from gateway_http.usage.metering import Metering
from gateway_http.views import database_unavailable

logger = logging.getLogger(__name__)

WRITEBACK_GRACE_S = 5.0
TRACER = tracing.Tracer("gateway_http")
# The server span of a REST chat turn (the HTTP semantic conventions' "{method} {route}").
CHAT_SPAN = f"POST {rest.CHAT_COMPLETIONS_PATH}"
# The REST turns served without the framework's layers (GatewayApp), by path: each takes its
# request and answers it, raising GatewayError for the error table.
_TurnRoute = Callable[[Request], Awaitable[Response]]
_TURN_ROUTES: dict[str, _TurnRoute] = {
    rest.CHAT_COMPLETIONS_PATH: rest.chat_completions,
    responses.RESPONSES_PATH: responses.create_response,
}


def _error_response(error: GatewayError) -> Response:
    return Response(
        error.response_body(),
        status_code=error.http_status,
        media_type="application/json",
        headers=error.headers,
    )


def _internal_error(request: Request) -> Response:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error_response(GatewayError(ErrorKind.INTERNAL, "Internal error", "internal_error"))


_REQUEST_ID_KEY = b"x-request-id"
_MEMORY_KEY = MEMORY_HEADER.lower().encode("latin-1")
_NO_RECALL = (_MEMORY_KEY, NO_RECALL.encode("latin-1"))


def _incoming_request_id(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == _REQUEST_ID_KEY:
            text: str = value.decode("latin-1")
            return text
    return None


class GatewayApp(FastAPI):
    """The FastAPI app, with the turn routes served without the framework layers.

    Under load, FastAPI's per-request middleware stack and routing (exception, body-limit,
    exit-stack and telemetry middleware, route matching, endpoint wrapping) cost more than
    everything else the HTTP layer does for a turn. ``POST /v1/chat/completions``,
    ``POST /v1/responses`` and the routes passed through to a backend
    (gateway_http.routes.passthrough) take no dependencies, so they are dispatched here
    straight to the same handlers, with the same error mapping as the exception handlers
    below; so is ``/mcp``, to its endpoint (which answers its own errors); every other request
    goes through FastAPI.

    Every HTTP request gets its request id here: the client's ``X-Request-Id`` when it is
    sane, otherwise a new one. It is set in :data:`~arona_grpc.logs.REQUEST_ID` for the
    request's log lines and gRPC calls, and returned as ``X-Request-Id`` on the response.
    Every answer under ``/v1`` that is not a turn's (an error, a 404, a listing) gets
    ``X-Arona-Memory: disabled`` here too, whichever layer produced it.
    """

    # The memory tools for agents at /mcp (set by create_app).
    mcp: McpEndpoint | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        request_id = request_id_or_new(_incoming_request_id(scope))
        token = REQUEST_ID.set(request_id)
        try:
            turn = _TURN_ROUTES.get(scope["path"]) if scope["method"] == "POST" else None
            if turn is not None:
                await self._turn(scope, receive, send, request_id, turn)
            elif scope["method"] == "POST" and scope["path"] in passthrough.HANDLERS:
                await self._pass_through(scope, receive, send, request_id)
            elif scope["path"] == MCP_PATH and self.mcp is not None:
                # Likewise /mcp: its endpoint answers everything itself, errors included.
                scope["app"] = self
                await self.mcp(
                    scope, receive, _with_headers(send, _added_headers(request_id, rest=False))
                )
            else:
                added = _added_headers(request_id, rest=is_rest(scope["path"]))
                await super().__call__(scope, receive, _with_headers(send, added))
        finally:
            REQUEST_ID.reset(token)

    async def _turn(
        self, scope: Scope, receive: Receive, send: Send, request_id: str, turn: _TurnRoute
    ) -> None:
        # The turn's server span (the framework's instrumentation never sees this route): it
        # lasts until the last byte of a stream.
        await self._served(scope, receive, send, request_id, turn, _turn_span(scope, request_id))

    async def _pass_through(
        self, scope: Scope, receive: Receive, send: Send, request_id: str
    ) -> None:
        """A route passed through to a backend (gateway_http.routes.passthrough), served
        without the framework's layers like chat, with the same error mapping."""
        handler = passthrough.HANDLERS[scope["path"]]
        await self._served(scope, receive, send, request_id, handler, _turn_span(scope, request_id))

    async def _served(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request_id: str,
        handler: _TurnRoute,
        served: AbstractContextManager[Span],
    ) -> None:
        """``handler``'s answer under its server span ``served``, a failure mapped as the
        exception handlers below map it, with the request id and the memory state added."""
        scope["app"] = self
        request = Request(scope, receive, send)
        with served as span:
            try:
                response = await handler(request)
            except GatewayError as exc:
                response = _error_response(exc)
            except DatabaseUnavailable:
                response = _error_response(database_unavailable())
            except rest.ClientGone:
                # Nobody is left to answer.
                tracing.failed(span, "cancelled")
                return
            except Exception:
                response = _internal_error(request)
            _add_headers(response.raw_headers, _added_headers(request_id, rest=True))
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                tracing.failed(span, str(response.status_code))
            await response(scope, receive, send)


def _turn_span(scope: Scope, request_id: str) -> AbstractContextManager[Span]:
    """The server span of a REST request served without the framework's layers (a chat or
    Responses turn, a route passed through to a backend), continuing the client's
    ``traceparent``; it lasts until the answer's last byte."""
    if not tracing.active():
        return tracing.NO_SPAN
    path = scope["path"]
    return TRACER.span(
        f"POST {path}",
        kind=tracing.SERVER,
        parent=tracing.extract(tracing.headers_carrier(scope["headers"])),
        attributes={
            "http.request.method": "POST",
            "http.route": path,
            "url.path": path,
            "url.scheme": scope.get("scheme", "http"),
            "arona.request_id": request_id,
        },
    )


def _added_headers(request_id: str, *, rest: bool) -> list[tuple[bytes, bytes]]:
    """The request id, and for the REST surface the memory state of an answer without one."""
    added = [(_REQUEST_ID_KEY, request_id.encode("latin-1"))]
    if rest:
        added.append(_NO_RECALL)
    return added


def _add_headers(headers: list[tuple[bytes, bytes]], added: list[tuple[bytes, bytes]]) -> None:
    said = {key.lower() for key, _ in headers}
    headers.extend(header for header in added if header[0] not in said)


def _with_headers(send: Send, added: list[tuple[bytes, bytes]]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            _add_headers(headers, added)
            message["headers"] = headers
        await send(message)

    return sending


METRICS_PATH = "/metrics"


def _add_metrics_route(app: FastAPI, metrics: GatewayMetrics, settings: Settings) -> None:
    """``GET /metrics``: the Prometheus text exposition.

    Open unless ``ARONA_METRICS_TOKEN`` is set; then the bearer must be that token, or a JWT
    that may read ``memory.status`` (any valid one in shared mode, an admin's in user mode),
    so the console, which shows the turn counts, scrapes with the token it already holds.
    """
    registry = metrics.registry()
    token = settings.metrics_token
    expected = token.encode() if token else None
    verifier = JwtVerifier(settings.jwt_secret)

    def allowed(credential: str | None) -> bool:
        if expected is None:
            return True
        if credential is None:
            return False
        if hmac.compare_digest(credential.encode(), expected):
            return True
        try:
            principal = verifier.principal(credential)
        except AuthError:
            return False
        return principal.admin or not settings.user_scoped

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics_endpoint(request: Request) -> Response:
        if not allowed(bearer(request.headers.get("authorization"))):
            raise GatewayError(
                ErrorKind.AUTH, "Invalid or missing metrics token", "invalid_metrics_token"
            )
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def create_app(
    settings: Settings,
    memory_client: MemoryClient | None = None,
    backend: ChatBackend | None = None,
    metrics_collectors: Iterable[Collector] = (),
    *,
    pool: Any | None = None,
    worker: int = 0,
    backends: BackendsFile | None = None,
) -> FastAPI:
    """The app; with ``ARONA_DATABASE_URL`` its conversations use ``pool``, or a pool the
    lifespan opens (and closes). ``metrics_collectors`` are shown on its ``/metrics`` beside
    its own (the gRPC service's, when it runs in the same process). ``backends`` is the
    checked backends file (``ARONA_BACKENDS``, read by the entry point); without it (and
    without a ``backend`` given) the one ``ARONA_UPSTREAM_URL``, or ``echo``, answers."""
    # Built now, not in the lifespan, so that a bad ARONA_UPSTREAM_URL fails
    # start-up with one clear line (ConfigError) instead of inside uvicorn.
    metrics = GatewayMetrics(metrics_collectors) if settings.metrics else NoMetrics()
    router = (
        Router.single(backend, owns_backend=False, metrics=metrics)
        if backend is not None
        else build_router(settings.upstream_url, settings.upstream_api_key, backends, metrics)
    )
    # Which of this process's files cannot be written now: said once, shown by memory.status
    # and /metrics.
    storage = StorageFaults()
    metrics.watch_storage(storage)
    # Likewise an unreadable ARONA_GRPC_TLS_CA (read here to fail early, and again by the
    # lifespan when it opens the channel).
    if memory_client is None:
        memory_channel_credentials(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        channels: list[grpc.aio.Channel] = []
        watch: ReplicaWatch | None = None
        streams: StreamPool | None = None
        memory = memory_client
        if memory is None:
            metadata = memory_call_metadata(settings)
            if settings.grpc_streams:
                watch = ReplicaWatch(settings)
                streams = await watch.start(settings.grpc_streams, metadata)
            else:
                channels = [open_memory_channel(settings)]
            memory = MemoryClient(
                streams.channels[0] if streams is not None else channels[0],
                recall_budget_s=settings.recall_budget_s,
                rpc_timeout_s=settings.memory_timeout_s,
                metrics=metrics,
                metadata=metadata,
                streams=streams,
                replicas=watch if watch is not None else shown_address(settings.grpc_targets[0]),
            )
        db_pool = pool
        if db_pool is None and settings.database_url:
            db_pool = await open_pool(settings.database_url)
        conversations = open_conversations(settings.data_dir, db_pool, settings.database_url)
        usage = (
            await Metering.open(
                settings, db_pool, metrics, backends.price if backends is not None else None
            )
            if settings.usage
            else None
        )
        journal = (
            Journal(journal_path(settings.data_dir, worker), storage)
            if settings.writeback_journal
            else None
        )
        pipeline = TurnPipeline(
            memory,
            router,
            conversations,
            user_scoped=settings.user_scoped,
            journal=journal,
            metrics=metrics,
            storage=storage,
            usage=usage,
            placement=settings.memory_placement,
        )
        api_keys = ApiKeys(settings.api_keys)
        if api_keys.open:
            logger.warning("ARONA_API_KEYS is not set: the REST /v1 endpoints are open")
        if not settings.jwt_secret:
            logger.warning(
                "ARONA_JWT_SECRET is not set: JSON-RPC refuses every JWT%s",
                "" if api_keys.open else " (API keys still work)",
            )
        verifier = JwtVerifier(settings.jwt_secret)
        dispatcher = Dispatcher(RpcAuth(verifier, api_keys), settings.rpc_max_batch)
        rest_auth = RestAuth(api_keys, verifier)
        gw = Gateway(
            settings, memory, router, conversations, pipeline, rest_auth, dispatcher, usage
        )
        register_methods(dispatcher, gw)
        app.state.gateway = gw
        # Episodes a previous run answered but could not hand over.
        pipeline.replay_journal()
        try:
            yield
        finally:
            await pipeline.drain(WRITEBACK_GRACE_S)
            if journal is not None:
                journal.close()
            await router.aclose()
            if usage is not None:
                await usage.aclose()
            await conversations.aclose()
            if db_pool is not None and pool is None:
                await db_pool.close()
            if watch is not None:
                await watch.aclose()
            for channel in channels:
                await channel.close(grace=None)

    # The memory tools for agents; its session manager runs inside the lifespan.
    mcp = McpEndpoint(settings, metrics)
    app = GatewayApp(
        title="Arona Memory Gateway",
        lifespan=mcp.lifespan(lifespan),
        docs_url=None,
        redoc_url=None,
    )
    app.state.disconnects = DisconnectLog()
    app.include_router(rest.router)
    app.include_router(responses.router)
    app.include_router(passthrough.router)
    app.include_router(
        rpc_router(lambda: app.state.gateway.dispatcher, settings.rpc_max_body_bytes)
    )
    app.include_router(console.router)
    app.mcp = mcp
    app.router.routes.append(mcp.route())
    if settings.metrics:
        _add_metrics_route(app, metrics, settings)

    def openapi() -> dict[str, Any]:
        # Built once, on the first request for it (gateway_http.openapi).
        if app.openapi_schema is None:
            app.openapi_schema = published(app, settings.rpc_max_batch)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (404, 405) and is_rest(request.url.path):
            return passthrough.invalid_url(request)
        kind = {404: ErrorKind.NOT_FOUND, 401: ErrorKind.AUTH, 413: ErrorKind.TOO_LARGE}.get(
            exc.status_code, ErrorKind.BAD_INPUT
        )
        error = GatewayError(kind, str(exc.detail), f"http_{exc.status_code}")
        response = _error_response(error)
        response.status_code = exc.status_code
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(
            GatewayError(ErrorKind.BAD_INPUT, "invalid request", "invalid_request")
        )

    @app.exception_handler(DatabaseUnavailable)
    async def _database_unavailable(request: Request, exc: DatabaseUnavailable) -> Response:
        # Said once per outage by arona_common.database; here only its answer.
        return _error_response(database_unavailable())

    @app.exception_handler(rest.ClientGone)
    async def _client_gone(request: Request, exc: rest.ClientGone) -> Response:
        # Never sent: the connection is gone. 499 is the customary log value.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return _internal_error(request)

    return app
