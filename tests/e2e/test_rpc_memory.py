"""``memory.status`` and ``memory.delete`` over JSON-RPC, through the gRPC service."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from arona_grpc.scopes import scope_id
from tests.e2e.stack import ASK_TEXT, PHILIA_TOKEN, running_stack
from tests.support.fake_philia import DELETE, STORE, Step

pytestmark = pytest.mark.asyncio

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


async def test_status_reports_events_newest_first(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        stack.philia.memories = [{"node_type": "episode", "text": "oolong", "score": 0.5}]
        await stack.turn("rest", [{"role": "user", "content": ASK_TEXT}])
        # Listing the turns of no principal waits for this process's writebacks of them.
        listed = (await stack.rpc("memory.list", {"anonymous": True}))["result"]["memories"]
        assert [m["node_id"] for m in listed] == ["n-1"]
        before = (await stack.rpc("memory.status"))["result"]["events"]
        assert [(e["kind"], e["detail"]) for e in before] == [
            ("writeback", "n-1"),
            ("recall", ASK_TEXT),
        ]
        await stack.rpc("memory.delete", {"node_id": "n-1"})
        reply = await stack.rpc("memory.status")
        result = reply["result"]
        assert result["enabled"] is True and result["writeback"] is True
        events = result["events"]
        # The deleted episode's question went with it (forget means gone): its turn's recall
        # event is no longer shown.
        assert [(e["kind"], e["detail"]) for e in events] == [
            ("delete", "n-1"),
            ("writeback", "n-1"),
        ]
        assert all(RFC3339_MS.match(e["at"]) for e in events)
        # The anonymous REST turn concerns no scope: its events are {kind, detail, at}, as the
        # docs show them; the JWT holder's delete names the caller's scope id.
        assert [sorted(e) for e in events[1:]] == [["at", "detail", "kind"]]
        assert events[0]["scope_id"] == scope_id(stack.user)
        assert PHILIA_TOKEN not in str(reply)


async def test_status_when_not_configured(tmp_path: Path) -> None:
    async with running_stack(tmp_path, memory=False) as stack:
        result = (await stack.rpc("memory.status"))["result"]
        assert (result["enabled"], result["events"]) == (False, [])


async def test_delete_answers_whether_the_node_existed(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        await stack.turn("rest", [{"role": "user", "content": "remember me"}])
        await stack.philia.wait_frames(STORE)
        assert (await stack.rpc("memory.delete", {"node_id": "n-1"}))["result"] == {"deleted": True}
        assert (await stack.rpc("memory.delete", {"node_id": "n-404"}))["result"] == {
            "deleted": False
        }
        assert [f["params"]["node_id"] for f in stack.philia.frames_of(DELETE)] == ["n-1", "n-404"]


@pytest.mark.parametrize("params", [{}, {"node_id": ""}, {"node_id": 5}, None])
async def test_delete_without_a_node_id_is_invalid_params(
    tmp_path: Path, params: dict[str, object] | None
) -> None:
    async with running_stack(tmp_path) as stack:
        reply = await stack.rpc("memory.delete", params)
        assert reply["error"]["code"] == -32602
        assert stack.philia.frames_of(DELETE) == []


async def test_delete_when_not_configured_is_an_application_error(tmp_path: Path) -> None:
    async with running_stack(tmp_path, memory=False) as stack:
        reply = await stack.rpc("memory.delete", {"node_id": "n-1"})
        assert reply["error"]["code"] == -32000
        assert stack.philia.upgrades == []


@pytest.mark.parametrize("fault", ["refused", "error", "timeout"])
async def test_delete_philia_failure_is_an_application_error(tmp_path: Path, fault: str) -> None:
    async with running_stack(tmp_path, timeout_s=0.3) as stack:
        if fault == "refused":
            await stack.philia.stop()
        elif fault == "error":
            stack.philia.script(DELETE, Step(error=(-32603, "boom")))
        else:
            stack.philia.script(DELETE, Step(action="hang"))
        reply = await stack.rpc("memory.delete", {"node_id": "n-1"})
        assert reply["error"]["code"] == -32000
        assert PHILIA_TOKEN not in str(reply)


async def test_rpc_requires_a_valid_jwt(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        response = await stack.http.post(
            "/api/rpc", json={"jsonrpc": "2.0", "id": 3, "method": "memory.status"}
        )
        assert response.json()["error"]["code"] == -32005
        assert response.json()["id"] == 3
