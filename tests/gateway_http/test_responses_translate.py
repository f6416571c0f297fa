"""The translation of a Responses text turn to chat completions and back, held to the shapes of
openai-python's ``types/responses`` (validated strictly, as pydantic models, so a missing or
mistyped field fails here before a client's parser trips on it), and the ``api`` setting of
the backends file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway_http.responses.request import holds_section, split_section, user_text, with_section
from gateway_http.responses.translate import (
    StreamTranslation,
    chat_body,
    response_of,
    untranslatable,
)
from gateway_http.upstream.backends_file import BackendsFileError, load_backends

SECTION = "## Relevant Long-Term Memories\n- [0.83] I prefer oolong tea\n  and green tea"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "local-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }


def test_a_text_turn_becomes_chat_messages_the_section_a_system_message_of_its_own() -> None:
    body = with_section(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "No emojis."},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "hello", "annotations": []}],
                },
                {"role": "user", "content": "what tea?"},
            ],
            "max_output_tokens": 50,
            "store": True,
            "metadata": {"a": "b"},
        },
        SECTION,
    )
    assert untranslatable(body) is None
    assert split_section(body["instructions"]) == (SECTION, "Be brief.")
    assert chat_body(body, stream=False) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": SECTION},
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "No emojis."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "what tea?"},
        ],
        "max_tokens": 50,
    }
    assert user_text(body) == "what tea?"
    assert holds_section(body) and not holds_section({"instructions": "## Relevant Long-Term"})


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"reasoning": {"effort": "low"}}, "'reasoning'"),
        ({"text": {"format": {"type": "json_object"}}}, "'text'"),
        ({"conversation": "conv_1"}, "'conversation'"),
        ({"tool_choice": "required"}, "'tool_choice'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0] (a message of role 'tool')"),
    ],
)
def test_what_chat_cannot_carry_is_named(extra: dict[str, Any], named: str) -> None:
    problem = untranslatable({"model": "m", "input": "hi", **extra})
    assert problem is not None and problem.startswith(named)


def test_a_completion_becomes_a_response_the_sdk_parses() -> None:
    body = {"model": "m", "input": "hi", "instructions": "Be brief."}
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "local-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hey"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    response = Response.model_validate(response_of(body, completion), strict=True)
    assert (response.status, response.output_text, response.model) == (
        "completed",
        "hey",
        "local-model",
    )
    assert response.instructions == "Be brief."
    assert response.usage is not None and response.usage.total_tokens == 4


def test_a_chat_stream_becomes_the_events_the_sdk_parses() -> None:
    translation = StreamTranslation({"model": "m", "input": "hi"})
    events = [
        *translation.chunk(chunk("", role="assistant")),
        *translation.chunk(chunk("Hel")),
        *translation.chunk(chunk("lo")),
        *translation.chunk(chunk(None, "stop")),
        *translation.chunk({**chunk(), "choices": [], "usage": {"prompt_tokens": 1}}),
        *translation.end(),
    ]
    parsed = [EVENTS.validate_python(event, strict=True) for event in events]
    assert [e.type for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    completed = parsed[-1].response
    assert (completed.output_text, completed.status) == ("Hello", "completed")
    assert completed.usage is not None and completed.usage.input_tokens == 1
    # One response, one message, all along.
    assert {e.response.id for e in parsed if hasattr(e, "response")} == {completed.id}


def test_a_chat_stream_cut_by_its_length_is_an_incomplete_response() -> None:
    translation = StreamTranslation({"model": "m", "input": "hi", "max_output_tokens": 1})
    events = [*translation.chunk(chunk("Hel", "length")), *translation.end()]
    last = EVENTS.validate_python(events[-1], strict=True)
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in last.response.output] == ["incomplete"]
    assert last.response.output_text == "Hel"


def test_the_backends_file_says_which_api_a_backend_serves(tmp_path: Path) -> None:
    path = tmp_path / "backends.toml"
    path.write_text(
        '[backends.a]\nbase_url = "http://127.0.0.1:1/v1"\nmodels = ["x"]\n'
        '[backends.b]\nbase_url = "http://127.0.0.1:2/v1"\nmodels = ["y"]\napi = "chat"\n'
    )
    assert [spec.api for spec in load_backends(path, {}).backends] == ["responses", "chat"]
    path.write_text('[backends.a]\nbase_url = "http://127.0.0.1:1/v1"\nmodels = ["x"]\napi = 1\n')
    with pytest.raises(BackendsFileError) as refused:
        load_backends(path, {})
    assert refused.value.lines[0].startswith(f"{path}: backends.a.api: Input should be")
