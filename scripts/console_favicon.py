"""Render the console's icon, ``favicon.svg``, into ``favicon.ico`` (32 and 16 px PNGs).

Browsers ask for ``/favicon.ico`` on their own; the gateway answers it with this file. The
SVG is the source: after changing it, run ``.venv/bin/python scripts/console_favicon.py``
(Debian's ``/usr/bin/chromium`` draws it, through Playwright) and commit both files.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from pathlib import Path

from playwright.async_api import async_playwright

CONSOLE = Path(__file__).resolve().parent.parent / "gateway_http" / "console"
SIZES = (32, 16)


async def render(svg: bytes) -> list[tuple[int, bytes]]:
    source = "data:image/svg+xml;base64," + base64.b64encode(svg).decode()
    pngs = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--no-sandbox"]
        )
        for size in SIZES:
            page = await browser.new_page(viewport={"width": size, "height": size})
            await page.set_content(
                '<body style="margin:0">'
                f'<img src="{source}" width="{size}" height="{size}" style="display:block">'
            )
            await page.wait_for_function("document.images[0].naturalWidth > 0")
            pngs.append((size, await page.screenshot(omit_background=True)))
        await browser.close()
    return pngs


def ico(pngs: list[tuple[int, bytes]]) -> bytes:
    """An ICO file holding PNG images (every browser reads them)."""
    directory = struct.pack("<HHH", 0, 1, len(pngs))
    offset = 6 + 16 * len(pngs)
    images = b""
    for size, png in pngs:
        directory += struct.pack(
            "<BBBBHHII", size, size, 0, 0, 1, 32, len(png), offset + len(images)
        )
        images += png
    return directory + images


def main() -> None:
    pngs = asyncio.run(render((CONSOLE / "favicon.svg").read_bytes()))
    (CONSOLE / "favicon.ico").write_bytes(ico(pngs))


if __name__ == "__main__":
    main()
