"""The console's Usage page in a real headless Chromium, against the real stack: real turns of
two principals today and records of earlier days in the gateway's usage store, shown as a daily
chart per model and as tables, all equal to what usage.summary answers.

Screenshots go to ``tests/artifacts/console-usage/``: everyone's month, one principal's with
its budget, the page on a 420 px phone, and what a token that is not an admin's is shown.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import expect

from gateway_http.usage.records import Budget, UsageRecord
from tests.e2e.scoped import TEAM_A_KEY, jwt, scoped_stack
from tests.e2e.test_console_browser import WAIT_MS, open_console, sign_in
from tests.support.browser import artifact_dir, chromium
from tests.support.usage import usage_record

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

ADMIN = jwt("ops", admin=True)
ALICE = jwt("alice")
DEV = jwt("dev")
NOW = datetime.now(UTC)
EARLIER = [NOW - timedelta(days=n) for n in (2, 1)]
FROM = EARLIER[0].strftime("%Y-%m-%d")
TODAY = NOW.strftime("%Y-%m-%d")


def record(principal: str, at: datetime, model: str, prompt: int, completion: int) -> UsageRecord:
    cost = prompt * 2 + completion * 10 if model == "gpt-4o" else None
    return usage_record(
        principal, prompt, completion, at=at, model=model, memory_tokens=40, cost_micro=cost
    )


@pytest.fixture(autouse=True)
def patient_expectations() -> Any:
    expect.set_options(timeout=WAIT_MS)
    yield
    expect.set_options(timeout=None)


async def test_the_usage_page_charts_tokens_per_day_and_model(tmp_path: Path) -> None:
    shots = artifact_dir("console-usage")
    async with scoped_stack(tmp_path) as stack, chromium() as browser:
        # Real turns today: Alice's (JWT) and team A's (API key), through the fake upstream.
        for bearer, text in ((ALICE, "I like oolong"), (TEAM_A_KEY, "deploy at noon")):
            assert (await stack.say("rest", bearer, text)).status == 200
        assert (await stack.say("sse", ALICE, "and jasmine too")).status == 200
        usage = stack.gateway.usage
        assert usage is not None
        await usage.store.add(
            [
                record("alice", at, model, prompt, completion)
                for at in EARLIER
                for model, prompt, completion in (("gpt-4o", 1200, 300), ("llama-3.1", 400, 100))
            ]
        )
        await usage.store.set_budget("alice", Budget(tokens=10_000))
        await usage.budgets.refresh()
        expected = await stack.result(
            ADMIN, "usage.summary", {"from": FROM, "to": TODAY, "group_by": ["day", "model"]}
        )
        principals = await stack.result(
            ADMIN, "usage.summary", {"from": FROM, "to": TODAY, "group_by": ["principal"]}
        )

        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        watched = await open_console(stack, context, shots)
        page = watched.page
        await sign_in(page, ADMIN)
        await expect(page.locator("#breaker")).to_have_text("closed")
        await page.get_by_role("link", name="Usage").click()
        await expect(page.locator("#usage-title")).to_be_focused()
        await expect(page.get_by_role("link", name="Usage")).to_have_attribute(
            "aria-current", "page"
        )
        await expect(page.locator("#status-panel")).to_be_hidden()
        # This month by default, everyone's for an admin.
        await expect(page.get_by_label("To (included)")).to_have_value(TODAY)
        await page.get_by_label("From (UTC day)").fill(FROM)
        await page.get_by_role("button", name="Show usage").click()
        totals = expected["totals"]
        await expect(page.locator("#usage-note")).to_have_text(
            f"{totals['turns']} turns, {totals['total_tokens']:,} tokens from {FROM} to {TODAY}."
        )
        await expect(page.locator("#usage-scope")).to_have_text(
            "Showing everyone's usage, anonymous turns included."
        )
        await expect(page.locator("#usage-others")).to_be_hidden()

        # One bar per (day, model), each as tall as its tokens say, one colour per model.
        bars = page.locator("#usage-chart rect.bar")
        await expect(bars).to_have_count(len(expected["rows"]))
        drawn = await bars.evaluate_all(
            "bars => bars.map(b => [b.dataset.day, b.dataset.model, Number(b.dataset.tokens),"
            " b.getAttribute('fill'), Number(b.getAttribute('height'))])"
        )
        assert sorted((d, m, t) for d, m, t, _, _ in drawn) == sorted(
            (r["day"], r["model"], r["total_tokens"]) for r in expected["rows"]
        )
        colours = {m: fill for _, m, _, fill, _ in drawn}
        assert len(set(colours.values())) == len(colours) == 3
        heights = {(d, m): h for d, m, _, _, h in drawn}
        day = EARLIER[0].strftime("%Y-%m-%d")
        assert heights[day, "gpt-4o"] == pytest.approx(3 * heights[day, "llama-3.1"], rel=0.01)
        await expect(page.locator("#usage-legend li")).to_have_count(3)
        await expect(page.locator("#usage-chart desc")).to_contain_text("the busiest day was")

        # The tables say the same as usage.summary.
        model_rows = page.locator("#usage-models tbody tr")
        await expect(model_rows).to_have_count(3)
        fake = next(r for r in expected["rows"] if r["model"] == "fake-model")
        await expect(page.locator("#usage-models tbody tr", has_text="fake-model")).to_contain_text(
            f"{fake['total_tokens']:,}"
        )
        shown = await page.locator("#usage-principals tbody tr td:first-child").all_text_contents()
        assert shown == [r["principal"] for r in principals["rows"]]
        assert "key:team-a" in shown
        await watched.shot("01-everyone")

        # One principal's usage, with its budget.
        await page.get_by_role("textbox", name="Principal").fill("alice")
        await page.get_by_role("textbox", name="Principal").press("Enter")
        await expect(page.locator("#usage-budget")).to_be_visible()
        mine = await stack.result(ADMIN, "usage.summary", {"principal": "alice"})
        await expect(page.locator("#usage-budget")).to_have_text(
            f"Budget for {NOW:%Y-%m} (UTC): {mine['budget']['spent_tokens']:,} of 10,000 tokens "
            "spent."
        )
        await expect(page.locator("#usage-principals tbody tr")).to_have_count(1)
        await expect(page.locator("#usage-scope")).to_have_text("Showing the usage of alice only.")
        await watched.shot("02-alice-and-her-budget")

        # A phone: the chart scales to the width, nothing scrolls sideways.
        await page.set_viewport_size({"width": 420, "height": 900})
        await expect(page.locator("#usage-chart")).to_be_visible()
        assert await page.evaluate(
            "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )
        await watched.shot("03-phone-420px")

        # Back to the memory page, as it was.
        await page.get_by_role("link", name="Memory").click()
        await expect(page.locator("#status-title")).to_be_focused()
        await expect(page.locator("#usage-panel")).to_be_hidden()
        watched.assert_clean(ADMIN)
        await context.close()


async def test_a_token_that_is_not_an_admins_is_told_whose_usage_it_sees(tmp_path: Path) -> None:
    # `make run`: shared mode, REST open; the turns are anonymous, the banner's JWT is dev's.
    async with (
        scoped_stack(tmp_path, scope="shared", api_keys=()) as stack,
        chromium() as browser,
    ):
        assert (await stack.say("rest", None, "I like oolong")).status == 200
        everyone = await stack.result(ADMIN, "usage.summary", {"group_by": ["principal"]})
        assert [(r["principal"], r["turns"]) for r in everyone["rows"]] == [("anonymous", 1)]

        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        watched = await open_console(stack, context, artifact_dir("console-usage"))
        page = watched.page
        await sign_in(page, DEV)
        await page.get_by_role("link", name="Usage").click()

        first = NOW.strftime("%Y-%m-01")
        await expect(page.locator("#usage-note")).to_have_text(
            f"0 turns, 0 tokens from {first} to {TODAY} for dev."
        )
        await expect(page.locator("#usage-scope")).to_have_text(
            "Showing only the usage of dev, the principal you signed in as."
        )
        others = page.locator("#usage-others")
        await expect(others).to_be_visible()
        await expect(others).to_contain_text("turns made anonymously")
        await expect(others).to_contain_text("arona-gateway token --sub ops --admin")
        await expect(others).to_contain_text("arona-gateway usage")
        principal = page.get_by_label("Principal (yours only)")
        await expect(principal).to_have_value("dev")
        await expect(principal).not_to_be_editable()
        await watched.shot("04-not-an-admin")
        watched.assert_clean(DEV)
        await context.close()
