"""Conversations over JSON-RPC and REST: lifecycle and ownership."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.stack import running_stack

pytestmark = pytest.mark.asyncio


async def test_rpc_conversation_lifecycle(tmp_path: Path) -> None:
    async with running_stack(tmp_path) as stack:
        created = (await stack.rpc("conversations.create", {"title": "tea talk"}))["result"]
        assert created["title"] == "tea talk"
        await stack.rpc(
            "chat.send",
            {
                "model": "m",
                "memory": False,
                "conversation_id": created["id"],
                "messages": [{"role": "user", "content": "hello"}],
            },
        )
        got = (await stack.rpc("conversations.get", {"conversation_id": created["id"]}))["result"]
        assert got["messages"] == [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "reply to: hello"},
        ]
        listed = (await stack.rpc("conversations.list"))["result"]["conversations"]
        assert [c["id"] for c in listed] == [created["id"]]

        stack.user = "mallory"
        foreign = await stack.rpc("conversations.get", {"conversation_id": created["id"]})
        assert foreign["error"]["code"] == -32000
        assert foreign["error"]["data"]["code"] == "conversation_forbidden"
        assert (await stack.rpc("conversations.list"))["result"]["conversations"] == []

        stack.user = "alice"
        deleted = await stack.rpc("conversations.delete", {"conversation_id": created["id"]})
        assert deleted["result"] == {"deleted": True}
        gone = await stack.rpc("conversations.get", {"conversation_id": created["id"]})
        assert gone["error"]["data"]["code"] == "conversation_not_found"


async def test_rest_conversations_belong_to_the_api_key(tmp_path: Path) -> None:
    async with running_stack(tmp_path, api_keys=("key-a", "key-b")) as stack:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        created = await stack.http.post("/v1/conversations", json={"title": "x"}, headers=a)
        assert created.status_code == 200
        conversation = created.json()["id"]
        turn = await stack.http.post(
            "/v1/chat/completions",
            headers=a,
            json={
                "model": "m",
                "conversation_id": conversation,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert turn.status_code == 200
        other = await stack.http.post(
            "/v1/chat/completions",
            headers=b,
            json={
                "model": "m",
                "conversation_id": conversation,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert other.status_code == 403
        assert (
            await stack.http.get(f"/v1/conversations/{conversation}", headers=b)
        ).status_code == 403
        listed = (await stack.http.get("/v1/conversations", headers=a)).json()["data"]
        assert [c["id"] for c in listed] == [conversation]
        removed = await stack.http.delete(f"/v1/conversations/{conversation}", headers=a)
        assert removed.json()["deleted"] is True
        missing = await stack.http.get(f"/v1/conversations/{conversation}", headers=a)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "conversation_not_found"
        bad = await stack.http.post("/v1/conversations", json={"title": 5}, headers=a)
        assert bad.status_code == 400
