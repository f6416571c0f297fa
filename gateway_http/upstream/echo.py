"""The built-in ``echo`` model: the development backend used when no upstream is configured.

It is deterministic and needs nothing: it repeats the last user message and shows the memory
section it received, so recall is visible without an LLM. Its usage is counted as the gateway
counts the memory section's share (``cl100k_base``, gateway_http.usage.tokens), so the share
is a part of the prompt it reports, as with an upstream. It also answers embeddings
(:meth:`EchoModel.embeddings`), so an application that embeds through the same base URL runs
in development too.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import re
import struct
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from gateway_http.messages import (
    is_memory_section,
    last_user_text,
    memory_section,
    message_text,
)
from gateway_http.usage import tokens

_ECHO_CREATED = 1735689600  # 2025-01-01T00:00:00Z: a fixed date keeps /v1/models stable
_WORDS = re.compile(r"\s*\S+\s*")
# Embeddings: text-embedding-3-small's size unless `dimensions` asks for another.
EMBEDDING_DIMENSIONS = 1536
MAX_EMBEDDING_DIMENSIONS = 4096
_TERMS = re.compile(r"\w+")


class EchoModel:
    """The built-in development model: deterministic, no dependencies, model id ``echo``.

    Its reply is ``Echo: <last user text>``, followed by a blank line and the memory section
    when a message carries one: a system or developer message, or a message (``user`` too)
    that is exactly one.
    """

    name = "echo"

    def __init__(self) -> None:
        self._tokens = tokens.TokenCounter()

    async def _usage(self, messages: list[Any], content: str) -> dict[str, int]:
        if not tokens.loaded():
            # Once per process, off the event loop (the usage meter has usually loaded it).
            await asyncio.to_thread(self._tokens.load)
        prompt_tokens = self._tokens.prompt(messages)
        completion_tokens = self._tokens.reply(content)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = _messages(body)
        content = _echo_content(messages)
        usage = await self._usage(messages, content)
        return {
            "id": _completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": _model(body),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        messages = _messages(body)
        content = _echo_content(messages)
        base = {
            "id": _completion_id(),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": _model(body),
        }

        def chunk(delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        yield chunk({"role": "assistant", "content": ""})
        # Word-sized pieces so a client can see the answer arrive token by token.
        for piece in _WORDS.findall(content) or ([content] if content else []):
            yield chunk({"content": piece})
        yield chunk({}, "stop")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            yield {**base, "choices": [], "usage": await self._usage(messages, content)}

    def embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        """An ``embeddings`` answer: each input's words hashed into a unit vector, so texts
        that share words are near one another. ``ValueError`` says what is wrong with
        ``input`` or ``dimensions``."""
        inputs = body.get("input")
        if isinstance(inputs, str) or _is_tokens(inputs):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise ValueError("'input' must be a string, or a non-empty list of them")
        size = body.get("dimensions", EMBEDDING_DIMENSIONS)
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not 0 < size <= MAX_EMBEDDING_DIMENSIONS
        ):
            raise ValueError(
                f"'dimensions' must be an integer from 1 to {MAX_EMBEDDING_DIMENSIONS}"
            )
        data = []
        tokens = 0
        for index, text in enumerate(inputs):
            if isinstance(text, str):
                terms = _TERMS.findall(text.lower())
            elif _is_tokens(text):
                terms = [str(token) for token in text]
            else:
                raise ValueError("each 'input' must be a string or a list of token ids")
            tokens += len(terms)
            vector = _hashed(terms, size)
            encoded: Any = vector
            if body.get("encoding_format") == "base64":
                encoded = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        return {
            "object": "list",
            "data": data,
            "model": _model(body),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": "echo", "object": "model", "created": _ECHO_CREATED, "owned_by": "arona"}
            ],
        }

    async def aclose(self) -> None:
        return None


def _is_tokens(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _hashed(terms: list[str], size: int) -> list[float]:
    """The unit vector of ``terms`` hashed into ``size`` signed buckets (all buckets alike for
    no term at all, so that no vector is zero)."""
    vector = [0.0] * size
    for term in terms:
        digest = int.from_bytes(hashlib.blake2b(term.encode(), digest_size=8).digest(), "big")
        vector[digest % size] += 1.0 if digest >> 63 else -1.0
    norm = math.sqrt(sum(x * x for x in vector))
    if norm == 0:
        return [1 / math.sqrt(size)] * size
    return [x / norm for x in vector]


def _messages(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else "echo"


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _echo_content(messages: list[Any]) -> str:
    content = f"Echo: {last_user_text(messages)}"
    for message in messages:
        if not isinstance(message, dict):
            continue
        # The section in whatever role a backend has it sent in: inside a system or developer
        # prompt, or a message that is exactly one (a user quoting the header is not).
        if message.get("role") in ("system", "developer") or is_memory_section(message):
            section = memory_section(message_text(message))
            if section:
                # The header and the first line of each memory. A memory's
                # continuation lines are left out: they may hold an earlier
                # echoed section, and since the reply is written back as an
                # episode, echoing them would nest sections without end.
                shown = [ln for ln in section.split("\n") if not ln.startswith("  ")]
                return f"{content}\n\n" + "\n".join(shown)
    return content
