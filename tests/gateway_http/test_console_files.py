"""The console's files as the app serves them: headers, 404s, and what the files may not do.

In process (no lifespan needed: the console router serves package files and nothing else).
The page's behaviour in a real browser is in ``tests/e2e/test_console_browser.py``.
"""

from __future__ import annotations

import fnmatch
import re
import struct
import tomllib
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from arona_grpc.config import Settings
from gateway_http.app import create_app
from gateway_http.routes.console import ASSETS

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_DIR = resources.files("gateway_http") / "console"
TEXT_ASSETS = [name for name in ASSETS if not name.endswith(".ico")]
# The one URL an SVG file must carry: its namespace, a name that is never fetched.
SVG_NAMESPACE_URI = "http://www.w3.org/2000/svg"
SVG_NAMESPACE = f'xmlns="{SVG_NAMESPACE_URI}"'


@pytest_asyncio.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(data_dir=tmp_path))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


def _text(name: str) -> str:
    return (CONSOLE_DIR / name).read_text(encoding="utf-8")


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/console", "/console/", "/console/index.html"])
async def test_the_page_is_served_with_a_strict_policy(http: httpx.AsyncClient, path: str) -> None:
    response = await http.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "script-src 'self'" in policy and "form-action 'none'" in policy
    assert "unsafe" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert "<title>Arona console</title>" in response.text


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "media_type"),
    [
        ("console.js", "text/javascript"),
        ("console.css", "text/css"),
        ("favicon.svg", "image/svg+xml"),
        ("favicon.ico", "image/x-icon"),
    ],
)
async def test_assets_are_served_with_their_type(
    http: httpx.AsyncClient, name: str, media_type: str
) -> None:
    response = await http.get(f"/console/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(media_type)
    assert "content-security-policy" in response.headers
    assert response.content == (CONSOLE_DIR / name).read_bytes()


@pytest.mark.asyncio
async def test_the_browsers_own_favicon_request_gets_the_icon(http: httpx.AsyncClient) -> None:
    response = await http.get("/favicon.ico")
    assert response.status_code == 200
    assert response.headers["content-type"] == "image/x-icon"
    icon = response.content
    assert icon == (CONSOLE_DIR / "favicon.ico").read_bytes()
    # An ICO directory of PNG images, 32 and 16 px, and small.
    reserved, kind, count = struct.unpack("<HHH", icon[:6])
    assert (reserved, kind) == (0, 1)
    sizes = []
    for i in range(count):
        width, _, _, _, _, _, length, offset = struct.unpack(
            "<BBBBHHII", icon[6 + 16 * i : 22 + 16 * i]
        )
        assert icon[offset : offset + 8] == b"\x89PNG\r\n\x1a\n"
        assert offset + length <= len(icon)
        sizes.append(width)
    assert sizes == [32, 16]
    assert len(icon) < 4096


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "path",
    [
        "/console/nope.js",
        "/console/../app.py",
        "/console/%2e%2e/app.py",
        "/console/console/index.html",
        "/console/INDEX.HTML",
        "/console/console.js/",
    ],
)
async def test_an_unknown_console_file_is_a_json_404(http: httpx.AsyncClient, path: str) -> None:
    response = await http.get(path)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert "error" in response.json()


@pytest.mark.asyncio
async def test_a_post_to_the_console_is_not_a_server_error(http: httpx.AsyncClient) -> None:
    response = await http.post("/console", content=b"token=abc")
    assert response.status_code == 405
    assert "error" in response.json()


def test_every_file_is_served_and_shipped_in_the_package() -> None:
    on_disk = {entry.name for entry in CONSOLE_DIR.iterdir() if entry.is_file()}
    assert on_disk == set(ASSETS)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["gateway_http"]
    for name in ASSETS:
        assert any(fnmatch.fnmatch(f"console/{name}", p) for p in patterns), name


def test_no_inline_script_or_style_and_nothing_from_elsewhere() -> None:
    page = _text("index.html")
    for script in re.findall(r"<script\b[^>]*>(.*?)</script>", page, flags=re.S):
        assert script.strip() == ""
    assert all("src=" in tag for tag in re.findall(r"<script\b[^>]*>", page))
    assert "<style" not in page and " style=" not in page
    # No inline event handlers (onclick=…): the policy would block them anyway.
    assert not re.search(r"\son[a-z]+\s*=", page)
    assert '<link rel="icon" href="/console/favicon.svg"' in page
    for name in TEXT_ASSETS:
        # The SVG namespace is a name, never fetched: the icon declares it, the script makes
        # the usage chart's elements in it.
        text = _text(name).replace(SVG_NAMESPACE, "").replace(f'"{SVG_NAMESPACE_URI}"', "")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, flags=re.I), name
        assert "@import" not in text and "url(" not in text
    icon = _text("favicon.svg")
    assert icon.startswith("<svg " + SVG_NAMESPACE)
    assert "<script" not in icon and "href" not in icon


def test_the_token_never_goes_into_a_url_or_a_log() -> None:
    script = _text("console.js")
    assert "?token" not in script and "token=" not in script
    assert "console.log" not in script and "localStorage" not in script
    assert "sessionStorage" in script
    assert "innerHTML" not in script
    page = _text("index.html")
    form = re.search(r'<form id="sign-in-form"[^>]*>', page)
    assert form is not None and 'method="post"' in form.group(0)
    assert 'type="password"' in page
