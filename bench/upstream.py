"""A zero-latency OpenAI-compatible upstream for the benchmarks, run as its own process.

It must never be the bottleneck, so it is a bare asyncio protocol (on uvloop when installed)
with the C ``httptools`` parser and fully precomputed responses: ``POST .../chat/completions``
answers a fixed ``chat.completion`` (or, when the body asks for ``"stream": true``, a fixed
event stream of ``chat.completion.chunk`` events ending with ``[DONE]``), ``POST
.../embeddings`` a fixed embedding (:mod:`bench.passthrough`), ``POST .../responses`` a fixed
``response`` object (:mod:`bench.responses`), ``GET .../models`` lists one model. Keep-alive as
in HTTP/1.1. Run with ``python -m bench.upstream``; it prints ``READY <port>`` once listening
and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import re
from typing import cast

import httptools
import orjson

from bench import responses
from bench.loop import main
from bench.passthrough import embeddings_answer

MODEL = "bench-model"
REPLY = "Noted. I will keep that in mind for next time."
_STREAM_FIELD = re.compile(rb'"stream"\s*:\s*true')


def _completion() -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1735689600,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": REPLY},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22},
        }
    )


def _chunk(delta: dict[str, str], finish: str | None) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1735689600,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


def _stream() -> bytes:
    words = REPLY.split(" ")
    chunks = [_chunk({"role": "assistant", "content": ""}, None)]
    chunks += [_chunk({"content": w if i == 0 else " " + w}, None) for i, w in enumerate(words)]
    chunks.append(_chunk({}, "stop"))
    return b"".join(b"data: " + c + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _models() -> bytes:
    return orjson.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
    )


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


JSON_RESPONSE = _response("200 OK", "application/json", _completion())
STREAM_RESPONSE = _response("200 OK", "text/event-stream", _stream())
MODELS_RESPONSE = _response("200 OK", "application/json", _models())
RESPONSES_RESPONSE = _response("200 OK", "application/json", responses.response(MODEL))
EMBEDDINGS_RESPONSE = _response("200 OK", "application/json", embeddings_answer(MODEL))
NOT_FOUND = _response(
    "404 Not Found", "application/json", b'{"error":{"message":"not found","type":"bench"}}'
)


class _Upstream(asyncio.Protocol):
    """One connection: parse requests with httptools, answer each from the precomputed set."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None:
            return
        method = self._parser.get_method()
        path = self._url.split(b"?", 1)[0]
        if method == b"POST" and path.endswith(b"/chat/completions"):
            body = b"".join(self._body)
            transport.write(STREAM_RESPONSE if _STREAM_FIELD.search(body) else JSON_RESPONSE)
        elif method == b"POST" and path.endswith(b"/responses"):
            transport.write(RESPONSES_RESPONSE)
        elif method == b"POST" and path.endswith(b"/embeddings"):
            transport.write(EMBEDDINGS_RESPONSE)
        elif method == b"GET" and path.endswith(b"/models"):
            transport.write(MODELS_RESPONSE)
        else:
            transport.write(NOT_FOUND)
        if not self._parser.should_keep_alive():
            transport.close()


if __name__ == "__main__":
    main(_Upstream, "zero-latency OpenAI-compatible upstream", backlog=4096)
