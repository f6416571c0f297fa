"""usage.summary over the real gateway: who sees whose usage, the groupings, the period, and the
caller's budget; records are put in the gateway's own usage store as its meter would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from gateway_http.auth import mint_token
from gateway_http.usage.records import Budget, UsageRecord
from tests.e2e.stack import JWT_SECRET, Stack, running_stack
from tests.support.usage import usage_record

NOW = datetime.now(UTC)
TODAY = NOW.strftime("%Y-%m-%d")


def record(principal: str, prompt: int, completion: int, **fields: Any) -> UsageRecord:
    defaults: dict[str, Any] = {"model": "fake-model", "backend": "upstream", "memory_tokens": 0}
    return usage_record(principal, prompt, completion, at=NOW, **{**defaults, **fields})


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path, api_keys=("team=team-secret-key-0123",)) as running:
        usage = running.app.state.gateway.usage
        await usage.store.add(
            [
                record("alice", 100, 10, model="gpt-4o", user="phone"),
                record("alice", 50, 5, model="llama", backend="local"),
                record("bob", 7, 3),
                record("key:team", 1000, 1),
            ]
        )
        yield running


async def summary(
    stack: Stack, params: dict[str, Any] | None = None, *, token: str | None = None
) -> dict[str, Any]:
    request: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": "usage.summary"}
    if params is not None:
        request["params"] = params
    response = await stack.http.post(
        "/api/rpc", json=request, headers={"Authorization": f"Bearer {token or stack.jwt}"}
    )
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def admin() -> str:
    return mint_token(JWT_SECRET, "root", 600, admin=True)


@pytest.mark.asyncio
async def test_a_user_sees_only_their_own_usage(stack: Stack) -> None:
    reply = await summary(stack, {"group_by": ["principal", "model"]})

    result = reply["result"]
    assert [(r["principal"], r["model"], r["total_tokens"]) for r in result["rows"]] == [
        ("alice", "gpt-4o", 110),
        ("alice", "llama", 55),
    ]
    assert result["totals"]["turns"] == 2
    assert result["totals"]["prompt_tokens"] == 150
    assert result["group_by"] == ["principal", "model"]
    assert result["from"] == NOW.strftime("%Y-%m-01T00:00:00.000Z")
    # Whose usage this is, named: the caller's own.
    assert result["principal"] == "alice"


@pytest.mark.asyncio
async def test_an_admin_sees_everyones_or_one_principals(stack: Stack) -> None:
    everyone = (await summary(stack, {"group_by": ["principal"]}, token=admin()))["result"]
    assert [(r["principal"], r["turns"]) for r in everyone["rows"]] == [
        ("alice", 2),
        ("bob", 1),
        ("key:team", 1),
    ]
    assert everyone["principal"] is None
    bob = (await summary(stack, {"principal": "bob"}, token=admin()))["result"]
    assert bob["principal"] == "bob"
    assert bob["rows"] == [
        {
            "turns": 1,
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "memory_tokens": 0,
            "estimated_turns": 0,
            "cost": None,
        }
    ]


@pytest.mark.asyncio
async def test_a_user_may_not_read_another_principals_usage(stack: Stack) -> None:
    reply = await summary(stack, {"principal": "bob"})

    assert reply["error"]["code"] == -32007
    assert "another principal's usage needs an admin token" in reply["error"]["message"]
    assert (await summary(stack, {"principal": "alice"}))["result"]["totals"]["turns"] == 2


@pytest.mark.asyncio
async def test_an_api_key_reads_its_own_usage(stack: Stack) -> None:
    reply = await summary(stack, {"group_by": ["principal"]}, token="team-secret-key-0123")

    assert [(r["principal"], r["prompt_tokens"]) for r in reply["result"]["rows"]] == [
        ("key:team", 1000)
    ]


@pytest.mark.asyncio
async def test_groupings_by_user_backend_and_day(stack: Stack) -> None:
    by = (await summary(stack, {"group_by": ["day", "backend", "user"]}))["result"]["rows"]

    assert [(r["day"], r["backend"], r["user"], r["turns"]) for r in by] == [
        (TODAY, "local", "", 1),
        (TODAY, "upstream", "phone", 1),
    ]


@pytest.mark.asyncio
async def test_the_period_bounds_the_records(stack: Stack) -> None:
    before = (NOW - timedelta(days=40)).strftime("%Y-%m-%d")
    yesterday = (NOW - timedelta(days=1)).strftime("%Y-%m-%d")
    empty = (await summary(stack, {"from": before, "to": yesterday}))["result"]
    assert empty["rows"] == []
    assert empty["totals"]["turns"] == 0
    assert empty["to"] == NOW.strftime("%Y-%m-%dT00:00:00.000Z")
    today = (await summary(stack, {"from": TODAY, "to": TODAY}))["result"]
    assert today["totals"]["turns"] == 2


@pytest.mark.asyncio
async def test_a_period_still_to_come_is_empty_not_a_mistake(stack: Stack) -> None:
    tomorrow = (NOW + timedelta(days=1)).strftime("%Y-%m-%d")

    result = (await summary(stack, {"from": tomorrow}))["result"]

    assert result["rows"] == []
    assert result["totals"]["turns"] == 0
    assert result["totals"]["total_tokens"] == 0
    assert result["from"] == result["to"] == f"{tomorrow}T00:00:00.000Z"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"group_by": ["colour"]}, "cannot group by 'colour'"),
        ({"group_by": ["day", "day"]}, "group_by names a column twice"),
        ({"from": "2026-02-30"}, "'2026-02-30' is not a date (YYYY-MM-DD)"),
        ({"from": "2026-12-01T10:00:00"}, "has no UTC offset"),
        ({"from": "2026-12-02", "to": "2026-12-01"}, "'to' must be after 'from'"),
        ({"to": "2020-01-01"}, "'to' must be after 'from' (unset: the start of this month, "),
        ({"since": "2026-12-01"}, "since: Extra inputs are not permitted"),
        ({"group_by": "day"}, "group_by: Input should be a valid list"),
    ],
)
async def test_a_bad_query_is_invalid_params(
    stack: Stack, params: dict[str, Any], said: str
) -> None:
    reply = await summary(stack, params)

    assert reply["error"]["code"] == -32602
    assert said in reply["error"]["message"]


@pytest.mark.asyncio
async def test_the_callers_budget_comes_with_their_usage(stack: Stack) -> None:
    usage = stack.app.state.gateway.usage
    await usage.store.set_budget("alice", Budget(tokens=1000))
    await usage.budgets.refresh()

    budget = (await summary(stack))["result"]["budget"]
    assert budget == {
        "month": NOW.strftime("%Y-%m"),
        "tokens": 1000,
        "cost": None,
        "spent_tokens": 165,
        "spent_cost": 0.0,
    }
    assert "budget" not in (await summary(stack, token=admin()))["result"]


@pytest.mark.asyncio
async def test_without_metering_usage_summary_says_it_is_off(tmp_path: Path) -> None:
    async with running_stack(tmp_path, usage=False) as stack:
        reply = await summary(stack)

    assert reply["error"]["code"] == -32000
    assert reply["error"]["data"] == {"code": "usage_off"}
    assert not (tmp_path / "usage.db").exists()


@pytest.mark.asyncio
async def test_without_a_token_usage_summary_is_refused(stack: Stack) -> None:
    response = await stack.http.post(
        "/api/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "usage.summary"}
    )
    assert isinstance(response, httpx.Response)
    assert response.json()["error"]["code"] == -32005
