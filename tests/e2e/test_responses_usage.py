"""Responses turns metered and budgeted as chat turns are, end to end: the usage the upstream
reported (a Responses ``usage`` object) recorded for the caller with memory's share of the
prompt, JSON and streamed, and a caller over budget refused with 429 ``insufficient_quota``
(a wrong API key with 401) before memory or any upstream is asked."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from gateway_http.usage.tokens import TokenCounter
from tests.e2e.test_usage_metering import SECTION, metered, quota_error, set_budget, summary
from tests.support.fake_philia import QUERY

pytestmark = pytest.mark.asyncio

ASK = "what tea do I like?"


async def test_responses_turns_are_recorded_with_the_usage_their_upstream_reported(
    tmp_path: Path,
) -> None:
    async with metered(tmp_path) as stack:
        for stream in (False, True):
            body = {"model": "fake-model", "input": ASK, "stream": stream}
            async with stack.http.stream("POST", "/v1/responses", json=body) as answer:
                await answer.aread()
                assert answer.status_code == 200
                assert answer.headers["X-Arona-Memory"] == "enabled"
        result = await summary(stack, group_by=["principal", "model", "backend"])
    # The fake reports the words of the user's text and of its reply.
    words = len(ASK.split())
    replied = len(f"reply to: {ASK}".split())
    assert result["rows"] == [
        {
            "principal": "alice",
            "model": "fake-model",
            "backend": "upstream",
            "turns": 2,
            "prompt_tokens": 2 * words,
            "completion_tokens": 2 * replied,
            "total_tokens": 2 * (words + replied),
            "memory_tokens": 2 * TokenCounter().section(SECTION),
            "estimated_turns": 0,
            "cost": None,
        }
    ]


async def test_a_principal_over_budget_or_a_wrong_key_gets_no_response(tmp_path: Path) -> None:
    key = "sk-team-0123456789"
    async with metered(tmp_path, api_keys=(f"team={key}",)) as stack:
        await set_budget(stack, "key:team", 1)
        stack.http.headers["Authorization"] = f"Bearer {key}"
        assert (await stack.turn("rest", [{"role": "user", "content": ASK}])).status == 200
        recalled = len(stack.philia.frames_of(QUERY))
        async with openai.AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0
        ) as client:
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as raised:
                    await client.responses.create(model="fake-model", input=ASK, stream=stream)
                error = quota_error(raised.value.response.json())
                assert "the monthly budget of key:team" in error["message"]
            # A wrong key is refused as on chat.
            wrong = await stack.http.post(
                "/v1/responses",
                json={"model": "fake-model", "input": ASK},
                headers={"Authorization": "Bearer sk-not-a-key"},
            )
            assert wrong.status_code == 401
            assert wrong.json()["error"]["code"] == "invalid_api_key"
        # Refused before recall, and no upstream asked.
        assert len(stack.philia.frames_of(QUERY)) == recalled
        assert stack.upstream.responses_requests == []
