"""``make run`` as a new user tries it: ``arona-gateway up`` (which `make run` starts, with the
semantic extra installed) remembers a fact and recalls it for a question in other words."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_up import gateway_up, wait_for_writebacks

from .semantic import needs_semantic

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

FACT = "My daughter Mia is allergic to peanuts."
PARAPHRASE = "Does my kid have any food allergy?"


@needs_semantic
async def test_make_run_recalls_a_fact_asked_about_in_other_words(tmp_path: Path) -> None:
    async with httpx.AsyncClient(timeout=30) as client, gateway_up(tmp_path / "data") as up:
        first = await client.post(
            f"{up.http_url}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": FACT}]},
        )
        assert first.status_code == 200
        await wait_for_writebacks(up, client, 1)

        second = await client.post(
            f"{up.http_url}/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": PARAPHRASE}]},
        )
        assert second.status_code == 200
        assert second.headers["X-Arona-Memory"] == "enabled"
        reply = second.json()["choices"][0]["message"]["content"]
        # The echo model shows the section it was given: the fact is in it, though the
        # question shares none of its words.
        assert "## Relevant Long-Term Memories" in reply
        assert f"User: {FACT}" in reply
