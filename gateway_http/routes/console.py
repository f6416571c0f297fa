"""The operator console: static files shipped inside this package, served at ``/console``.

The page (``gateway_http/console/``: one HTML file, one script, one style sheet and its icon)
needs no build step and loads nothing from elsewhere; it signs in with a JWT and talks to the same
JSON-RPC methods any client uses (``POST /api/rpc``), so this router serves files and
nothing else. Every response carries a Content-Security-Policy that allows only this
origin's own script, style and ``fetch`` (no inline script, no form submission, no framing).
An unknown asset is a 404 with the usual JSON error body. ``/favicon.ico``, which browsers
ask for on their own, answers the console's icon (``favicon.svg`` rendered at 32 and 16 px by
``scripts/console_favicon.py``) rather than a 404.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from gateway_http.errors import ErrorKind, GatewayError

CONSOLE_PATH = "/console"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Small files: always revalidated, so an upgraded gateway never runs yesterday's script.
    "Cache-Control": "no-cache",
}

# The only files served: a name not in this table is a 404 (no path is ever built from input).
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
    "favicon.ico": "image/x-icon",
}


@cache
def _asset(name: str) -> bytes:
    return (resources.files("gateway_http") / "console" / name).read_bytes()


def _serve(name: str) -> Response:
    return Response(_asset(name), media_type=ASSETS[name], headers=_HEADERS)


router = APIRouter()


@router.get(CONSOLE_PATH, include_in_schema=False)
@router.get(CONSOLE_PATH + "/", include_in_schema=False)
async def console_page() -> Response:
    return _serve("index.html")


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    return _serve("favicon.ico")


@router.get(CONSOLE_PATH + "/{name:path}", include_in_schema=False)
async def console_asset(name: str) -> Response:
    if name not in ASSETS:
        raise GatewayError(ErrorKind.NOT_FOUND, "no such console file", "not_found")
    return _serve(name)
