"""The dashboard's server side: its static files (served without a key, with a strict
CSP, nothing else reachable), GET /v1/events (authenticated, tenant-scoped, live), and the
WebSocket subprotocol a browser presents its key with."""

from __future__ import annotations

import asyncio
import json
import re
from html.parser import HTMLParser

import pytest
from aiohttp import web

from gateway.http import dashboard, events_routes
from gateway.http.middleware import (REGISTRY_KEY, api_error_middleware, auth_middleware,
                                     current_key)
from gateway.preview import terminal
from gateway.store.registry import Registry
from tests.unit import dashboard_env

STATIC = dashboard.STATIC_DIR


@pytest.fixture
async def env(tmp_path, aiohttp_client):
    app, registry, admin = dashboard_env.build(tmp_path)
    client = await aiohttp_client(app)
    yield client, registry, {"Authorization": f"Bearer {admin}"}
    registry.close()


async def test_the_page_and_its_files_are_served_without_a_key_under_a_strict_csp(env):
    client, _, _ = env
    for path, kind in (("/dashboard", "text/html"), ("/dashboard/app.js", "text/javascript"),
                       ("/dashboard/style.css", "text/css")):
        resp = await client.get(path)
        assert resp.status == 200, path
        assert resp.content_type == kind
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "script-src 'self';" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert "Set-Cookie" not in resp.headers
    etag = (await client.get("/dashboard/app.js")).headers["ETag"]
    again = await client.get("/dashboard/app.js", headers={"If-None-Match": etag})
    assert again.status == 304 and "Content-Security-Policy" in again.headers


@pytest.mark.parametrize("path", ["/dashboard/nope.js", "/dashboard/..%2Fpyproject.toml",
                                  "/dashboard/../__init__.py", "/dashboard/__init__.py",
                                  "/dashboard/static", "/dashboard/%2e%2e/app.js"])
async def test_nothing_but_the_listed_files_is_reachable(env, path):
    client, _, _ = env
    resp = await client.get(path)
    assert resp.status in (401, 404), (path, resp.status)
    assert b"import " not in await resp.read()


async def test_a_trailing_slash_redirects_to_the_page(env):
    client, _, _ = env
    resp = await client.get("/dashboard/", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/dashboard"


def test_every_static_file_is_shipped_in_the_package():
    """pyproject's package-data globs cover every file the page loads."""
    import tomllib
    from pathlib import Path

    data = tomllib.loads(Path("pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["gateway.http.dashboard"]
    files = {p.name for p in STATIC.iterdir()}
    shipped = {p.name for g in globs for p in STATIC.parent.glob(g)}
    assert files == shipped == set(dashboard.load_assets())


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict] = []
        self.handlers: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self.scripts.append(attrs)
        self.handlers += [a for a in attrs if a.startswith("on")]


def test_the_page_has_no_inline_script_and_the_scripts_no_html_sinks():
    page = _Page()
    page.feed((STATIC / "index.html").read_text())
    assert page.scripts and all(s.get("src", "").startswith("/dashboard/") for s in page.scripts)
    assert not page.handlers
    sinks = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|"
                       r"new Function|setTimeout\(\s*[\"'`]")
    for js in STATIC.glob("*.js"):
        found = sinks.findall(js.read_text())
        assert not found, (js.name, found)
        # the key is kept per tab only, never where other tabs or requests would carry it
        assert not re.search(r"localStorage\.|document\.cookie", js.read_text()), js.name


async def _read_events(resp, count: int) -> list[tuple[str, dict]]:
    out, event = [], None
    while len(out) < count:
        line = (await asyncio.wait_for(resp.content.readline(), 5)).decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((event, json.loads(line[len("data: "):])))
    return out


async def test_events_need_a_key(env):
    client, _, _ = env
    resp = await client.get("/v1/events")
    assert resp.status == 401


async def test_events_follow_transitions_scoped_to_the_key(env):
    client, registry, admin = env
    _, alice_secret = registry.create_key("alice")
    _, bob_secret = registry.create_key("bob")
    alice = {"Authorization": f"Bearer {alice_secret}"}
    bob = {"Authorization": f"Bearer {bob_secret}"}
    streams = {}
    for name, auth in (("alice", alice), ("bob", bob), ("admin", admin)):
        resp = await client.get("/v1/events", headers=auth)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-store"
        assert await _read_events(resp, 1) == [("ready", {})]
        streams[name] = resp
    created = await (await client.post("/v1/sandboxes", json={}, headers=alice)).json()
    suspended = await client.post(f"/v1/sandboxes/{created['id']}/suspend", headers=alice)
    assert suspended.status == 200
    seen = await _read_events(streams["alice"], 4)
    assert [(e, d["from"], d["to"]) for e, d in seen] == [
        ("transition", None, "creating"), ("transition", "creating", "running"),
        ("transition", "running", "suspending"), ("transition", "suspending", "suspended")]
    assert {d["sandbox_id"] for _, d in seen} == {created["id"]}
    assert seen[2][1]["cause"] == "requested by API" and seen[0][1]["tenant"] != ""
    assert [d["seq"] for _, d in seen] == sorted(d["seq"] for _, d in seen)
    assert await _read_events(streams["admin"], 4) == seen  # an admin key sees every key's
    await (await client.post("/v1/sandboxes", json={}, headers=bob)).read()
    bobs = await _read_events(streams["bob"], 1)  # bob's stream skipped alice's four
    assert bobs[0][1]["from"] is None and bobs[0][1]["sandbox_id"] != created["id"]
    for resp in streams.values():
        resp.close()


async def test_a_key_may_hold_a_few_streams_and_leaving_frees_them(env):
    client, _, admin = env
    feed = client.app[events_routes.FEED_KEY]
    streams = [await client.get("/v1/events", headers=admin) for _ in range(4)]
    assert all(s.status == 200 for s in streams)
    over = await client.get("/v1/events", headers=admin)
    assert over.status == 429 and "Retry-After" in over.headers
    for s in streams:
        s.close()
    for _ in range(100):
        if len(feed) == 0:
            break
        await asyncio.sleep(0.01)
    assert len(feed) == 0  # the handlers closed their subscriptions when the clients left
    again = await client.get("/v1/events", headers=admin)
    assert again.status == 200
    again.close()


async def test_shutdown_ends_the_streams(env):
    client, _, admin = env
    resp = await client.get("/v1/events", headers=admin)
    await _read_events(resp, 1)
    client.app[events_routes.FEED_KEY].close()
    rest = await asyncio.wait_for(resp.content.read(), 5)  # the stream ends
    assert b"transition" not in rest


async def test_a_dropped_stream_says_so(env):
    client, registry, admin = env
    feed = client.app[events_routes.FEED_KEY]
    resp = await client.get("/v1/events", headers=admin)
    await _read_events(resp, 1)
    (sub,) = feed._subs
    sub.dropped = True
    sub._end()
    rest = (await asyncio.wait_for(resp.content.read(), 5)).decode()
    assert "event: dropped" in rest


# -- the terminal's WebSocket: the key as a subprotocol ----------------------------------

@pytest.fixture
async def ws_app(tmp_path, aiohttp_client):
    registry = Registry(tmp_path / "r.sqlite")
    key, secret = registry.create_key("alice")

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(terminal.SUBPROTOCOL,))
        await ws.prepare(request)
        await ws.send_str(current_key(request).id)
        await ws.close()
        return ws

    app = web.Application(middlewares=[api_error_middleware, auth_middleware])
    app[REGISTRY_KEY] = registry
    app.router.add_get("/v1/sandboxes/{id}/terminal", handler)
    app.router.add_get("/v1/sessions/{name}/proxy", handler)
    yield await aiohttp_client(app), key, secret
    registry.close()


async def test_a_browser_presents_its_key_as_a_websocket_subprotocol(ws_app):
    client, key, secret = ws_app
    ws = await client.ws_connect("/v1/sandboxes/sb1/terminal",
                                 protocols=("agentbox.terminal", f"agentbox.key.{secret}"))
    assert ws.protocol == "agentbox.terminal"  # the key is never echoed back
    assert (await ws.receive_str()) == key.id
    await ws.close()


@pytest.mark.parametrize("path, protocols, upgrade", [
    ("/v1/sandboxes/sb1/terminal", ("agentbox.terminal", "agentbox.key.ab_wrong"), True),
    ("/v1/sandboxes/sb1/terminal", ("agentbox.terminal", "agentbox.key."), True),
    ("/v1/sandboxes/sb1/terminal", ("agentbox.terminal",), True),
    ("/v1/sandboxes/sb1/terminal", ("agentbox.terminal", "agentbox.key.SECRET"), False),
    # a proxied WebSocket would hand its subprotocols to the guest app: never a key there
    ("/v1/sessions/s/proxy", ("agentbox.terminal", "agentbox.key.SECRET"), True),
])
async def test_the_subprotocol_key_is_checked_and_only_for_the_terminal(ws_app, path, protocols,
                                                                        upgrade):
    client, _, secret = ws_app
    protocols = tuple(p.replace("SECRET", secret) for p in protocols)
    headers = {"Sec-WebSocket-Protocol": ", ".join(protocols)}
    if upgrade:
        headers |= {"Upgrade": "websocket", "Connection": "Upgrade",
                    "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    resp = await client.get(path, headers=headers)
    assert resp.status == 401


async def test_a_client_leaving_ends_its_stream_quietly(tmp_path, monkeypatch, caplog):
    """The next write (here a heartbeat) finds the connection gone: the handler returns,
    frees its subscription, and nothing is logged as an error. (A server without handler
    cancellation, so the write, not a cancel, is what meets the closed connection.)"""
    import aiohttp

    monkeypatch.setattr(events_routes, "HEARTBEAT", 0.01)
    app, registry, admin = dashboard_env.build(tmp_path)
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    feed = app[events_routes.FEED_KEY]
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.get(f"http://127.0.0.1:{port}/v1/events",
                                     headers={"Authorization": f"Bearer {admin}"})
            await _read_events(resp, 1)
            resp.close()
        for _ in range(200):
            if len(feed) == 0:
                break
            await asyncio.sleep(0.01)
        assert len(feed) == 0
        await asyncio.sleep(0.05)
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        await runner.cleanup()
        registry.close()


async def test_ports_lists_what_listens_in_the_guest_sorted_and_per_the_spec(env, monkeypatch):
    """GET /v1/sandboxes/{id}/ports (the dashboard's preview links), guest faked."""
    from gateway.sandbox import guest
    from guest.protocol import PortInfo
    from tests.contract import check_answer

    client, registry, admin = env
    asked = []

    async def fake_list_ports(machine):
        asked.append(machine.require_agent())
        return [PortInfo(8123, ["0.0.0.0"]), PortInfo(3000, ["127.0.0.1"], forwarded=True)]

    monkeypatch.setattr(guest, "list_ports", fake_list_ports)
    sb = await (await client.post("/v1/sandboxes", json={}, headers=admin)).json()
    service = client.app[dashboard_env.sandbox_routes.SERVICE_KEY]
    service._controllers[sb["id"]].machine.require_agent = lambda: "the agent"
    resp = await client.get(f"/v1/sandboxes/{sb['id']}/ports", headers=admin)
    body = await resp.json()
    assert resp.status == 200 and asked == ["the agent"]
    check_answer("GET", "/v1/sandboxes/{id}/ports", 200, body, resp.content_type)
    assert body == {"ports": [{"port": 3000, "addresses": ["127.0.0.1"], "forwarded": True},
                              {"port": 8123, "addresses": ["0.0.0.0"], "forwarded": False}]}
    _, other = registry.create_key("other")
    resp = await client.get(f"/v1/sandboxes/{sb['id']}/ports",
                            headers={"Authorization": f"Bearer {other}"})
    assert resp.status == 404 and len(asked) == 1  # another key's sandbox: never asked
