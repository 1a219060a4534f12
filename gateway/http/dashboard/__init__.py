"""The dashboard: static files served at ``/dashboard``, a browser client of the REST API.

Nothing here reads data: the page (``static/``, plain HTML, CSS and ES modules, no build
step, no CDN) signs in with an API key kept in ``sessionStorage`` and calls ``/v1/...``
with it in the ``Authorization`` header, like any client. There is no cookie, so a
cross-site request carries no credentials (CSRF-proof by construction), and the key never
appears in a URL. Every response here carries a strict Content-Security-Policy (only this
origin's scripts, no inline script or eval, no framing), so even a string the page failed
to escape could not run; the page renders data with ``textContent`` only.

The files are read once, when the app is built; a name outside the directory's listing is
a 404 (no path is ever joined from the request).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(directory: Path = STATIC_DIR) -> dict[str, Asset]:
    """Every servable file of ``directory`` (flat), by name."""
    assets = {}
    for path in sorted(directory.iterdir()):
        kind = TYPES.get(path.suffix)
        if kind is None or not path.is_file():
            continue
        body = path.read_bytes()
        assets[path.name] = Asset(body, kind, '"' + hashlib.sha256(body).hexdigest()[:16] + '"')
    return assets


ASSETS_KEY = web.AppKey("dashboard_assets", dict)


def _answer(request: web.Request, name: str) -> web.Response:
    asset = request.app[ASSETS_KEY].get(name)
    if asset is None:
        raise web.HTTPNotFound(reason="no such dashboard file")
    headers = {**SECURITY_HEADERS, "ETag": asset.etag, "Cache-Control": "no-cache"}
    if request.headers.get("If-None-Match") == asset.etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})


async def index(request: web.Request) -> web.Response:
    return _answer(request, "index.html")


async def asset(request: web.Request) -> web.Response:
    return _answer(request, request.match_info["name"])


async def slash(request: web.Request) -> web.Response:
    raise web.HTTPFound("/dashboard")


def setup(app: web.Application, directory: Path = STATIC_DIR) -> None:
    app[ASSETS_KEY] = load_assets(directory)
    app.router.add_get("/dashboard", index)
    app.router.add_get("/dashboard/", slash)
    app.router.add_get("/dashboard/{name}", asset)
