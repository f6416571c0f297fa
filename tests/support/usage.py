"""Usage records as the meter would store them, for tests that read usage back."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from gateway_http.usage.records import UsageRecord, micros


def usage_record(
    principal: str = "alice",
    prompt: int = 100,
    completion: int = 20,
    *,
    at: datetime | None = None,
    **fields: Any,
) -> UsageRecord:
    """One turn of ``principal`` that spent ``prompt`` + ``completion`` tokens ``at`` (now by
    default); ``fields`` set the others (model, backend, user, memory_tokens, cost_micro, …)."""
    values: dict[str, Any] = {
        "turn_id": uuid.uuid4().hex,
        "at_us": micros(at or datetime.now(UTC)),
        "principal": principal,
        "user": "",
        "model": "gpt-4o",
        "backend": "openai",
        "surface": "rest",
        "outcome": "ok",
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "memory_tokens": 30,
        "estimated": False,
        "latency_ms": 12.5,
        "cost_micro": None,
        **fields,
    }
    return UsageRecord(**values)
