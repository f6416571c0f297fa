"""The built-in ``echo`` model: the development backend used when no upstream is configured.

It is deterministic and needs nothing: it repeats the last user message and shows the memory
section it received, so recall is visible without an LLM. Its usage is counted as the gateway
counts the memory section's share (``cl100k_base``, gateway_http.usage.tokens), so the share
is a part of the prompt it reports, as with an upstream.
"""

from __future__ import annotations

import asyncio
import re
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

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": "echo", "object": "model", "created": _ECHO_CREATED, "owned_by": "arona"}
            ],
        }

    async def aclose(self) -> None:
        return None


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
