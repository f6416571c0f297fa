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


async def test_a_long_conversation_is_read_a_page_at_a_time(tmp_path: Path) -> None:
    """No answer grows with the conversation: the most recent messages, then older pages by
    the cursor, on REST and JSON-RPC alike; a bad limit or cursor is the client's mistake."""
    texts = []
    for i in range(3):
        texts += [f"turn {i}", f"reply to: turn {i}"]
    async with running_stack(tmp_path) as stack:
        # REST: a conversation of the REST caller, its turns on REST.
        conversation = (await stack.http.post("/v1/conversations", json={})).json()["id"]
        for i in range(3):
            turn = await stack.http.post(
                "/v1/chat/completions",
                json={
                    "model": "m",
                    "conversation_id": conversation,
                    "messages": [{"role": "user", "content": f"turn {i}"}],
                },
            )
            assert turn.status_code == 200
        url = f"/v1/conversations/{conversation}"
        whole = (await stack.http.get(url)).json()
        assert [m["content"] for m in whole["messages"]] == texts
        assert whole["has_more"] is False and whole["first_id"] is None
        recent = (await stack.http.get(url, params={"limit": 4})).json()
        assert [m["content"] for m in recent["messages"]] == texts[2:]
        assert recent["has_more"] is True
        before = {"limit": 4, "before": recent["first_id"]}
        older = (await stack.http.get(url, params=before)).json()
        assert [m["content"] for m in older["messages"]] == texts[:2]
        assert older["has_more"] is False
        huge = "9" * 30
        for params in (
            {"limit": 0},
            {"limit": 1001},
            {"limit": "many"},
            {"before": "x1"},
            {"before": huge},
        ):
            refused = await stack.http.get(url, params=params)
            assert refused.status_code == 400, params
            assert refused.json()["error"]["type"] == "invalid_request_error", params

        # JSON-RPC: a conversation of the JWT's user, its turns by chat.send.
        created = (await stack.rpc("conversations.create", {}))["result"]["id"]
        for i in range(3):
            await stack.rpc(
                "chat.send",
                {
                    "model": "m",
                    "memory": False,
                    "conversation_id": created,
                    "messages": [{"role": "user", "content": f"turn {i}"}],
                },
            )
        paged = await stack.rpc("conversations.get", {"conversation_id": created, "limit": 4})
        assert [m["content"] for m in paged["result"]["messages"]] == texts[2:]
        assert paged["result"]["has_more"] is True
        cursor = {"conversation_id": created, "before": paged["result"]["first_id"]}
        rest = await stack.rpc("conversations.get", cursor)
        assert [m["content"] for m in rest["result"]["messages"]] == texts[:2]
        assert rest["result"]["has_more"] is False
        for params in ({"limit": 0}, {"limit": 1001}, {"before": "x1"}, {"before": huge}):
            refused_rpc = await stack.rpc(
                "conversations.get", {"conversation_id": created, **params}
            )
            assert refused_rpc["error"]["code"] == -32602, params
