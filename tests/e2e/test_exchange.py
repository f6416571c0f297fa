"""The HTTP layer's recall and writeback on ``Exchange`` streams, end to end.

The same turns over the stream (the default) and over unary calls
(``ARONA_GRPC_STREAMS=0``) give the same answers; the stream carries the request id
of each turn, and a service with writeback off is not asked to write back at all (nor one
with memory off to recall).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from arona_grpc.logs import REQUEST_ID
from tests.e2e.stack import running_stack

pytestmark = pytest.mark.asyncio

ASK = [{"role": "user", "content": "what tea do I like?"}]
OOLONG = {"text": "I prefer oolong tea", "score": 0.83, "node_type": "entity"}


def _writebacks(metrics_text: str) -> dict[str, float]:
    """``arona_writebacks_total`` by outcome, from a /metrics page."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("arona_writebacks_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize("streams", [2, 0], ids=["stream", "unary"])
async def test_a_memory_turn_is_the_same_over_the_stream_and_unary_calls(
    tmp_path: Path, streams: int
) -> None:
    async with running_stack(tmp_path, http_overrides={"grpc_streams": streams}) as stack:
        stack.philia.memories = [dict(OOLONG)]
        for surface in ("rest", "sse", "rpc"):
            conversation = await stack.create_conversation(surface)
            turn = await stack.turn(surface, ASK, conversation_id=conversation)
            assert turn.status == 200
            assert turn.memory == "enabled"
        system = stack.upstream.last_body["messages"][0]
        assert "oolong" in system["content"]
        # Each turn written back once.
        await stack.philia.wait_stored(3)
        await stack.drain_writebacks()
        assert len(stack.philia.stored) == 3


@pytest.mark.parametrize("streams", [2, 0], ids=["stream", "unary"])
async def test_writeback_off_is_not_even_asked_for_over_the_stream(
    tmp_path: Path, streams: int
) -> None:
    async with running_stack(
        tmp_path, memory_writeback=False, http_overrides={"grpc_streams": streams}
    ) as stack:
        stack.philia.memories = [dict(OOLONG)]
        for _ in range(3):
            assert (await stack.turn("rest", ASK)).memory == "enabled"
        await stack.drain_writebacks()
        asked = _writebacks((await stack.http.get("/metrics")).text)
        assert not stack.philia.stored
        if streams:
            # The stream's hello said writeback is off: no Writeback call was made.
            assert asked.get("not_stored", 0) == 0
        else:
            # Unary calls cannot know: each turn asks, and the service stores nothing.
            assert asked.get("not_stored") == 3


@pytest.mark.parametrize("streams", [2, 0], ids=["stream", "unary"])
async def test_memory_off_is_not_even_asked_to_recall_over_the_stream(
    tmp_path: Path, streams: int
) -> None:
    handler = _ServiceLog()
    async with running_stack(
        tmp_path, memory=False, http_overrides={"grpc_streams": streams}
    ) as stack:
        with handler.watching("arona_grpc.servicer"):
            for surface in ("rest", "sse", "rpc"):
                turn = await stack.turn(surface, ASK)
                assert turn.status == 200
                assert turn.memory == "disabled"
        # The turns went upstream as the client sent them.
        assert stack.upstream.last_body["messages"] == ASK
    recalls = [message for message, _ in handler.seen if message.startswith("Recall:")]
    if streams:
        # The stream's hello said memory is off: no Recall call was made.
        assert recalls == []
    else:
        # Unary calls cannot know: each turn asks, and the service answers `disabled`.
        assert recalls == ["Recall: disabled, 0 memories"] * 3


@pytest.mark.parametrize("streams", [2, 0], ids=["stream", "unary"])
async def test_status_names_the_replica_and_its_streams(tmp_path: Path, streams: int) -> None:
    async with running_stack(tmp_path, http_overrides={"grpc_streams": streams}) as stack:
        stack.philia.memories = [dict(OOLONG)]
        assert (await stack.turn("rest", ASK)).memory == "enabled"
        address = stack.settings.grpc_target
        # The turn opened every stream; the last may still be opening (bounded).
        for _ in range(50):
            result = (await stack.rpc("memory.status"))["result"]
            if result["replicas"][0]["streams_open"] == streams:
                break
        assert result["replicas"] == [
            {"address": address, "name": None, "streams": streams, "streams_open": streams}
        ]
        assert result["answered_by"] == address


class _ServiceLog(logging.Handler):
    """What a logger wrote while watched, each record with the request id it was written
    under."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), REQUEST_ID.get()))

    @contextlib.contextmanager
    def watching(self, name: str) -> Iterator[None]:
        logger = logging.getLogger(name)
        level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


async def test_each_call_on_the_stream_carries_its_turns_request_id(tmp_path: Path) -> None:
    handler = _ServiceLog()
    with handler.watching("arona_grpc.servicer"):
        async with running_stack(tmp_path) as stack:
            stack.philia.memories = [dict(OOLONG)]
            for n in range(3):
                response = await stack.http.post(
                    "/v1/chat/completions",
                    json={"model": "fake-model", "messages": ASK},
                    headers={"X-Request-Id": f"turn-{n}"},
                )
                assert response.headers["X-Request-Id"] == f"turn-{n}"
            await stack.drain_writebacks()
    recalls = [rid for message, rid in handler.seen if message.startswith("Recall:")]
    writebacks = [rid for message, rid in handler.seen if message.startswith("Writeback:")]
    assert recalls == ["turn-0", "turn-1", "turn-2"]
    assert sorted(w or "" for w in writebacks) == ["turn-0", "turn-1", "turn-2"]
