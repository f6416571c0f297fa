"""The operator console in a real headless Chromium, against the real stack.

The embedded store, the real gRPC ``MemoryService`` and the real app under uvicorn
(:func:`tests.e2e.scoped.scoped_stack`, ``user`` scope mode, and ``shared`` for the turns of no
principal), and Debian's ``chromium``
driven by Playwright (:mod:`tests.support.browser`). The page is used as an operator would:
by label and role, with the keyboard where it matters, and every wait is one of Playwright's
bounded expectations, never a sleep. A screenshot of each state is saved under
``tests/artifacts/console/``, the phone-sized and wide-screen pages among them
(``10-phone-420px.png``, ``11-wide-1600px.png``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from playwright.async_api import BrowserContext, Page, Route, expect

from arona_grpc.server import GrpcServer
from gateway_http.auth import mint_token
from tests.e2e.scoped import HEADER, JWT_SECRET, STORE_TOKEN, ScopedStack, jwt, scoped_stack
from tests.support.browser import artifact_dir, chromium
from tests.support.raw_philia import closed_port

# Up to 12 s a test on a loaded 2-core box.
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

ADMIN = jwt("ops", admin=True)
ALICE = jwt("alice")
# The JWT `make run`'s banner prints: not an admin's.
DEV = jwt("dev")
FACT = "My locker code is 4417 and my locker is the blue zebra one"
OTHER = "I keep a spare zebra key in the kitchen drawer"
ASK = "Which zebra locker is mine, and its code?"
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
# A zone far from UTC with a quarter-hour offset and no daylight saving time (since 1986), so
# that a time shown in UTC, or with the offset's minutes dropped, cannot pass for local.
ZONE, ZONE_OFFSET = "Asia/Kathmandu", timezone(timedelta(hours=5, minutes=45))
# Several expectations wait for the console's next refresh (every 2 s): 1.3 to 2.6 s, idle or
# loaded, against Playwright's default 5 s. Every wait, action or expectation, gets 30 s.
WAIT_MS = 30_000
SHORT_TTL_S = 7
BREAKER_FAILURES = 2


@pytest.fixture(autouse=True)
def patient_expectations() -> Iterator[None]:
    expect.set_options(timeout=WAIT_MS)
    yield
    expect.set_options(timeout=None)  # Playwright's own default again


@dataclass
class Watched:
    """A page and what it did: every URL it asked for, every answer that was an HTTP error,
    every error in the browser's console (with the URL it names) and every script error."""

    page: Page
    context: BrowserContext
    shots: Path
    urls: list[str] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)

    async def shot(self, name: str) -> None:
        await self.page.screenshot(path=self.shots / f"{name}.png", full_page=True)

    def assert_clean(self, token: str, *, may_fail: tuple[str, ...] = ()) -> None:
        """No token in a URL; no request answered with an error (a favicon's 404 included),
        except on the paths in ``may_fail``, which the test makes fail on purpose; no error in
        the console (a CSP violation, a script error) but those failed loads'."""
        assert all(token not in url for url in self.urls)
        assert [(s, u) for s, u in self.failed if urlsplit(u).path not in may_fail] == []
        expected = [
            (text, url)
            for text, url in self.problems
            if text.startswith("Failed to load resource") and urlsplit(url).path in may_fail
        ]
        assert [p for p in self.problems if p not in expected] == []


async def open_console(stack: ScopedStack, context: BrowserContext, shots: Path) -> Watched:
    page = await context.new_page()
    page.set_default_timeout(WAIT_MS)
    watched = Watched(page, context, shots)
    page.on("request", lambda request: watched.urls.append(request.url))
    page.on(
        "response",
        lambda response: (
            watched.failed.append((response.status, response.url))
            if response.status >= 400
            else None
        ),
    )
    page.on(
        "console",
        lambda message: (
            watched.problems.append((message.text, message.location.get("url", "")))
            if message.type == "error"
            else None
        ),
    )
    page.on("pageerror", lambda error: watched.problems.append((str(error), "")))
    await page.goto(stack.base_url + "/console")
    return watched


async def sign_in(page: Page, token: str) -> None:
    field_ = page.get_by_label("JWT", exact=True)
    await field_.fill(token)
    await field_.press("Enter")


async def shown_times(page: Page) -> list[tuple[str, str]]:
    """Every time on the page as (what it shows, its title), read at once."""
    pairs = await page.evaluate(
        "() => Array.from(document.querySelectorAll('time'), t => [t.textContent, t.title])"
    )
    return [(str(text), str(title)) for text, title in pairs]


def local(utc: str, zone: timezone) -> str:
    """``2026-12-02T03:51:56.331Z`` as a clock in ``zone`` shows it: ``2026-12-02 09:36:56``."""
    at = datetime.fromisoformat(utc.replace("Z", "+00:00"))
    return at.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S")


async def loaded_images(page: Page, urls: list[str]) -> list[Any]:
    """Each URL loaded as an image by the page: its [width, height], or None if it fails."""
    return list(
        await page.evaluate(
            """urls => Promise.all(urls.map(url => new Promise(done => {
                const image = new Image();
                image.onload = () => done([image.naturalWidth, image.naturalHeight]);
                image.onerror = () => done(null);
                image.src = url;
            })))""",
            urls,
        )
    )


async def test_sign_in_recall_delete_and_the_breaker_opening(tmp_path: Path) -> None:
    shots = artifact_dir("console")
    async with (
        scoped_stack(
            tmp_path,
            memory_breaker_failures=BREAKER_FAILURES,
            # Open for the rest of the test once it opens.
            memory_breaker_cooldown_s=600.0,
            memory_timeout_s=1.0,
        ) as stack,
        chromium() as browser,
    ):
        await stack.say("rpc", ALICE, FACT)
        await stack.say("rpc", ALICE, OTHER)
        await stack.settle()
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        watched = await open_console(stack, context, shots)
        page = watched.page

        # Sign in: the token field has the focus; a user's token and a forged one are refused.
        await expect(page.get_by_label("JWT", exact=True)).to_be_focused()
        await watched.shot("01-sign-in")
        await sign_in(page, ALICE)
        await expect(page.get_by_role("alert")).to_have_text("This token is not an admin's.")
        await sign_in(page, "not.a.token")
        await expect(page.get_by_role("alert")).to_contain_text("Token refused")
        await expect(page.locator("#console")).to_be_hidden()
        await watched.shot("02-token-refused")
        await sign_in(page, ADMIN)
        await expect(page.locator("#breaker")).to_have_text("closed")
        await expect(page.locator("#enabled")).to_have_text("on")
        await expect(page.locator("#writeback")).to_have_text("on")
        await expect(page.locator("#scope-mode")).to_have_text("user")
        await expect(page.locator("#outbox-depth")).to_have_text("0")
        await expect(page.locator("#outbox-dead-letters")).to_have_text("0")
        # One store: the breaker above is its state, no list.
        await expect(page.locator("#stores")).to_have_text("—")
        # The one replica the HTTP layer reaches, with its Exchange streams.
        await expect(page.locator("#replicas")).to_have_text(
            re.compile(re.escape(stack.settings.grpc_target or "") + r" \([12]/2 streams\)$")
        )
        await expect(page.locator("#who")).to_contain_text("ops (admin)")
        # The tab's icon, and the one a browser asks /favicon.ico for, both load as images.
        icon = await page.locator("link[rel=icon]").get_attribute("href")
        assert icon == "/console/favicon.svg"
        assert await loaded_images(page, [icon, "/favicon.ico"]) == [[32, 32], [32, 32]]
        await expect(page.get_by_label("JWT", exact=True)).to_have_value("")
        assert await page.evaluate("() => sessionStorage.getItem('arona.console.jwt')") == ADMIN
        assert "token" not in page.url
        await watched.shot("03-signed-in")

        # A reload stays signed in (the tab keeps the token), with no token typed again.
        await page.reload()
        await expect(page.locator("#breaker")).to_have_text("closed")

        # The recall tester shows exactly the section a turn would inject.
        await page.get_by_label("Query").fill(ASK)
        await page.locator("#recall-scope").fill("alice")
        await page.get_by_label("Query").press("Enter")
        section = page.locator("#recall-section")
        await expect(section).to_contain_text(HEADER)
        await expect(section).to_contain_text("4417")
        expected = await stack.result(ADMIN, "memory.recall", {"query": ASK, "scope": "alice"})
        assert await section.text_content() == expected["section"]
        await expect(page.locator("#recall-memories tbody tr")).to_have_count(
            len(expected["memories"])
        )
        await expect(page.locator("#recall-state")).to_contain_text("State: enabled")
        # The event feed refreshes by itself: the tester's recall shows up.
        recall_event = page.locator("#events-table tbody tr.event-recall", has_text=ASK)
        await expect(recall_event.first).to_be_visible()
        await watched.shot("04-recall")

        # A user's episodes, listed and one deleted with the keyboard: Delete asks first, and
        # the question's focus is on Cancel.
        await page.locator("#episodes-scope").fill("alice")
        await page.locator("#episodes-scope").press("Enter")
        rows = page.locator("#episodes-table tbody tr")
        await expect(rows).to_have_count(2)
        await watched.shot("05-episodes")
        row = rows.filter(has_text="4417")
        delete = row.get_by_role("button", name="Delete episode")
        question = row.get_by_role("group", name=re.compile("^Delete episode .*4417.*\\?$"))
        yes = question.get_by_role("button", name="Yes, delete")
        cancel = question.get_by_role("button", name="Cancel")
        await delete.focus()
        await page.keyboard.press("Enter")
        await expect(cancel).to_be_focused()
        await expect(page.locator("#episodes-note")).to_contain_text("cannot be undone")
        await watched.shot("05b-delete-asks-first")
        # Escape keeps the episode (on the page and in the store), back on its Delete button.
        await page.keyboard.press("Escape")
        await expect(question).to_have_count(0)
        await expect(delete).to_be_focused()
        await expect(page.locator("#episodes-note")).to_contain_text("Kept episode")
        kept = await stack.result(ADMIN, "memory.list", {"scope": "alice"})
        assert len(kept["memories"]) == 2
        assert any("4417" in text for text in stack.stored_texts())
        # Asked again, and confirmed with the mouse.
        await delete.click()
        await yes.click()
        await expect(rows).to_have_count(1)
        await expect(rows.filter(has_text="4417")).to_have_count(0)
        await expect(page.locator("#episodes-note")).to_contain_text("Deleted episode")
        # The focus stays in the table, on the remaining row's button.
        await expect(rows.get_by_role("button", name="Delete episode")).to_be_focused()
        listed = await stack.result(ADMIN, "memory.list", {"scope": "alice"})
        remaining = await rows.locator("td").nth(1).text_content()
        assert [m["preview"] for m in listed["memories"]] == [remaining]
        assert all("4417" not in text for text in stack.stored_texts())
        await watched.shot("06-episode-deleted")

        # Philia stops: turns go on offline, the breaker opens, the page shows it.
        await stack.store.stop()
        for _ in range(BREAKER_FAILURES):
            said = await stack.say("rpc", ALICE, ASK)
            assert said.memory == "offline"
        await expect(page.locator("#breaker")).to_have_text("open")
        opened_at = page.locator("#breaker-opened-at time")
        await expect(opened_at).to_have_attribute("title", RFC3339_MS)
        error_event = page.locator("#events-table tbody tr.event-error")
        await expect(error_event.first).to_be_visible()
        await watched.shot("07-breaker-open")

        watched.assert_clean(ADMIN)
        await context.close()


def _exposition(n: int) -> str:
    """``/metrics`` after ``n`` scrapes: 12 enabled and 1 offline turn between two."""
    return "\n".join(
        [
            "# HELP arona_turns_total Chat turns.",
            "# TYPE arona_turns_total counter",
            f'arona_turns_total{{surface="rest",memory="enabled",outcome="ok"}} {6 * n}.0',
            f'arona_turns_total{{surface="rpc",memory="enabled",outcome="ok"}} {6 * n}.0',
            f'arona_turns_total{{surface="sse",memory="offline",outcome="ok"}} {n}.0',
            'arona_turns_total{surface="rest",memory="disabled",outcome="error"} 3.0',
            f'arona_turns_created{{surface="rest",memory="enabled",outcome="ok"}} {n}.0',
            "",
        ]
    )


async def test_turns_per_minute_from_metrics_and_without_them(tmp_path: Path) -> None:
    shots = artifact_dir("console")
    async with scoped_stack(tmp_path) as stack, chromium() as browser:
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        scrapes = 0
        available = True

        async def metrics(route: Route) -> None:
            nonlocal scrapes
            if not available:
                await route.fulfill(status=404, json={"error": {"message": "Not Found"}})
                return
            scrapes += 1
            await route.fulfill(
                status=200, body=_exposition(scrapes), content_type="text/plain; version=0.0.4"
            )

        handler: Callable[[Route], Awaitable[Any]] = metrics
        await context.route("**/metrics", handler)
        watched = await open_console(stack, context, shots)
        page = watched.page
        await sign_in(page, ADMIN)

        await expect(page.locator("#metrics-note")).to_contain_text("Over the last")
        # Both read at once, from one refresh.
        enabled, offline = map(
            float,
            await page.evaluate(
                "() => ['tpm-enabled', 'tpm-offline']"
                ".map(id => document.getElementById(id).textContent)"
            ),
        )
        assert enabled > 0 and enabled == pytest.approx(12 * offline, rel=0.05)
        await expect(page.locator("#tpm-disabled")).to_have_text("0.0")
        await expect(page.locator("#total-disabled")).to_have_text("3")
        await watched.shot("08-turns-per-minute")

        # A gateway without /metrics: the panel says so, the rest goes on.
        available = False
        await expect(page.locator("#metrics-note")).to_contain_text("Metrics not available")
        await expect(page.locator("#tpm-enabled")).to_have_text("–")
        await expect(page.locator("#breaker")).to_have_text("closed")
        await page.get_by_label("Query").fill("anything")
        await page.get_by_label("Query").press("Enter")
        await expect(page.locator("#recall-state")).to_contain_text("State: disabled")
        await watched.shot("09-metrics-not-available")
        watched.assert_clean(ADMIN, may_fail=("/metrics",))
        await context.close()


async def test_the_console_is_usable_with_the_keyboard_alone(tmp_path: Path) -> None:
    shots = artifact_dir("console")
    async with scoped_stack(tmp_path) as stack, chromium() as browser:
        await stack.say("rpc", ALICE, FACT)
        await stack.settle()
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        watched = await open_console(stack, context, shots)
        page, keyboard = watched.page, watched.page.keyboard

        async def focused() -> str:
            return str(await page.evaluate("() => document.activeElement.id || ''"))

        async def outline_visible() -> bool:
            style = await page.evaluate(
                "() => { const s = getComputedStyle(document.activeElement);"
                " return [s.outlineStyle, s.outlineWidth]; }"
            )
            return bool(style[0] != "none" and style[1] != "0px")

        # The token field has the focus on arrival; type, Enter.
        assert await focused() == "token"
        assert await outline_visible()
        await keyboard.press("Tab")
        assert await page.evaluate("() => document.activeElement.textContent") == "Sign in"
        assert await outline_visible()
        await keyboard.press("Shift+Tab")
        await keyboard.type(ADMIN)
        await keyboard.press("Enter")
        await expect(page.locator("#breaker")).to_have_text("closed")

        # Then the tab order runs through the recall tester's fields in reading order.
        order = []
        for _ in range(4):
            await keyboard.press("Tab")
            order.append(
                await focused() or await page.evaluate("() => document.activeElement.textContent")
            )
            assert await outline_visible()
        assert order == ["recall-query", "recall-scope", "recall-limit", "Recall"]
        await keyboard.press("Shift+Tab")
        await keyboard.press("Shift+Tab")
        await keyboard.type("alice")
        await keyboard.press("Shift+Tab")
        await keyboard.type(ASK)
        await keyboard.press("Enter")
        await expect(page.locator("#recall-section")).to_contain_text("4417")

        # On to the episodes: their scope field, then its button; the list shows Alice's.
        while await focused() != "episodes-scope":
            await keyboard.press("Tab")
        await keyboard.type("alice")
        await keyboard.press("Enter")
        await expect(page.locator("#episodes-table tbody tr")).to_have_count(1)
        for field_id in ("episodes-anonymous", "episodes-contains"):
            await keyboard.press("Tab")
            assert await focused() == field_id
        await keyboard.press("Tab")
        assert await page.evaluate("() => document.activeElement.textContent") == "List episodes"
        await keyboard.press("Tab")
        assert await page.evaluate("() => document.activeElement.textContent") == "Delete"
        # Delete asks first, on Cancel: Enter keeps the episode, back on Delete.
        await keyboard.press("Enter")
        await expect(page.get_by_role("button", name="Cancel")).to_be_focused()
        await keyboard.press("Enter")
        await expect(page.get_by_role("button", name="Delete episode")).to_be_focused()
        await expect(page.locator("#episodes-table tbody tr")).to_have_count(1)
        # Asked again: Shift+Tab to "Yes, delete", Enter.
        await keyboard.press("Enter")
        await expect(page.get_by_role("button", name="Cancel")).to_be_focused()
        await keyboard.press("Shift+Tab")
        assert await page.evaluate("() => document.activeElement.textContent") == "Yes, delete"
        await keyboard.press("Enter")
        await expect(page.locator("#episodes-table tbody tr")).to_have_count(0)
        # The focus does not fall out of the page.
        assert await focused() == "episodes-scope"

        # Sign out is a button too; the token is gone from the tab.
        await page.get_by_role("button", name="Sign out").focus()
        await keyboard.press("Enter")
        await expect(page.get_by_label("JWT", exact=True)).to_be_focused()
        assert await page.evaluate("() => sessionStorage.getItem('arona.console.jwt')") is None
        watched.assert_clean(ADMIN)
        await context.close()


async def test_the_console_signs_in_while_the_memory_service_is_down(tmp_path: Path) -> None:
    """An outage is when the console is needed most: an accepted token signs in even when
    MemoryService does not answer, the page says so, and the status comes once it is back."""
    async with scoped_stack(tmp_path) as stack, chromium() as browser:
        port = stack.grpc.port
        await stack.grpc.stop(0.5)
        context = await browser.new_context()
        watched = await open_console(stack, context, artifact_dir("console"))
        page = watched.page
        await sign_in(page, jwt("ops", admin=True))
        await expect(page.locator("#console")).to_be_visible()
        await expect(page.locator("#status-error")).to_contain_text(
            "Status not refreshed: memory service unavailable"
        )
        back = await GrpcServer.start(dataclasses.replace(stack.settings, grpc_port=port))
        try:
            # Refreshed every 2 s: the status shows once the service answers again.
            await expect(page.locator("#breaker")).to_have_text("closed")
            await expect(page.locator("#status-error")).to_have_text("")
        finally:
            await context.close()
            await back.stop(0.5)
        # A refused token still signs nobody in.
        page = await (await browser.new_context()).new_page()
        await page.goto(stack.base_url + "/console")
        await sign_in(
            page, mint_token("a secret that is not this gateway secret", "ops", 60, admin=True)
        )
        await expect(page.get_by_role("alert")).to_contain_text("Token refused")
        await expect(page.locator("#console")).to_be_hidden()


async def test_the_memory_stores_and_the_one_that_is_down(tmp_path: Path) -> None:
    gone = f"ws://127.0.0.1:{closed_port()}/ws"
    async with (
        scoped_stack(tmp_path, more_stores=(gone,)) as stack,
        chromium() as browser,
    ):
        # Calls alternate between the stores: the first sent to the one with nothing
        # listening is made again on the other, and that store is down from then on.
        for _ in range(2):
            assert (await stack.say("rpc", ALICE, FACT)).memory != "offline"
        context = await browser.new_context()
        watched = await open_console(stack, context, artifact_dir("console"))
        page = watched.page
        await sign_in(page, ADMIN)
        stores = page.locator("#stores")
        await expect(stores).to_contain_text(f"{stack.store.url} up since ")
        await expect(stores).to_contain_text(f"{gone} down since ")
        await expect(stores).to_contain_text(f"cannot connect to Philia at {gone}")
        assert STORE_TOKEN not in (await stores.text_content() or "")
        await watched.shot("12-memory-stores")
        watched.assert_clean(ADMIN)


async def test_an_expired_token_signs_the_console_out(tmp_path: Path) -> None:
    async with scoped_stack(tmp_path) as stack, chromium() as browser:
        context = await browser.new_context()
        watched = await open_console(stack, context, artifact_dir("console"))
        page = watched.page
        # Signing in takes about 0.5 s (idle or loaded 2-core box); the token is good for at
        # least SHORT_TTL_S - 1 s (its exp is in whole seconds), over ten times that.
        short = mint_token(JWT_SECRET, "ops", SHORT_TTL_S, admin=True)
        await sign_in(page, short)
        await expect(page.locator("#breaker")).to_have_text("closed")
        # The next refresh after the token's exp (every 2 s) is refused: back to sign-in.
        await expect(page.get_by_role("alert")).to_contain_text(
            "Token refused", timeout=SHORT_TTL_S * 1000 + WAIT_MS
        )
        await expect(page.locator("#console")).to_be_hidden()
        await expect(page.get_by_label("JWT", exact=True)).to_be_focused()
        assert await page.evaluate("() => sessionStorage.getItem('arona.console.jwt')") is None

        # A tab that still holds a refused token starts signed out and says why.
        await page.evaluate("t => sessionStorage.setItem('arona.console.jwt', t)", short)
        await page.reload()
        await expect(page.get_by_role("alert")).to_have_text(
            re.compile("^Signed out: Token refused")
        )
        await expect(page.locator("#console")).to_be_hidden()
        watched.assert_clean(short)
        await context.close()


# What a page that fits its screen has: nothing wider than the window (the page's own width,
# and that of any scrolling region in it), every button and field wholly inside the window.
FITS = """() => {
    const width = window.innerWidth;
    const outside = [];
    for (const el of document.querySelectorAll('button, input')) {
        const box = el.getBoundingClientRect();
        if (box.width === 0 && box.height === 0) continue;  // hidden
        if (box.left < 0 || box.right > width) {
            outside.push((el.id || el.textContent) + ' ' + box.left + '..' + box.right);
        }
    }
    const scrollers = Array.from(document.querySelectorAll('.scroller'))
        .filter(el => el.scrollWidth > el.clientWidth).map(el => el.id || el.className);
    return {page: document.documentElement.scrollWidth, width, outside, scrollers};
}"""

BOXES = """ids => Object.fromEntries(ids.map(id => {
    const box = document.getElementById(id).getBoundingClientRect();
    return [id, [box.left, box.top, box.right]];
}))"""


async def test_a_phone_and_a_wide_screen_in_local_time(tmp_path: Path) -> None:
    shots = artifact_dir("console")
    async with scoped_stack(tmp_path) as stack, chromium() as browser:
        await stack.say("rpc", ALICE, FACT)
        await stack.say("rpc", ALICE, OTHER)
        await stack.settle()
        listed = await stack.result(ADMIN, "memory.list", {"scope": "alice"})
        for width, height, name in ((420, 860, "10-phone-420px"), (1600, 1000, "11-wide-1600px")):
            context = await browser.new_context(
                viewport={"width": width, "height": height}, timezone_id=ZONE
            )
            watched = await open_console(stack, context, shots)
            page = watched.page
            fits = await page.evaluate(FITS)
            assert fits["page"] <= fits["width"] == width and fits["outside"] == [], fits

            await sign_in(page, ADMIN)
            await expect(page.locator("#breaker")).to_have_text("closed")
            # Every panel in use: a recall, Alice's episodes, the question a Delete asks.
            await page.get_by_label("Query").fill(ASK)
            await page.locator("#recall-scope").fill("alice")
            await page.get_by_label("Query").press("Enter")
            await expect(page.locator("#recall-section")).to_contain_text("4417")
            await page.locator("#episodes-scope").fill("alice")
            await page.locator("#episodes-scope").press("Enter")
            rows = page.locator("#episodes-table tbody tr")
            await expect(rows).to_have_count(2)
            await rows.first.get_by_role("button", name="Delete episode").click()
            await expect(page.get_by_role("button", name="Yes, delete")).to_be_visible()
            await expect(page.locator("#events-table tbody tr.event-recall").first).to_be_visible()

            fits = await page.evaluate(FITS)
            assert fits["page"] <= fits["width"] == width, fits
            assert fits["outside"] == [] and fits["scrollers"] == [], fits

            # Times are the zone's local clock, the UTC string they came as on hover: each
            # episode's, each event's, the status's; the panels name the zone.
            times = await shown_times(page)
            assert {title for _, title in times} >= {m["at"] for m in listed["memories"]}
            assert len(times) >= len(listed["memories"]) + 3  # an event and "Refreshed" too
            for shown, title in times:
                assert RFC3339_MS.match(title), title
                assert shown == local(title, ZONE_OFFSET), (shown, title)
            # (named as the browser names it: ICU says "Asia/Katmandu")
            zone = await page.evaluate("() => Intl.DateTimeFormat().resolvedOptions().timeZone")
            assert "mandu" in zone
            await expect(page.locator("#events-panel .time-zone")).to_have_text(
                f"{zone}, UTC+05:45"
            )
            await expect(page.locator("#who time")).to_have_attribute("title", RFC3339_MS)

            panels = ["console", "status-panel", "turns-panel", "recall-panel"]
            panels += ["episodes-panel", "events-panel"]
            boxes = await page.evaluate(BOXES, panels)
            console = boxes["console"]
            if width >= 1400:
                # The width is used: the panels span the window (less its margins), the status
                # beside the turns, the recall tester beside the episodes, the feed below.
                assert console[2] - console[0] >= 0.95 * width - 40, boxes
                status, turns = boxes["status-panel"], boxes["turns-panel"]
                recall, episodes = boxes["recall-panel"], boxes["episodes-panel"]
                assert status[1] == turns[1] and status[2] < turns[0], boxes
                assert recall[1] == episodes[1] and recall[2] < episodes[0], boxes
                assert boxes["events-panel"][1] > recall[1], boxes
                assert boxes["events-panel"][2] - boxes["events-panel"][0] >= 0.95 * width - 40
            else:
                # One column: every panel starts at the same left edge, one below the other.
                lefts = {boxes[p][0] for p in panels[1:]}
                tops = [boxes[p][1] for p in panels[1:]]
                assert len(lefts) == 1 and tops == sorted(tops), boxes
            await watched.shot(name)

            # Cancelled: both episodes are still there.
            await page.get_by_role("button", name="Cancel").click()
            await expect(rows.get_by_role("button", name="Delete episode")).to_have_count(2)
            watched.assert_clean(ADMIN)
            await context.close()
        assert len((await stack.result(ADMIN, "memory.list", {"scope": "alice"}))["memories"]) == 2


async def test_the_turns_of_no_principal_are_listed_searched_and_forgotten(tmp_path: Path) -> None:
    """`make run`'s default: shared mode with REST open, whose turns have no principal, and the
    banner's token, which is not an admin's."""
    shots = artifact_dir("console")
    hamster = "My hamster is called Glimmerquark"
    statue = "The spare key sits under the Thistlewombat statue"
    fern = "Remind me to water the Pollendrake fern"
    async with (
        scoped_stack(tmp_path, scope="shared", api_keys=()) as stack,
        chromium() as browser,
    ):
        created = await stack.http.post("/v1/conversations", json={})
        conversation = created.json()["id"]
        assert (await stack.say("rest", None, hamster, conversation_id=conversation)).status == 200
        for text in (statue, fern):
            assert (await stack.say("rest", None, text)).status == 200
        said = await stack.say("rpc", DEV, "I prefer oolong tea")
        assert said.content == "reply to: I prefer oolong tea"
        await stack.settle()
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        watched = await open_console(stack, context, shots)
        page = watched.page
        # The sign-in asks for the JWT the banner printed, not for an admin's.
        await expect(page.locator("label[for=token]")).to_have_text("JWT")
        await expect(page.locator("#token-hint")).to_contain_text("arona-gateway up")
        await sign_in(page, DEV)
        await expect(page.locator("#scope-mode")).to_have_text("shared")

        # The turns of no principal instead of a scope: the three REST turns, not dev's own.
        await page.get_by_label("Turns of no principal").check()
        await expect(page.locator("#episodes-scope")).to_be_disabled()
        await page.get_by_role("button", name="List episodes").click()
        rows = page.locator("#episodes-table tbody tr")
        note = page.locator("#episodes-note")
        await expect(rows).to_have_count(3)
        await expect(note).to_have_text("3 episodes of no principal.")
        await expect(rows.filter(has_text="oolong")).to_have_count(0)
        # A row's Delete works on them too.
        row = rows.filter(has_text="Pollendrake")
        await row.get_by_role("button", name="Delete episode").click()
        await row.get_by_role("button", name="Yes, delete").click()
        await expect(rows).to_have_count(2)
        await expect(note).to_contain_text("Deleted episode")

        # A search narrows the list, in any case.
        search = page.get_by_label("Search previews")
        await search.fill("glimmerQUARK")
        await search.press("Enter")
        await expect(rows).to_have_count(1)
        await expect(rows).to_contain_text(hamster)
        await expect(note).to_have_text(
            "1 episode of no principal whose preview holds “glimmerQUARK”."
        )
        # Shared memory: dev's recall finds what the anonymous callers said.
        query = page.get_by_label("Query")
        await query.fill("Glimmerquark Thistlewombat")
        await query.press("Enter")
        section = page.locator("#recall-section")
        await expect(section).to_contain_text("Glimmerquark")
        await watched.shot("12-no-principal-searched")

        # Forget all of them asks first: on Cancel, saying what goes; Escape keeps them.
        forget = page.get_by_role("button", name="Forget all turns of no principal")
        await expect(page.get_by_role("button", name="Forget everything")).to_be_visible()
        await forget.click()
        question = page.get_by_role("group", name="Forget all turns of no principal?")
        await expect(question.get_by_role("button", name="Cancel")).to_be_focused()
        await expect(question).to_contain_text("not only those matching “glimmerQUARK”")
        await expect(question).to_contain_text("and the conversations of no principal.")
        keep = question.get_by_label("Keep the conversations of no principal")
        await expect(keep).not_to_be_checked()
        await watched.shot("13-forget-asks-first")
        await page.keyboard.press("Escape")
        await expect(question).to_have_count(0)
        await expect(forget).to_be_focused()
        await expect(note).to_have_text("Nothing forgotten.")
        kept = await stack.result(DEV, "memory.list", {"anonymous": True})
        assert len(kept["memories"]) == 2

        # Confirmed: both episodes and the anonymous conversation go; the list is reloaded.
        await forget.click()
        await question.get_by_role("button", name="Yes, forget").click()
        await expect(note).to_have_text(
            "Forgot 2 episodes and 1 conversation. No episodes of no principal whose preview"
            " holds “glimmerQUARK”."
        )
        await expect(forget).to_be_focused()
        await search.fill("")
        await search.press("Enter")
        await expect(note).to_have_text("No episodes of no principal.")
        await expect(rows).to_have_count(0)
        await watched.shot("14-no-principal-forgotten")

        # Nothing of them is recalled, stored or in the event feed (once it refreshes: dev's
        # own recalls stay, the anonymous callers' questions go); dev's own episode stays.
        feed = page.locator("#events-table")
        for text in (hamster, statue, fern):
            await expect(feed).not_to_contain_text(text)
        await query.press("Enter")
        await expect(page.locator("#recall-state")).to_have_text(
            "State: disabled — nothing would be injected"
        )
        await expect(section).to_have_text("")
        stored = "\n".join(stack.stored_texts())
        assert "oolong" in stored
        assert all(word not in stored for word in ("Glimmerquark", "Thistlewombat", "Pollendrake"))
        gone = await stack.http.get(f"/v1/conversations/{conversation}")
        assert gone.status_code == 404
        own = await stack.result(DEV, "memory.list", {})
        assert [m["preview"] for m in own["memories"]] == [
            "User: I prefer oolong tea Assistant: reply to: I prefer oolong tea"
        ]
        watched.assert_clean(DEV)
        await context.close()
