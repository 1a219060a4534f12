"""Two tenants on one real daemon (real microVMs, real listeners): tenant B cannot reach
tenant A's sandboxes, sessions, terminals or private previews (HTTP and WebSocket), and a
page on B's preview cannot use A's preview cookie from headless Chromium (issue 10).

The daemon is this module's own: previews under ``preview.example.com``, the documented
server layout in which all previews are same-site, so the browser really does send A's
``SameSite=Lax`` cookie from B's page (see agentbox-cross-tenant.toml). Every refusal is
paired with a control that the same request succeeds for A, so a 404 or 401 cannot come
from a broken route or a dead app.
"""

from __future__ import annotations

import asyncio
import secrets
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import httpx
import pytest

from tests.e2e.conftest import Daemon, running_daemon
from tests.e2e.test_browser import chromium

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).with_name("agentbox-cross-tenant.toml")
APP = Path(__file__).with_name("cross_site_app.py")
DOMAIN = "preview.example.com"
SESSIONS = "sessions.example.com"


@pytest.fixture(scope="module")
def xd(images_built, tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("xtenant") / "data", config=CONFIG) as d:
        yield d


def new_tenant(d: Daemon, name: str) -> str:
    with d.client() as admin:
        r = admin.post("/v1/keys", json={"name": name})
    assert r.status_code == 201 and not r.json()["admin"], r.text
    return r.json()["key"]


class Tenant:
    def __init__(self, d: Daemon, name: str) -> None:
        self.key = new_tenant(d, name)
        self.api = d.client(self.key)
        self.sid = self.token = ""

    def host(self, port: int = 8000) -> str:
        return f"{port}-{self.sid}.{DOMAIN}"


def start_app(t: Tenant, web: httpx.Client) -> None:
    r = t.api.post("/v1/sandboxes", json={"template": "python"})
    assert r.status_code == 201, r.text
    t.sid = r.json()["id"]
    t.token = t.api.get(f"/v1/sandboxes/{t.sid}/preview").json()["preview_token"]
    r = t.api.put(f"/v1/sandboxes/{t.sid}/files", params={"path": "/root/app.py"},
                  content=APP.read_bytes())
    assert r.status_code == 201, r.text
    r = t.api.post(f"/v1/sandboxes/{t.sid}/commands",
                   json={"command": "python3 /root/app.py 8000", "background": True})
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 60
    while True:
        r = web.get("/seen", headers={"Host": t.host(), "X-AgentBox-Token": t.token})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def web(xd):
    with httpx.Client(base_url=xd.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tenants(xd, web):
    a, b = Tenant(xd, "tenant-a"), Tenant(xd, "tenant-b")
    start_app(a, web)
    start_app(b, web)
    yield a, b
    for t in (a, b):
        t.api.delete(f"/v1/sandboxes/{t.sid}")
        t.api.close()


def seen(t: Tenant, web: httpx.Client) -> dict:
    r = web.get("/seen", headers={"Host": t.host(), "X-AgentBox-Token": t.token})
    assert r.status_code == 200, r.text
    return r.json()


def cookie_of(t: Tenant, web: httpx.Client) -> str:
    """``name=value`` of the cookie a browser gets from opening t's preview with ?token=."""
    r = web.get(f"/seen?token={t.token}", headers={"Host": t.host()})
    web.cookies.clear()  # httpx keeps cookies per address (127.0.0.1), not per Host header
    assert r.status_code == 302, r.text
    return r.headers["set-cookie"].split(";")[0]


# -- the API -------------------------------------------------------------------------------

def test_b_cannot_see_or_touch_a_sandbox(tenants):
    a, b = tenants
    sb = f"/v1/sandboxes/{a.sid}"
    calls = [("GET", sb, None), ("DELETE", sb, None), ("PATCH", sb, {"metadata": {"x": 1}}),
             ("POST", f"{sb}/execute", {"command": "id"}), ("GET", f"{sb}/files/etc/hostname",
                                                             None),
             ("POST", f"{sb}/suspend", None), ("GET", f"{sb}/preview", None),
             ("PATCH", f"{sb}/preview", {"public_ports": [8000]}),
             ("POST", f"{sb}/preview-token", None)]
    for method, path, body in calls:
        r = b.api.request(method, path, json=body)
        assert r.status_code == 404, (method, path, r.text)
    assert a.sid not in [s["id"] for s in b.api.get("/v1/sandboxes").json()["sandboxes"]]
    # Control: A can, and nothing B tried took effect.
    r = a.api.post(f"{sb}/execute", json={"command": "echo alive"})
    assert r.status_code == 200 and r.json()["stdout"] == "alive\n", r.text
    view = a.api.get(f"{sb}/preview").json()
    assert view["preview_token"] == a.token and view["public_ports"] == []


def test_b_cannot_open_a_terminal(tenants, xd):
    a, b = tenants

    async def go():
        ws_url = xd.url.replace("http:", "ws:") + f"/v1/sandboxes/{a.sid}/terminal"
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await s.ws_connect(ws_url, headers={"Authorization": f"Bearer {b.key}"})
            assert err.value.status == 404
            # A's own key from a page on B's preview: refused before the upgrade.
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await s.ws_connect(ws_url, headers={"Authorization": f"Bearer {a.key}",
                                                    "Origin": f"http://{b.host()}"})
            assert err.value.status == 403
            async with s.ws_connect(ws_url, headers={"Authorization": f"Bearer {a.key}"}) as ws:
                await ws.send_bytes(b"echo $((40 + 2))\r")
                out = b""
                while b"42" not in out:
                    msg = await asyncio.wait_for(ws.receive(), 60)
                    assert msg.type is aiohttp.WSMsgType.BINARY, msg
                    out += msg.data

    asyncio.run(go())


def test_b_cannot_reach_a_session(tenants, web):
    a, b = tenants
    name = "xt-" + secrets.token_hex(4)
    r = a.api.put(f"/v1/sessions/{name}", json={"start": "python3 -m http.server 8000"})
    assert r.status_code == 201, r.text
    try:
        token, host = r.json()["preview_token"], f"{name}.{SESSIONS}"
        assert b.api.get(f"/v1/sessions/{name}").status_code == 404
        assert name not in [s["name"] for s in b.api.get("/v1/sessions").json()["sessions"]]
        assert b.api.delete(f"/v1/sessions/{name}").status_code == 404
        assert b.api.get(f"/v1/sessions/{name}/proxy/").status_code == 404
        r = b.api.put(f"/v1/sessions/{name}", json={})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_name_taken"
        for headers in ({}, {"X-AgentBox-Token": b.token},
                        {"Authorization": f"Bearer {b.key}"}):
            r = web.get("/", headers={"Host": host, **headers})
            assert r.status_code == 401, (headers, r.text)
        # Controls: A reaches it both ways once the server is up.
        deadline = time.monotonic() + 60
        while (r := web.get("/", headers={"Host": host, "X-AgentBox-Token": token})
               ).status_code == 502 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert r.status_code == 200, r.text
        assert a.api.get(f"/v1/sessions/{name}/proxy/").status_code == 200
    finally:
        a.api.delete(f"/v1/sessions/{name}")


# -- private previews -----------------------------------------------------------------------

def test_b_credentials_open_nothing_on_a_preview(tenants, web):
    a, b = tenants
    b_cookie = cookie_of(b, web)
    b_name, b_value = b_cookie.split("=", 1)
    for headers in ({}, {"X-AgentBox-Token": b.token}, {"Authorization": f"Bearer {b.key}"},
                    {"Cookie": b_cookie},
                    # B's cookie value under A's cookie name (what a planted cookie could be)
                    {"Cookie": f"{cookie_of(a, web).split('=')[0]}={b_value}"}):
        r = web.get("/hit?via=b", headers={"Host": a.host(), **headers})
        assert r.status_code == 401, (headers, r.text)
    r = web.get(f"/hit?via=b&token={b.token}", headers={"Host": a.host()})
    assert r.status_code == 401
    assert not any(h["via"] == "b" for h in seen(a, web)["hits"])
    assert b_name != cookie_of(a, web).split("=")[0]  # one cookie name per host


def test_b_cannot_open_a_preview_websocket(tenants, xd, web):
    a, b = tenants
    a_cookie = cookie_of(a, web)
    ws_url = xd.url.replace("http:", "ws:") + "/ws"
    before = len(seen(a, web)["websockets"])

    async def go():
        async with aiohttp.ClientSession() as s:
            for headers in ({"X-AgentBox-Token": b.token}, {"Cookie": cookie_of(b, web)},
                            # A's own cookie, from a page on B's preview
                            {"Cookie": a_cookie, "Origin": f"http://{b.host()}"}):
                with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                    await s.ws_connect(ws_url, headers={"Host": a.host(), **headers})
                assert err.value.status in (401, 403), headers
            # Control: A's cookie from A's own page.
            async with s.ws_connect(ws_url, headers={"Host": a.host(), "Cookie": a_cookie,
                                                     "Origin": f"http://{a.host()}"}) as ws:
                await ws.send_str("mine")

    asyncio.run(go())
    sockets = seen(a, web)["websockets"][before:]
    assert [w["origin"] for w in sockets] == [f"http://{a.host()}"], sockets


def test_cross_preview_cookie_post_is_refused(tenants, web):
    a, b = tenants
    a_cookie = cookie_of(a, web)
    r = web.post("/hit?via=forged", content=b"x", headers={
        "Host": a.host(), "Cookie": a_cookie, "Origin": f"http://{b.host()}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused"
    r = web.post("/hit?via=own", content=b"x", headers={
        "Host": a.host(), "Cookie": a_cookie, "Origin": f"http://{a.host()}"})
    assert r.status_code == 200
    assert [h["via"] for h in seen(a, web)["hits"] if h["method"] == "POST"
            and h["via"] in ("forged", "own")] == ["own"]


def test_chromium_page_on_b_cannot_use_a_cookie(tenants, xd, web, tmp_path):
    """The browser opens A's preview with ?token= (it now holds A's cookie), is sent on to a
    page served by B's app on B's preview, whose script tries A's preview with that cookie."""
    browser = chromium()
    a, b = tenants
    port = xd.url.rsplit(":", 1)[1]
    victim = f"http://{a.host()}:{port}"
    attack = f"http://{b.host()}:{port}/attack?victim={quote(victim)}&token={b.token}"
    start = f"{victim}/hop?next={quote(attack, safe='')}&token={a.token}"
    before = seen(a, web)
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
         f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1", "--virtual-time-budget=30000",
         "--dump-dom", start],
        capture_output=True, text=True, timeout=180)
    diag = (out.stdout[-2000:], out.stderr[-2000:])
    result = seen(b, web)["result"]
    assert result is not None, diag
    after = seen(a, web)
    new_hits = after["hits"][len(before["hits"]):]
    # The browser did send A's cookie from B's page: the harmless GET got through...
    assert result["own_ws"] == "open" and result["get"] == "sent", (result, diag)
    assert [h["via"] for h in new_hits if h["method"] == "GET"] == ["get"], new_hits
    assert new_hits[0]["origin"] is None or b.host() in new_hits[0]["origin"]
    # ...but neither the WebSocket nor the POST reached A's app.
    assert result["ws"] == "refused", (result, diag)
    assert after["websockets"] == before["websockets"], after["websockets"]
    assert not [h for h in new_hits if h["method"] == "POST"], new_hits


# -- at rest ---------------------------------------------------------------------------------

def test_daemon_files_are_private(xd, tenants):
    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(xd.data_dir) == 0o700
    assert mode(xd.data_dir / "admin.key") == 0o600
    for suffix in ("", "-wal", "-shm"):
        path = xd.data_dir / f"registry.sqlite{suffix}"
        assert path.exists() and mode(path) == 0o600, (path, oct(mode(path)))
