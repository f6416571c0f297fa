"""``POST /v1/responses``: a Responses turn, JSON or streamed, with memory.

Routed as a chat turn is (the body's ``model``: aliases, fallbacks before any byte), with the
same API keys, budgets, metering and memory headers. Memory is recalled for the user's text
(:func:`~gateway_http.responses.request.user_text`) and its section put ahead of the
client's ``instructions``; the answer reaches the client as the upstream sent it (or as the
translation of a chat-only backend's made it). Once the response has completed, the turn is
written back as a chat turn is: a JSON response whose ``status`` is ``completed``, a stream
once its ``response.completed`` event has come (journaled before that event leaves). A
response that did not complete (``incomplete``, ``failed``, queued in the background, a
stream cut off) writes nothing back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway_http.auth import ANONYMOUS, memory_scope
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.memory_client import DISABLED
from gateway_http.responses.backends import COMPLETED, DATA, RAW, responses_route
from gateway_http.responses.request import holds_section, split_body, user_text, with_section
from gateway_http.responses.translate import chat_messages, output_text
from gateway_http.routes.rest import (
    ClientGone,
    _unless_disconnected,
    read_json_body,
    require_json,
    rest_caller,
    turn_headers,
    turn_outcome,
    upstream_failure,
    writeback_state,
)
from gateway_http.state import Gateway, gateway_of
from gateway_http.turns import PreparedTurn, TurnRequest
from gateway_http.upstream.backend import UpstreamError

logger = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
# The `surface` label of the turn metrics.
RESPONSES = "responses"
RESPONSES_STREAM = "responses_stream"

router = APIRouter()


@router.post(RESPONSES_PATH)
async def create_response(request: Request) -> Response:
    started = time.perf_counter()
    gw = gateway_of(request)
    pipeline = gw.pipeline
    surface = RESPONSES
    try:
        require_json(request)
        principal = rest_caller(gw, request)
        _, body = await read_json_body(request)
        if isinstance(body, dict) and body.get("stream") is True:
            surface = RESPONSES_STREAM
        upstream_body, memory = split_body(body)
        model = upstream_body["model"]
        route = gw.router.route(model)
        if route is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND,
                f"The model '{model}' does not exist or no backend serves it",
                "model_not_found",
            )
        turn = await pipeline.prepare_response(
            TurnRequest(
                principal.id if principal is not None else ANONYMOUS,
                upstream_body,
                memory,
                None,
                memory_scope(principal, upstream_body.get("user")),
                started,
            ),
            responses_route(route, upstream_body),
            user_text(upstream_body),
            recall=not holds_section(upstream_body),
            prompt=chat_messages(upstream_body),
        )
    except GatewayError as exc:
        pipeline.metrics.turn(surface, DISABLED, turn_outcome(exc))
        raise
    sent = with_section(upstream_body, turn.section) if turn.section else upstream_body
    if surface == RESPONSES_STREAM:
        return await _stream(gw, turn, sent)
    try:
        answer = await _unless_disconnected(request, _complete(gw, turn, sent))
    except UpstreamError as exc:
        pipeline.finished(turn, RESPONSES, "upstream_error")
        raise upstream_failure(exc, turn) from None
    except ClientGone:
        pipeline.finished(turn, RESPONSES, "cancelled")
        raise
    response = Response(
        answer[RAW],
        media_type="application/json",
        headers=turn_headers(turn, writeback_state(gw, turn, streamed=False)),
    )
    pipeline.finished(turn, RESPONSES, "ok")
    return response


async def _complete(gw: Gateway, turn: PreparedTurn, body: dict[str, Any]) -> dict[str, Any]:
    """The whole answer; a completed response is written back before it is returned."""
    turn.upstream_start = time.perf_counter()
    answer = await gw.router.complete(turn.route, body, turn.attempts)
    turn.upstream_first = turn.upstream_end = time.perf_counter()
    data = answer[DATA]
    if isinstance(data, dict) and data.get("status") == "completed":
        await gw.pipeline.finish_response(turn, output_text(data))
    return answer


class _Seen:
    """What the client has been sent of a stream: the text, whether it completed, and the
    last event's ``sequence_number`` (an error event the gateway adds comes after it)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.sequence = -1

    def completed(self, event: Any) -> str | None:
        """Note ``event``; the response's output text when it is ``response.completed``."""
        if not isinstance(event, dict):
            return None
        number = event.get("sequence_number")
        if isinstance(number, int):
            self.sequence = max(self.sequence, number)
        kind = event.get("type")
        if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self.parts.append(event["delta"])
        elif kind == COMPLETED:
            response = event.get("response")
            text = output_text(response)
            return text if text or not self.parts else "".join(self.parts)
        return None


async def _stream(gw: Gateway, turn: PreparedTurn, body: dict[str, Any]) -> Response:
    pipeline = gw.pipeline
    turn.upstream_start = time.perf_counter()
    events = gw.router.stream(turn.route, body, turn.attempts)
    # The first event before answering: an upstream that fails at once is a plain error
    # status (its 4xx, or 502), not a 200 stream carrying an error.
    try:
        first: dict[str, Any] | None = await anext(events)
    except StopAsyncIteration:
        first = None
    except UpstreamError as exc:
        pipeline.finished(turn, RESPONSES_STREAM, "upstream_error")
        raise upstream_failure(exc, turn) from None
    except asyncio.CancelledError:
        pipeline.finished(turn, RESPONSES_STREAM, "cancelled")
        raise
    turn.upstream_first = time.perf_counter()
    headers = turn_headers(turn, writeback_state(gw, turn, streamed=False))

    async def sse() -> AsyncIterator[bytes]:
        seen = _Seen()
        outcome = "cancelled"
        try:
            pending = [first] if first is not None else []
            while True:
                event = pending.pop() if pending else await anext(events, None)
                if event is None:
                    break
                text = seen.completed(event[DATA])
                if text is not None:
                    # Journaled before the event that says so leaves.
                    turn.upstream_end = time.perf_counter()
                    await pipeline.finish_response(turn, text)
                yield event[RAW]
            turn.upstream_end = turn.upstream_end or time.perf_counter()
            outcome = "ok"
        except UpstreamError as exc:
            outcome = "upstream_error"
            logger.warning("upstream stream failed: %s", exc)
            yield _error_event(upstream_failure(exc), seen.sequence + 1)
        finally:
            await events.aclose()
            pipeline.finished(turn, RESPONSES_STREAM, outcome)

    return StreamingResponse(
        sse(),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _error_event(error: GatewayError, sequence: int) -> bytes:
    """A failure after the stream began, as the Responses API reports one: an ``error``
    event (what the OpenAI SDK raises from)."""
    body = error.openai_body()["error"]
    event = {
        "type": "error",
        "code": body["code"],
        "message": body["message"],
        "param": None,
        "sequence_number": sequence,
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
