"""REST surface: OpenAI-compatible ``/v1`` chat completions (JSON and SSE),
models, and the health probes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from gateway_http.auth import ANONYMOUS, AuthError, InvalidSubject, Principal, memory_scope
from gateway_http.bodies import read_limited
from gateway_http.chat_request import split_body
from gateway_http.conversations import PAGE_DEFAULT_MESSAGES
from gateway_http.errors import MEMORY_HEADER, ErrorKind, GatewayError, bad_input
from gateway_http.memory_client import DISABLED
from gateway_http.state import Gateway, gateway_of
from gateway_http.turns import PreparedTurn, TurnRequest
from gateway_http.upstream.backend import UpstreamError
from gateway_http.views import (
    LIMIT_ERROR,
    conversation_errors,
    conversation_view,
    conversation_with_messages,
)

logger = logging.getLogger(__name__)

# Also dispatched directly by gateway_http.app.GatewayApp (the hot path).
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
MEMORY_COUNT_HEADER = "X-Arona-Memory-Count"
RECALL_MS_HEADER = "X-Arona-Recall-Ms"
OVERHEAD_MS_HEADER = "X-Arona-Overhead-Ms"
# The backend whose answer this is (its name in the backends file; `upstream` or `echo`
# without one).
BACKEND_HEADER = "X-Arona-Backend"
# Whether the turn is written back once its reply is complete: on; off (no memory for this
# caller, or the memory service stores no writebacks); or skipped, the seed's rule for a
# streamed turn without a conversation_id (unless ARONA_MEMORY_STREAM_WRITEBACK=true), said
# so that a streaming client learns why its memory stays empty.
WRITEBACK_HEADER = "X-Arona-Writeback"
WRITEBACK_ON = "on"
WRITEBACK_OFF = "off"
WRITEBACK_SKIPPED = "skipped; reason=no_conversation_id"
# The `surface` label of the turn metrics.
REST = "rest"
REST_STREAM = "rest_stream"
_DONE = b"data: [DONE]\n\n"

router = APIRouter()
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its reply was ready; nobody reads the answer."""


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 as soon as it grows past the gateway's limit
    (``ARONA_HTTP_MAX_BODY_BYTES``); :class:`ClientGone` when the client leaves (or the edge
    gives up on it, gateway_http.edge) before it is whole."""
    limit = gateway_of(request).settings.http_max_body_bytes
    try:
        body = await read_limited(request, limit)
    except ClientDisconnect:
        raise ClientGone() from None
    if body is None:
        raise GatewayError(
            ErrorKind.TOO_LARGE, f"request body is larger than {limit} bytes", "request_too_large"
        )
    return body


async def read_json_body(request: Request) -> tuple[bytes, Any]:
    """The request body (:func:`read_body`) and the JSON it holds: a 400 when it is not JSON."""
    raw = await read_body(request)
    return raw, parsed_json(raw)


def parsed_json(raw: bytes) -> Any:
    """``raw`` parsed as JSON, or the 400 of a body that is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_input("the request body is not valid JSON") from None


JSON_MEDIA_TYPE = "application/json"


def require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json``.

    A web page can make any visitor's browser send a form or a ``fetch`` to the gateway, but
    only as ``text/plain``, a form type or no type at all; so with REST open no page can write
    turns into memory through its visitors.
    """
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        raise GatewayError(
            ErrorKind.UNSUPPORTED_MEDIA,
            "the request body must be JSON, sent with Content-Type: application/json",
            "unsupported_media_type",
        )


def rest_caller(gw: Gateway, request: Request) -> Principal | None:
    """The REST caller (an API key or a JWT's ``sub``); None when REST is open and the
    caller shows no valid JWT. A bearer that is neither, with keys set, is a 401."""
    try:
        return gw.rest_auth.principal(request.headers.get("authorization"))
    except InvalidSubject as exc:
        raise GatewayError(ErrorKind.AUTH, exc.message, "invalid_subject") from None
    except AuthError:
        raise GatewayError(
            ErrorKind.AUTH, "Invalid or missing API key", "invalid_api_key"
        ) from None


def rest_owner(gw: Gateway, request: Request) -> str:
    """The owner of the caller's conversations (``anonymous`` without a principal)."""
    principal = rest_caller(gw, request)
    return principal.id if principal is not None else ANONYMOUS


def upstream_failure(exc: UpstreamError, turn: PreparedTurn | None = None) -> GatewayError:
    """What the client gets for an upstream that failed (every surface maps it here); on REST
    the answer says what memory did for the turn.

    An upstream's 4xx about the request (:data:`~gateway_http.upstream.backend.PASSED_THROUGH`)
    is answered with its status and its body byte for byte (a body that is not a JSON object
    becomes an OpenAI-shaped one), with its content type, ``retry-after`` and
    ``x-ratelimit-*``, and ``X-Arona-Backend`` naming the backend that said it. Anything else
    is the gateway's own 502: a 401 or 403 is the operator's key, never the client's, so it
    names the backend and not the upstream's words about the key. The JSON-RPC error's data
    carries the upstream's status and error code either way.
    """
    headers = {} if turn is None else memory_headers(turn)
    data = _upstream_data(exc)
    if exc.passed_through:
        assert exc.status is not None
        kept = dict(exc.headers)
        body = exc.body
        if exc.answer is None:
            # Not an answer a client can read (a proxy's page, a cut-off body): said in
            # OpenAI's shape, under the upstream's status.
            body = orjson.dumps(
                {
                    "error": {
                        "message": exc.message,
                        "type": "upstream_error",
                        "code": "upstream_error",
                        "param": None,
                    }
                }
            )
            kept["content-type"] = JSON_MEDIA_TYPE
        if exc.backend is not None:
            headers[BACKEND_HEADER] = exc.backend
        return GatewayError(
            ErrorKind.UPSTREAM,
            exc.message,
            "upstream_error",
            headers={**kept, **headers},
            status=exc.status,
            body=body,
            data=data,
        )
    message = exc.message
    if exc.credentials_refused:
        message = (
            f"backend {exc.backend or 'upstream'} refused the gateway's credentials "
            f"(HTTP {exc.status}): the operator's key for that backend needs attention"
        )
    return GatewayError(
        ErrorKind.UPSTREAM, message, "upstream_error", headers=headers or None, data=data
    )


def _upstream_data(exc: UpstreamError) -> dict[str, Any]:
    """What a JSON-RPC error's data says of an upstream's failure besides its code: the
    upstream's HTTP status, its error's ``code`` and ``param``, when to try again, and the
    backend (for an HTTP error)."""
    if exc.status is None:
        return {}
    data: dict[str, Any] = {"status": exc.status}
    # What an upstream says about the operator's key is not the client's to read.
    error = {} if exc.credentials_refused else exc.error_object
    for key, name in (("code", "upstream_code"), ("param", "param")):
        value = error.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool):
            data[name] = value
    retry_after = exc.header("retry-after")
    if retry_after is not None:
        data["retry_after"] = retry_after
    if exc.backend is not None:
        data["backend"] = exc.backend
    return data


def turn_outcome(exc: GatewayError) -> str:
    """The ``outcome`` label of a turn that ended with ``exc``."""
    return "upstream_error" if exc.kind is ErrorKind.UPSTREAM else "client_error"


def memory_headers(turn: PreparedTurn) -> dict[str, str]:
    """``X-Arona-Memory`` and its companions: what memory did for the turn."""
    return {
        MEMORY_HEADER: turn.memory_state,
        MEMORY_COUNT_HEADER: str(turn.memory_count),
        RECALL_MS_HEADER: f"{turn.recall_s * 1000:.3f}",
    }


def turn_headers(turn: PreparedTurn, writeback: str) -> dict[str, str]:
    """The memory headers, the overhead measured up to now, the writeback decision, and the
    backend that answered."""
    overhead_s = turn.overhead_s(time.perf_counter())
    headers = memory_headers(turn)
    headers[OVERHEAD_MS_HEADER] = f"{overhead_s * 1000:.3f}"
    headers[WRITEBACK_HEADER] = writeback
    backend = turn.backend
    if backend is not None:
        headers[BACKEND_HEADER] = backend
    return headers


def writeback_state(gw: Gateway, turn: PreparedTurn, *, streamed: bool) -> str:
    """What ``X-Arona-Writeback`` says of ``turn`` (see :data:`WRITEBACK_HEADER`)."""
    if not gw.pipeline.writes_back(turn.request):
        return WRITEBACK_OFF
    if streamed and not stream_writes_back(gw, turn):
        return WRITEBACK_SKIPPED
    return WRITEBACK_ON


def stream_writes_back(gw: Gateway, turn: PreparedTurn) -> bool:
    """The seed's rule: a streamed REST turn is written back only with a conversation;
    ``ARONA_MEMORY_STREAM_WRITEBACK=true`` writes back the others too."""
    return turn.request.conversation_id is not None or gw.settings.memory_stream_writeback


def _json(payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json", headers=headers)


def _event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@router.post(CHAT_COMPLETIONS_PATH)
async def chat_completions(request: Request) -> Response:
    started = time.perf_counter()
    gw = gateway_of(request)
    pipeline = gw.pipeline
    surface = REST
    try:
        require_json(request)
        principal = rest_caller(gw, request)
        _, body = await read_json_body(request)
        if isinstance(body, dict) and body.get("stream") is True:
            surface = REST_STREAM
        upstream_body, memory, conversation_id = split_body(body)
        turn = await pipeline.prepare(
            TurnRequest(
                principal.id if principal is not None else ANONYMOUS,
                upstream_body,
                memory,
                conversation_id,
                memory_scope(principal, upstream_body.get("user")),
                started,
            )
        )
    except GatewayError as exc:
        pipeline.metrics.turn(surface, DISABLED, turn_outcome(exc))
        raise
    if surface == REST_STREAM:
        return await _stream(gw, turn)
    try:
        reply = await _unless_disconnected(request, pipeline.complete(turn))
    except UpstreamError as exc:
        pipeline.finished(turn, REST, "upstream_error")
        raise upstream_failure(exc, turn) from None
    except ClientGone:
        pipeline.finished(turn, REST, "cancelled")
        raise
    response = _json(
        reply.completion, turn_headers(turn, writeback_state(gw, turn, streamed=False))
    )
    pipeline.finished(turn, REST, "ok")
    return response


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``, cancelling it (and so the upstream request) if the client leaves.

    Starlette does not cancel a plain handler when its client disconnects; a
    turn waiting on a slow upstream would otherwise run to its end for nobody.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body was read in full, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(gw: Gateway, turn: PreparedTurn) -> Response:
    pipeline = gw.pipeline
    chunks = pipeline.stream(turn, writeback=stream_writes_back(gw, turn))
    # Wait for the first chunk before answering, so that an upstream that fails
    # at once is a plain 502 rather than a 200 stream carrying an error.
    try:
        first: dict[str, Any] | None = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except UpstreamError as exc:
        pipeline.finished(turn, REST_STREAM, "upstream_error")
        raise upstream_failure(exc, turn) from None
    except asyncio.CancelledError:
        pipeline.finished(turn, REST_STREAM, "cancelled")
        raise
    # Once the answer has begun (the JSON answer's once it is whole), so that the writeback
    # decision follows the memory service's latest word on storing writebacks.
    headers = turn_headers(turn, writeback_state(gw, turn, streamed=True))

    async def events() -> AsyncIterator[bytes]:
        # A client that leaves mid-stream ends this generator at a yield.
        outcome = "cancelled"
        try:
            if first is not None:
                yield _event(first)
                async for chunk in chunks:
                    yield _event(chunk)
            outcome = "ok"
        except UpstreamError as exc:
            outcome = "upstream_error"
            logger.warning("upstream stream failed: %s", exc)
            yield _event(upstream_failure(exc).openai_body())
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            pipeline.finished(turn, REST_STREAM, outcome)
        yield _DONE

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/v1/models")
async def models(request: Request) -> Response:
    gw = gateway_of(request)
    rest_owner(gw, request)
    try:
        return _json(await gw.router.models())
    except UpstreamError as exc:
        raise upstream_failure(exc) from None


@router.get("/healthz")
async def healthz() -> Response:
    return _json({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    if await gateway_of(request).memory.ready():
        return _json({"status": "ready"})
    return Response(
        orjson.dumps({"status": "not ready", "reason": "memory service unreachable"}),
        status_code=503,
        media_type="application/json",
    )


# Conversations, owned by the REST caller (its API key, or "anonymous" when
# REST is open), so that REST clients can use `conversation_id` too.


@router.post("/v1/conversations")
async def create_conversation(request: Request) -> Response:
    gw = gateway_of(request)
    owner = rest_owner(gw, request)
    raw = await read_body(request)
    title = None
    if raw.strip():
        require_json(request)
        body = parsed_json(raw)
        if not isinstance(body, dict):
            raise bad_input("the request body must be a JSON object")
        title = body.get("title")
        if title is not None and not isinstance(title, str):
            raise bad_input("'title' must be a string or null")
    return _json(conversation_view(await gw.conversations.create(owner, title)))


@router.get("/v1/conversations")
async def list_conversations(request: Request) -> Response:
    gw = gateway_of(request)
    owner = rest_owner(gw, request)
    items = await gw.conversations.list(owner)
    return _json({"object": "list", "data": [conversation_view(c) for c in items]})


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> Response:
    gw = gateway_of(request)
    owner = rest_owner(gw, request)
    query = request.query_params
    limit_text = query.get("limit")
    if limit_text is not None and not (limit_text.isascii() and limit_text.isdigit()):
        raise bad_input(LIMIT_ERROR)
    limit = PAGE_DEFAULT_MESSAGES if limit_text is None else int(limit_text[:8])
    with conversation_errors():
        conversation = await gw.conversations.get(conversation_id, owner)
        return _json(
            await conversation_with_messages(
                gw.conversations, conversation, limit, query.get("before")
            )
        )


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    gw = gateway_of(request)
    owner = rest_owner(gw, request)
    with conversation_errors():
        await gw.conversations.delete(conversation_id, owner)
    return _json({"id": conversation_id, "object": "conversation.deleted", "deleted": True})
