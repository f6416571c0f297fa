"""JSON-RPC 2.0 transport: the dispatcher and its HTTP POST / WebSocket routes at ``/api/rpc``.

:class:`Dispatcher` owns the protocol: parsing, envelope validation, authentication, method
lookup, params validation (pydantic), invoking the handler, and mapping every failure to a
JSON-RPC error object. It knows nothing about the methods themselves; the application registers
them. :func:`rpc_router` carries the dispatcher over two transports:

* ``POST /api/rpc`` — one request or batch per body, JWT (or API key) in
  ``Authorization: Bearer``;
* ``GET /api/rpc`` (WebSocket) — one request or batch per message, JWT (or API key) in
  ``?token=`` or ``Authorization``; messages are handled concurrently and handlers may push
  notifications (``ctx.notify``) to that socket.

Who the credential belongs to is the authenticator's business (:class:`Authenticator`:
a :class:`~gateway_http.auth.JwtVerifier`, or :class:`~gateway_http.auth.RpcAuth` that
also takes the REST API keys).

Validation order per request (like a2a-python's dispatcher): envelope (-32600) -> auth (-32005)
-> method (-32601) -> params (-32602) -> handler. Handler bugs become -32603 with the traceback
logged, never sent. Bodies, params and tokens are never logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
import pydantic
from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.websockets import WebSocketDisconnect

from arona_common import tracing
from arona_grpc.config import DEFAULT_RPC_MAX_BATCH
from arona_grpc.logs import REQUEST_ID, new_request_id
from gateway_http.auth import (
    AUTH_REQUIRED_MESSAGE,
    AuthError,
    InvalidSubject,
    Principal,
    bearer,
)
from gateway_http.bodies import RPC_MAX_BODY_BYTES, read_limited

logger = logging.getLogger(__name__)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
APPLICATION_ERROR = -32000
AUTH_REQUIRED = -32005
NOT_ALLOWED = -32007


RPC_PATH = "/api/rpc"
# Bound on concurrently running messages per WebSocket: beyond it the socket stops reading
# (back-pressure) instead of piling up tasks for a client that floods it.
MAX_INFLIGHT_PER_SOCKET = 64
# How many field errors an invalid-params message names; the rest are summarised.
_MAX_FIELD_ERRORS = 5

Notify = Callable[[str, dict[str, Any]], Awaitable[None]]


class Authenticator(Protocol):
    def principal(self, token: str | None) -> Principal:
        """The caller behind ``token``; raise :class:`AuthError` for anything less than valid."""
        ...


class RpcError(Exception):
    """An error a handler wants the caller to see as-is (code, message and optional data)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


@dataclass
class RpcContext:
    """What a handler knows about its caller."""

    user: str  # the principal: a JWT's sub, or an API key's key:<name>
    notify: Notify | None  # WebSocket push; None over HTTP
    # The JWT carries "role": "admin".
    admin: bool = False


Handler = Callable[[Any, RpcContext], Awaitable[Any]]

_Id = str | int | None


@dataclass(frozen=True)
class _Method:
    handler: Handler
    params: type[pydantic.BaseModel]
    # Told when a call's params are refused (True over WebSocket).
    on_invalid: Callable[[bool], None] | None = None


class _NoResponse:
    """Marker: the request was a notification, nothing goes back."""


_NO_RESPONSE = _NoResponse()


def _error(id_: _Id, code: int, message: str, data: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "error": err, "id": id_}


def _default(obj: Any) -> Any:
    # Handlers may return pydantic models; anything else orjson cannot encode is a bug.
    if isinstance(obj, pydantic.BaseModel):
        return obj.model_dump(mode="json")
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def _encode(obj: Any) -> bytes:
    return orjson.dumps(obj, default=_default)


def _valid_id(value: Any) -> bool:
    # bool is an int subclass in Python but not a valid JSON-RPC id.
    return value is None or (isinstance(value, str | int) and not isinstance(value, bool))


def _params_message(exc: pydantic.ValidationError) -> tuple[str, list[dict[str, str]]]:
    """A short, safe description of a params validation failure (no input values, no URLs)."""
    fields: list[dict[str, str]] = []
    for item in exc.errors(include_url=False, include_input=False, include_context=False):
        loc = ".".join(str(part) for part in item["loc"]) or "params"
        fields.append({"field": loc, "message": item["msg"]})
    shown = fields[:_MAX_FIELD_ERRORS]
    text = "; ".join(f"{f['field']}: {f['message']}" for f in shown)
    if len(fields) > len(shown):
        text += f"; and {len(fields) - len(shown)} more"
    return f"Invalid params: {text}", shown


class _Auth:
    """Verifies the token at most once per body, and only if a request actually needs it."""

    def __init__(self, verifier: Authenticator, token: str | None) -> None:
        self._verifier = verifier
        self._token = token
        self._result: Principal | AuthError | None = None

    def user(self) -> Principal:
        if self._result is None:
            try:
                self._result = self._verifier.principal(self._token)
            except AuthError as exc:
                logger.debug("JSON-RPC call refused: %s", exc.reason)
                self._result = exc
        if isinstance(self._result, AuthError):
            raise self._result
        return self._result


class Dispatcher:
    """Routes JSON-RPC 2.0 requests to registered handlers; every method requires a valid
    credential (a JWT, or an API key when ``verifier`` takes them)."""

    def __init__(self, verifier: Authenticator, max_batch: int = DEFAULT_RPC_MAX_BATCH) -> None:
        self._verifier = verifier
        self._methods: dict[str, _Method] = {}
        # Calls one batch may hold (ARONA_RPC_MAX_BATCH): each answer is bounded, so this
        # bounds the batch's answer.
        self._max_batch = max_batch

    @property
    def methods(self) -> tuple[str, ...]:
        """The registered method names."""
        return tuple(self._methods)

    def register(
        self,
        name: str,
        handler: Handler,
        params: type[pydantic.BaseModel],
        on_invalid: Callable[[bool], None] | None = None,
    ) -> None:
        """Register ``handler`` under ``name``; its params are validated into ``params`` first.

        ``on_invalid`` is called when a call's params are refused (with whether it came over
        WebSocket), for the metrics of a method that counts its calls.
        """
        if name in self._methods:
            raise ValueError(f"JSON-RPC method already registered: {name}")
        self._methods[name] = _Method(handler, params, on_invalid)

    async def handle(
        self, body: bytes | str, token: str | None, notify: Notify | None = None
    ) -> bytes | None:
        """Process one HTTP body or WebSocket message; return the encoded response or ``None``."""
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _encode(_error(None, PARSE_ERROR, "Parse error"))

        auth = _Auth(self._verifier, token)
        if isinstance(payload, list):
            if not payload:
                return _encode(_error(None, INVALID_REQUEST, "Invalid Request: empty batch"))
            if len(payload) > self._max_batch:
                return _encode(
                    _error(
                        None,
                        INVALID_REQUEST,
                        f"Invalid Request: a batch holds at most {self._max_batch} calls, "
                        f"this one {len(payload)}",
                    )
                )
            # Sequential on purpose: a client batching conversations.create then .get expects
            # the effects in order, and a batch response waits for its slowest member anyway.
            responses: list[dict[str, Any]] = []
            for item in payload:
                answer = await self._one(item, auth, notify)
                if not isinstance(answer, _NoResponse):
                    responses.append(answer)
            return self._encode_many(responses) if responses else None

        answer = await self._one(payload, auth, notify)
        if isinstance(answer, _NoResponse):
            return None
        return self._encode_one(answer)

    def _encode_one(self, response: dict[str, Any]) -> bytes:
        try:
            return _encode(response)
        except TypeError:
            logger.exception("JSON-RPC result could not be encoded")
            return _encode(_error(response.get("id"), INTERNAL_ERROR, "Internal error"))

    def _encode_many(self, responses: list[dict[str, Any]]) -> bytes:
        try:
            return _encode(responses)
        except TypeError:
            # Find the culprit(s) so one bad result does not spoil the whole batch.
            return b"[" + b",".join(self._encode_one(r) for r in responses) + b"]"

    async def _one(
        self, request: Any, auth: _Auth, notify: Notify | None
    ) -> dict[str, Any] | _NoResponse:
        # 1) Envelope. An invalid request always gets an answer (there is no notification
        # without a valid envelope); its id is echoed only when it is itself a valid id.
        if not isinstance(request, dict):
            return _error(None, INVALID_REQUEST, "Invalid Request: expected an object")
        raw_id = request.get("id")
        id_: _Id = raw_id if _valid_id(raw_id) else None
        if request.get("jsonrpc") != "2.0":
            return _error(id_, INVALID_REQUEST, "Invalid Request: 'jsonrpc' must be exactly '2.0'")
        method = request.get("method")
        if not isinstance(method, str):
            return _error(id_, INVALID_REQUEST, "Invalid Request: 'method' must be a string")
        if not _valid_id(raw_id):
            return _error(
                None, INVALID_REQUEST, "Invalid Request: 'id' must be a string or integer"
            )
        params = request.get("params", {})
        if not isinstance(params, dict | list):
            return _error(
                id_, INVALID_REQUEST, "Invalid Request: 'params' must be an object or an array"
            )
        is_notification = "id" not in request

        response = await self._call(method, params, id_, auth, notify)
        return _NO_RESPONSE if is_notification else response

    async def _call(
        self,
        method: str,
        params: dict[str, Any] | list[Any],
        id_: _Id,
        auth: _Auth,
        notify: Notify | None,
    ) -> dict[str, Any]:
        # 2) Auth, for every method (including unknown ones: do not reveal what exists).
        try:
            user = auth.user()
        except InvalidSubject as exc:
            return _error(id_, AUTH_REQUIRED, exc.message)
        except AuthError:
            return _error(id_, AUTH_REQUIRED, AUTH_REQUIRED_MESSAGE)

        # 3) Method.
        entry = self._methods.get(method)
        if entry is None:
            return _error(id_, METHOD_NOT_FOUND, "Method not found")

        # 4) Params: flat objects only.
        if isinstance(params, list):
            return _error(id_, INVALID_PARAMS, "Invalid params: expected an object (by name)")
        try:
            model = entry.params.model_validate(params)
        except pydantic.ValidationError as exc:
            if entry.on_invalid is not None:
                entry.on_invalid(notify is not None)
            message, fields = _params_message(exc)
            return _error(id_, INVALID_PARAMS, message, {"fields": fields})
        except Exception:
            # A validator that raises something pydantic does not wrap is a bug, not bad input.
            logger.exception("JSON-RPC params model for %s failed", method)
            return _error(id_, INTERNAL_ERROR, "Internal error")

        # 5) Handler.
        try:
            context = RpcContext(user=user.id, notify=notify, admin=user.admin)
            result = await entry.handler(model, context)
        except RpcError as exc:
            return _error(id_, exc.code, exc.message, exc.data)
        except Exception:
            # The traceback is for the operator; the caller learns only that it failed.
            logger.exception("JSON-RPC method %s failed", method)
            return _error(id_, INTERNAL_ERROR, "Internal error")
        return {"jsonrpc": "2.0", "result": result, "id": id_}


def _too_large(limit: int) -> bytes:
    return _encode(_error(None, INVALID_REQUEST, f"Invalid Request: body exceeds {limit} bytes"))


class _RpcSocket:
    """One WebSocket connection: concurrent message handling with serialized sends."""

    def __init__(
        self, websocket: WebSocket, dispatcher: Dispatcher, token: str | None, max_bytes: int
    ) -> None:
        self._ws = websocket
        # uvicorn refuses a larger message before it is read (gateway_http.edge); this is
        # the backstop under a server configured otherwise.
        self._max_bytes = max_bytes
        self._dispatcher = dispatcher
        self._token = token
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def run(self) -> None:
        await self._ws.accept()
        try:
            await self._receive_loop()
        finally:
            self._closed = True
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _receive_loop(self) -> None:
        while True:
            if len(self._tasks) >= MAX_INFLIGHT_PER_SOCKET:
                await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text: str | None = message.get("text")
            data: bytes | None = text.encode("utf-8") if text is not None else message.get("bytes")
            if data is None:
                continue
            if len(data) > self._max_bytes:
                await self._send(_too_large(self._max_bytes))
                continue
            task = asyncio.create_task(self._handle(data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, data: bytes) -> None:
        # Each message is a request of its own (this task has its own context).
        REQUEST_ID.set(new_request_id())
        try:
            # The token is re-verified for every message: one that expires while the socket is
            # open stops working.
            response = await self._dispatcher.handle(data, self._token, self.notify)
        except Exception:
            # handle() maps handler failures itself; this is a bug in the transport.
            logger.exception("JSON-RPC WebSocket message failed")
            response = _encode(_error(None, INTERNAL_ERROR, "Internal error"))
        if response is not None:
            await self._send(response)

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        """Push a JSON-RPC notification to this socket (dropped once it has closed)."""
        await self._send(_encode({"jsonrpc": "2.0", "method": method, "params": params}))

    async def _send(self, payload: bytes) -> None:
        async with self._send_lock:
            if self._closed:
                return
            try:
                await self._ws.send_text(payload.decode("utf-8"))
            except (WebSocketDisconnect, RuntimeError, OSError):
                # The peer went away; the receive loop sees the disconnect and cancels the rest.
                self._closed = True
                logger.debug("JSON-RPC WebSocket closed while sending")


def rpc_router(
    get_dispatcher: Callable[[], Dispatcher], max_body_bytes: int = RPC_MAX_BODY_BYTES
) -> APIRouter:
    """Routes for ``/api/rpc`` over HTTP POST and WebSocket, serving ``get_dispatcher()``;
    a body or WebSocket message over ``max_body_bytes`` is refused."""
    router = APIRouter()

    @router.post(RPC_PATH, response_class=Response)
    async def rpc_post(request: Request) -> Response:
        try:
            body = await read_limited(request, max_body_bytes)
        except ClientDisconnect:
            # Gone before its body was whole (or given up on by the edge): nobody reads this.
            return Response(status_code=499)
        if body is None:
            return Response(
                _too_large(max_body_bytes), status_code=413, media_type="application/json"
            )
        token = bearer(request.headers.get("authorization"))
        # A chat.send in the body continues the request's traceparent.
        parent = tracing.context_of(request.headers) if tracing.active() else None
        try:
            with tracing.within(parent):
                response = await get_dispatcher().handle(body, token)
        except Exception:
            # handle() maps handler failures itself; this is a bug in the transport.
            logger.exception("JSON-RPC POST failed")
            response = _encode(_error(None, INTERNAL_ERROR, "Internal error"))
        if response is None:
            return Response(status_code=204)
        return Response(response, media_type="application/json")

    @router.websocket(RPC_PATH)
    async def rpc_websocket(websocket: WebSocket) -> None:
        token = bearer(websocket.headers.get("authorization")) or (
            websocket.query_params.get("token") or None
        )
        await _RpcSocket(websocket, get_dispatcher(), token, max_body_bytes).run()

    return router
