"""A Responses text turn for a backend that serves chat completions only, and back.

:func:`untranslatable` says why a request cannot be asked of such a backend (a tool, an
image, a chained ``previous_response_id``, a field chat completions have no equivalent for);
:func:`chat_body` is the chat request of one that can: ``instructions`` as the first system
message, each message item as a chat message. The answer comes back in the shapes of
openai-python's ``types/responses``: :func:`response_of` makes a ``response`` object of a
``chat.completion``, and :class:`StreamTranslation` the events of a streamed response
(``response.created`` … ``response.output_text.delta`` … ``response.completed``) of the
``chat.completion.chunk`` objects, in the order the OpenAI SDK's stream parser expects.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from gateway_http.responses.request import is_message, item_text, split_section

# Translated into the chat request.
_TRANSLATED = frozenset(
    (
        "model",
        "input",
        "instructions",
        "stream",
        "temperature",
        "top_p",
        "max_output_tokens",
        "user",
    )
)
# Meaningless for a backend that keeps nothing and calls no tool: accepted, not sent.
_IGNORED = frozenset(
    (
        "store",
        "metadata",
        "truncation",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "parallel_tool_calls",
        "stream_options",
        "top_logprobs",
    )
)
# Accepted when they ask for nothing beyond plain text: their value when it does.
_PLAIN: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v == [],
    "include": lambda v: v == [],
    "tool_choice": lambda v: v in ("auto", "none"),
    "background": lambda v: v is False,
    "text": lambda v: isinstance(v, dict) and v.get("format", {"type": "text"}) == {"type": "text"},
}
_CHAT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text"}
# The chat finish reasons that end a response early, and why (incomplete_details.reason).
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def untranslatable(body: dict[str, Any]) -> str | None:
    """What of ``body`` chat completions cannot carry (None: it is a text turn they can)."""
    for key, value in body.items():
        if value is None or key in _TRANSLATED or key in _IGNORED:
            continue
        allowed = _PLAIN.get(key)
        if allowed is None or not allowed(value):
            return f"'{key}'"
    given = body.get("input")
    for index, item in enumerate(given if isinstance(given, list) else ()):
        if not is_message(item):
            kind = item.get("type") if isinstance(item, dict) else None
            return f"input[{index}] (an item of type {kind!r})" if kind else f"input[{index}]"
        role = item["role"]
        if role not in _CHAT_ROLES:
            return f"input[{index}] (a message of role {role!r})"
        content = item.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            return f"input[{index}].content"
        wanted = _TEXT_PARTS.get(role, "output_text")
        for number, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != wanted or not isinstance(part.get("text"), str):
                return f"input[{index}].content[{number}] (a part of type {kind!r})"
    return None


def chat_messages(body: dict[str, Any], section_role: str = "system") -> list[dict[str, Any]]:
    """The request as chat messages: ``instructions`` first (the memory section they start
    with a message of its own, as a chat turn's, in ``section_role``: the backend's
    ``memory_role``), then the text of each message item (what the meter counts when a
    backend reports no usage, too)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        section, own = split_section(instructions)
        if section:
            messages.append({"role": section_role, "content": section})
        if own:
            messages.append({"role": "system", "content": own})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if is_message(item):
                role = _CHAT_ROLES.get(item["role"], item["role"])
                messages.append({"role": role, "content": item_text(item)})
    return messages


def chat_body(
    body: dict[str, Any], *, stream: bool, section_role: str = "system"
) -> dict[str, Any]:
    """The chat request of a translatable ``body`` (:func:`untranslatable` said None)."""
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": chat_messages(body, section_role),
    }
    for key in ("temperature", "top_p", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if stream:
        chat["stream"] = True
        # So that response.completed reports it.
        chat["stream_options"] = {"include_usage": True}
    return chat


def response_usage(usage: Any) -> dict[str, Any] | None:
    """A chat ``usage`` object as a Responses one (None for none)."""
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": _count(usage.get("total_tokens")) or prompt + completion,
    }


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses ``usage`` object as a chat one, as the meter reads it (None for none)."""
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("input_tokens"))
    completion = _count(usage.get("output_tokens"))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": _count(usage.get("total_tokens")) or prompt + completion,
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def output_text(response: Any) -> str:
    """The text of a ``response`` object's output messages, as the SDK's ``output_text``."""
    if not isinstance(response, dict):
        return ""
    output = response.get("output")
    parts: list[str] = []
    for item in output if isinstance(output, list) else ():
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, list) or item.get("type") != "message":
            continue
        parts.extend(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "output_text"
            and isinstance(part.get("text"), str)
        )
    return "".join(parts)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _shell(body: dict[str, Any], response_id: str, model: str) -> dict[str, Any]:
    """A ``response`` object in progress, its settings those of the request."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _ended(
    response: dict[str, Any],
    finish_reason: Any,
    usage: Any,
    item_id: str,
    content: list[dict[str, Any]],
) -> dict[str, Any]:
    """``response`` ended: its status from the chat finish reason (its message's too), its
    output and usage."""
    incomplete = _INCOMPLETE.get(finish_reason) if isinstance(finish_reason, str) else None
    status = "incomplete" if incomplete else "completed"
    return {
        **response,
        "status": status,
        "completed_at": None if incomplete else int(time.time()),
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "output": [_message(item_id, status, content)],
        "usage": response_usage(usage),
    }


def response_of(body: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """The ``response`` object of a ``chat.completion`` answering ``body``."""
    choices = completion.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    message = message if isinstance(message, dict) else {}
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str):
        content.append(_text_part(text))
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        content.append({"type": "refusal", "refusal": refusal})
    if not content:
        content.append(_text_part(""))
    model = completion.get("model")
    shell = _shell(body, _new_id("resp"), model if isinstance(model, str) else body["model"])
    finish_reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    return _ended(shell, finish_reason, completion.get("usage"), _new_id("msg"), content)


class StreamTranslation:
    """The Responses stream events of one chat stream, made chunk by chunk.

    :meth:`chunk` turns each ``chat.completion.chunk`` into the events it stands for (the
    opening ones come with the first chunk, so that nothing is said before the backend has
    answered); :meth:`end` gives the closing ones once the chat stream has ended.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = body
        self._response: dict[str, Any] | None = None
        self._item_id = _new_id("msg")
        self._parts: list[str] = []
        self._sequence = 0
        self._finish_reason: Any = None
        self._usage: Any = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _opening(self, model: Any) -> list[dict[str, Any]]:
        chosen = model if isinstance(model, str) and model else self._body["model"]
        response = self._response = _shell(self._body, _new_id("resp"), chosen)
        where = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
            self._event(
                "response.output_item.added",
                output_index=0,
                item=_message(self._item_id, "in_progress", []),
            ),
            self._event("response.content_part.added", **where, part=_text_part("")),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._opening(chunk.get("model")) if self._response is None else []
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return events
        if choice.get("finish_reason"):
            self._finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(text, str) and text:
            self._parts.append(text)
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._item_id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return events

    def end(self) -> list[dict[str, Any]]:
        events = self._opening(None) if self._response is None else []
        assert self._response is not None
        text = "".join(self._parts)
        part = _text_part(text)
        where = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        ended = _ended(self._response, self._finish_reason, self._usage, self._item_id, [part])
        item = ended["output"][0]
        closing = "response.completed" if ended["status"] == "completed" else "response.incomplete"
        events += [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(closing, response=ended),
        ]
        return events
