"""The recording upstream's ``POST /v1/responses``: the OpenAI Responses API, scripted.

:class:`FakeResponses` answers a Responses request with a ``response`` object (JSON) or its
event stream (``response.created`` … ``response.output_text.delta`` … ``response.completed``),
as OpenAI does. Without a script the output text is ``reply to: <the user's last text>``;
``script(...)`` queues replies consumed one per request: :class:`Respond` (a whole response,
optionally not ``completed``), :class:`RespondStream` (a stream that completes, fails with
``response.failed``, or breaks off) and :class:`RespondFail` (an HTTP error with its body).

Like OpenAI it keeps each response (the input items and the output, never the
``instructions``) and resolves ``previous_response_id``: :attr:`FakeResponses.contexts` holds,
per request, everything the model was given (the request's instructions, then the chain's
items, then the new input), so a test can see what a chain of responses carries. Every body
sent is kept byte for byte in :attr:`FakeResponses.sent`, so a test can compare what its client
received with what the upstream sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]

RESPONSES_PATH = "/v1/responses"


@dataclass
class Respond:
    text: str | None = None  # None: "reply to: <the user's last text>"
    status: str = "completed"


@dataclass
class RespondStream:
    pieces: Sequence[str] | None = None  # None: the default text, word by word
    end: Literal["completed", "failed", "break", "hold"] = "completed"
    # "hold": after the deltas, wait for the client to go away, then set `closed`.
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class RespondFail:
    status: int = 400
    body: bytes = (
        b'{"error": {"message": "bad previous_response_id", "type": "invalid_request_error"}}'
    )


ResponsesReply = Respond | RespondStream | RespondFail


def input_items(given: Any) -> list[dict[str, Any]]:
    """A request's ``input`` as items (a string is one user message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return [item for item in given or () if isinstance(item, dict)]


def item_text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "\n".join(
        part["text"]
        for part in content or ()
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    )


def last_user_input(body: Any) -> str:
    for item in reversed(input_items(body.get("input") if isinstance(body, dict) else None)):
        if item.get("role") == "user":
            return item_text(item)
    return ""


@dataclass
class FakeResponses:
    """What the fake upstream does with ``POST /v1/responses``."""

    # Response id -> the items of its chain (inputs and outputs, no instructions).
    stored: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Per request: the text the model was given, instructions first.
    contexts: list[str] = field(default_factory=list)
    # Per request: the bytes of the answer's body.
    sent: list[bytes] = field(default_factory=list)
    _script: deque[ResponsesReply] = field(default_factory=deque)

    def script(self, *replies: ResponsesReply) -> None:
        self._script.extend(replies)

    async def answer(self, body: Any, receive: Receive, send: Send) -> None:
        if not isinstance(body, dict):
            await self._send(send, 400, b'{"error": {"message": "not an object"}}', "json")
            return
        reply = self._script.popleft() if self._script else None
        if isinstance(reply, RespondFail):
            await self._send(send, reply.status, reply.body, "json")
            return
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            await self._send(send, 400, RespondFail().body, "json")
            return
        chain = [*self.stored.get(previous, []), *input_items(body.get("input"))]
        instructions = body.get("instructions")
        self.contexts.append("\n".join([instructions or "", *(item_text(item) for item in chain)]))
        text = f"reply to: {last_user_input(body)}"
        if isinstance(reply, Respond) and reply.text is not None:
            text = reply.text
        pieces = _words(text)
        if isinstance(reply, RespondStream) and reply.pieces is not None:
            pieces = list(reply.pieces)
            text = "".join(pieces)
        response_id = f"resp_{uuid.uuid4().hex}"
        item = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        self.stored[response_id] = [*chain, item]
        status = reply.status if isinstance(reply, Respond) else "completed"
        whole = _response(body, response_id, status, [item], text)
        if body.get("stream") is not True:
            await self._send(send, 200, orjson.dumps(whole), "json")
            return
        stream = reply if isinstance(reply, RespondStream) else RespondStream()
        await self._stream(send, receive, body, whole, item, pieces, stream)

    async def _stream(
        self,
        send: Send,
        receive: Receive,
        body: dict[str, Any],
        whole: dict[str, Any],
        item: dict[str, Any],
        pieces: list[str],
        reply: RespondStream,
    ) -> None:
        sent = bytearray()
        number = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal number
            data = {"type": kind, "sequence_number": number, **fields}
            number += 1
            # OpenAI's framing: the event's type, then its data, then a blank line.
            chunk = f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"
            sent.extend(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        started = {**whole, "status": "in_progress", "output": [], "usage": None}
        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        await event("response.created", response=started)
        await event("response.in_progress", response=started)
        await event(
            "response.output_item.added",
            output_index=0,
            item={**item, "status": "in_progress", "content": []},
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        await event("response.content_part.added", **where, part=part)
        for piece in pieces:
            await event("response.output_text.delta", **where, delta=piece, logprobs=[])
        end = reply.end
        if end == "hold":
            while (await receive())["type"] != "http.disconnect":
                pass
            reply.closed.set()
            return
        if end == "break":
            # Returning without the last body message makes uvicorn drop the connection.
            self.sent.append(bytes(sent))
            return
        text = "".join(pieces)
        await event("response.output_text.done", **where, text=text, logprobs=[])
        await event("response.content_part.done", **where, part=item["content"][0])
        await event("response.output_item.done", output_index=0, item=item)
        if end == "failed":
            failed = {
                **whole,
                "status": "failed",
                "error": {"code": "server_error", "message": "x"},
            }
            await event("response.failed", response=failed)
        else:
            await event("response.completed", response=whole)
        self.sent.append(bytes(sent))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send: Send, status: int, data: bytes, kind: str) -> None:
        self.sent.append(data)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [word + " " for word in words[:-1]] + [words[-1]]


def _response(
    body: dict[str, Any], response_id: str, status: str, output: list[Any], text: str
) -> dict[str, Any]:
    """A ``response`` object as OpenAI returns it, the request's settings echoed."""
    input_tokens = len(last_user_input(body).split())
    output_tokens = len(text.split())
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": None if status == "completed" else {"reason": "max_output_tokens"},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
