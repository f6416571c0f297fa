"""A Responses turn traced as a chat turn is: one trace from its server span through the
recall, the upstream attempt and the writeback, the turn described on its span (the surface
``responses``, what memory did, who answered), the client's ``traceparent`` continued."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_tracing import (
    CLIENT_SPAN,
    CLIENT_TRACE,
    FACT,
    QUESTION,
    RECALL_TREE,
    TRACEPARENT,
    WRITEBACK_TREE,
    memory_stack,
    with_kind,
)
from tests.support.otlp_receiver import OtlpReceiver, exported, named, traced_here

pytestmark = pytest.mark.asyncio

SPAN = "POST /v1/responses"


async def test_a_responses_turn_is_one_trace_continuing_its_callers(tmp_path: Path) -> None:
    async with OtlpReceiver() as receiver:
        async with traced_here(receiver), memory_stack(tmp_path) as stack:
            told = await stack.http.post(
                "/v1/responses", json={"model": "fake-model", "input": FACT}
            )
            assert told.status_code == 200
            await stack.drain_writebacks()
            body = {"model": "fake-model", "input": QUESTION, "stream": True}
            headers = {"traceparent": TRACEPARENT}
            async with stack.http.stream(
                "POST", "/v1/responses", json=body, headers=headers
            ) as asked:
                await asked.aread()
            assert asked.headers["X-Arona-Memory"] == "enabled"
            await stack.drain_writebacks()
            await exported()
        first, second = named(receiver.spans, SPAN)
    assert (second.trace_id, second.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert receiver.tree(second.trace_id, show=with_kind) == "\n".join(
        [f"{SPAN} [server]", RECALL_TREE, "  chat fake-model [client]", WRITEBACK_TREE]
    )
    described = second.attributes
    assert (described["http.route"], described["arona.surface"]) == (SPAN[5:], "responses_stream")
    assert (described["arona.memory"], described["arona.backend"]) == ("enabled", "upstream")
    assert first.attributes["arona.surface"] == "responses"
