"""A real headless Chromium for browser tests: Debian's ``chromium``, driven by Playwright.

The browser is the system package at :data:`CHROMIUM` (``make test`` installs it with apt
when it is missing, through ``scripts/system-deps.sh``); Playwright's own browser downloads are
never used. Without it a test is skipped with the reason, except under ``CI=true``, where a
missing browser fails the test instead of letting the browser tests vanish quietly.

Screenshots go to :func:`artifact_dir` (``tests/artifacts/<name>/``, not committed).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, async_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def require_chromium() -> Path:
    """The browser's path; skip the test without it (fail under ``CI=true``)."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    reason = f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser tests cannot run: {reason}")
    pytest.skip(reason)


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """A headless Debian Chromium, closed on exit."""
    path = require_chromium()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(path), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser
        finally:
            await browser.close()


def artifact_dir(name: str) -> Path:
    """``tests/artifacts/<name>/``, created (and printed, so a run says where to look)."""
    path = ARTIFACTS / name
    path.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {path}")
    return path
