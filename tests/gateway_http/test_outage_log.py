"""With the gRPC service down (a split deployment), every turn's Recall and Writeback call
fails: the turns answer ``offline`` and the HTTP layer logs two warnings, not two per turn."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.e2e.stack import running_stack
from tests.support.log_watch import watching
from tests.support.raw_philia import closed_port


@pytest.mark.asyncio
async def test_turns_with_the_grpc_service_down_log_two_warnings_not_two_per_turn(
    tmp_path: Path,
) -> None:
    turns = 12
    async with running_stack(tmp_path, grpc_target=f"127.0.0.1:{closed_port()}") as stack:
        with watching("gateway_http") as seen:
            for i in range(turns):
                turn = await stack.turn("rest", [{"role": "user", "content": f"turn {i}"}])
                assert (turn.status, turn.memory) == (200, "offline")
            # Every turn's writeback has failed and been seen by the log (at some level).
            await seen.wait_for(lambda _: len(seen.matching("writeback failed")) == turns)
    assert len(seen.matching("memory recall failed")) == turns
    warnings = seen.at_least(logging.WARNING)
    assert [r.getMessage().split(" (")[0] for r in warnings] == [
        "memory recall failed",
        "writeback failed",
    ]
    # The one warning says why: the gRPC status, not a stack trace.
    assert all("UNAVAILABLE" in r.getMessage() and r.exc_info is None for r in warnings)
