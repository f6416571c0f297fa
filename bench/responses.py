"""Row 3a of ``make bench``: a Responses turn with memory (``POST /v1/responses``) against a
chat memory turn (row 3), on the same gateway and store.

The load generator sends ``{"model", "input"}`` to ``/v1/responses`` (:func:`request_body`;
``--body responses``, :func:`loadgen_args`); the bench upstream answers with a fixed
``response`` object (:func:`response`), as it answers chat with a fixed completion, so the two
rows differ only in what the gateway does for each API. The target: the Responses turn's added
p50 at c=1 at most :data:`WITHIN` × the chat memory turn's.
"""

from __future__ import annotations

from typing import Any

import orjson

PATH = "/v1/responses"
KEY = "mem_responses"
LABEL = "3a. gateway, memory enabled, a Responses turn (POST /v1/responses)"
WITHIN = 1.10
TARGET = f"a Responses turn with memory (3a): added p50 ≤ {WITHIN:.2f} × a chat memory turn's (3)"
_REPLY = "Noted. I will keep that in mind for next time."


def loadgen_args(key: str) -> list[str]:
    """What the load generator is told for row ``key`` (nothing for the other rows)."""
    return ["--path", PATH, "--body", "responses"] if key == KEY else []


def request_body(model: str, query: str) -> dict[str, Any]:
    """One turn's Responses body."""
    return {"model": model, "input": query}


def response(model: str) -> bytes:
    """The fixed ``response`` object the bench upstream answers every Responses turn with."""
    return orjson.dumps(
        {
            "id": "resp_bench",
            "object": "response",
            "created_at": 1735689600,
            "status": "completed",
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "model": model,
            "output": [
                {
                    "id": "msg_bench",
                    "type": "message",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": _REPLY, "annotations": []}],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 12,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 10,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 22,
            },
        }
    )
