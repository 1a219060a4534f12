"""Preview hosts against hostile browsers and guests, in-process (the real middlewares,
proxy and routes against an app on loopback; no VMs): Origin on cookie-only WebSockets
and unsafe methods, per-host cookie names that a sibling cannot shadow, Secure over
https, a redirect that stays on the host, the agent port refused everywhere, and a
terminal that guest pages cannot open."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from gateway.preview import hosts, terminal
from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.config import Config, ServerConfig
from gateway.sandbox.states import State
from gateway.http.middleware import (
    REGISTRY_KEY,
    api_error_middleware,
    auth_middleware,
    error_middleware,
)
from gateway.preview.access import ACCESS_KEY, cookie_name
from gateway.store.registry import Registry, SandboxRecord
from guest.protocol import AGENT_PORT
from tests.unit.fastlane_server import FastTestServer
from tests.unit.test_proxy import SEEN, SID, FakeService, upstream_app

OTHER = "fedcba9876543210"  # another tenant's sandbox


async def make_env(tmp_path, aiohttp_server, aiohttp_client, **server):
    up = await aiohttp_server(await upstream_app())
    registry = Registry(tmp_path / "r.sqlite")
    a, a_secret = registry.create_key("a")
    b, b_secret = registry.create_key("b")
    now = time.time()
    for sid, tenant in ((SID, a.id), (OTHER, b.id)):
        registry.insert_sandbox(SandboxRecord(
            id=sid, tenant=tenant, template="python", state=State.RUNNING, slot=0, root="/x",
            golden="/g", idle_timeout=0, host="h", created_at=now, updated_at=now,
            last_activity=now))
    config = Config(server=ServerConfig(proxy_read_timeout=1.0, **server))
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       hosts.preview_middleware, auth_middleware])
    app[SERVICE_KEY] = FakeService(registry, config)  # type: ignore[assignment]
    app[REGISTRY_KEY] = registry
    app.add_routes(terminal.routes)
    hosts.setup(app, config)
    client = await aiohttp_client(FastTestServer(app), auto_decompress=False)  # the front lane
    host = f"{up.port}-{SID}.localhost"
    return SimpleNamespace(
        client=client, up=up, host=host, token=client.app[ACCESS_KEY].get(SID).token,
        registry=registry, a_key=a_secret, b_key=b_secret, a=a,
        sibling=f"{up.port}-{OTHER}.localhost")


@pytest.fixture
async def env(tmp_path, aiohttp_server, aiohttp_client):
    e = await make_env(tmp_path, aiohttp_server, aiohttp_client)
    yield e
    e.registry.close()
    await asyncio.sleep(0.05)  # the upstream app records our sockets' closes in SEEN...
    SEEN.clear()  # ...which test_proxy reads: leave it empty


async def cookie_for(env, host=None) -> str:
    """``name=value`` of the cookie a browser gets from ``?token=`` on ``host``."""
    r = await env.client.get(f"/?token={env.token}", headers={"Host": host or env.host},
                             allow_redirects=False)
    assert r.status == 302, await r.text()
    env.client.session.cookie_jar.clear()
    return r.headers["Set-Cookie"].split(";")[0]


async def error_code(r) -> str:
    return (await r.json())["error"]["code"]


# -- Origin ------------------------------------------------------------------------------

async def test_cookie_websocket_from_a_sibling_preview_is_refused(env):
    cookie = await cookie_for(env)
    headers = {"Host": env.host, "Cookie": cookie}
    for origin in (f"http://{env.sibling}:8080", "null", "http://localhost:8080"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await env.client.ws_connect("/ws", headers={**headers, "Origin": origin})
        assert err.value.status == 403, origin
    r = await env.client.get("/ws", headers={**headers, "Origin": f"http://{env.sibling}",
                                             "Connection": "Upgrade", "Upgrade": "websocket",
                                             "Sec-WebSocket-Version": "13",
                                             "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert r.status == 403 and await error_code(r) == "cross_origin_refused"


async def test_cookie_websocket_from_its_own_page_or_a_program_works(env):
    cookie = await cookie_for(env)
    for extra in ({"Origin": f"http://{env.host}:8080"}, {}):
        async with env.client.ws_connect("/ws", headers={"Host": env.host, "Cookie": cookie,
                                                         **extra}) as ws:
            await ws.send_str("hi")
            assert (await ws.receive()).data == ":hi"


async def test_token_authorised_websockets_need_no_origin(env):
    foreign = {"Host": env.host, "Origin": f"http://{env.sibling}"}
    async with env.client.ws_connect("/ws", headers={**foreign, "X-AgentBox-Token": env.token}):
        pass
    async with env.client.ws_connect(f"/ws?token={env.token}", headers=foreign):
        pass


async def test_cookie_unsafe_methods_need_their_own_origin(env):
    cookie = await cookie_for(env)
    base = {"Host": env.host, "Cookie": cookie}
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        r = await env.client.request(method, "/echo", data=b"x",
                                     headers={**base, "Origin": f"http://{env.sibling}:8080"})
        assert r.status == 403 and await error_code(r) == "cross_origin_refused", method
    r = await env.client.post("/echo", data=b"x", headers={**base, "Origin": "null"})
    assert r.status == 403
    r = await env.client.post("/echo", data=b"x", headers={**base, "Origin": f"http://{env.host}"})
    assert r.status == 200 and (await r.json())["size"] == 1
    r = await env.client.post("/echo", data=b"x", headers=base)  # no Origin: a program
    assert r.status == 200
    # Safe methods are not checked (the browser cannot read a cross-origin answer).
    r = await env.client.get("/echo", headers={**base, "Origin": f"http://{env.sibling}"})
    assert r.status == 200
    # The token header is not ambient: no Origin check.
    r = await env.client.post("/echo", data=b"x", headers={
        "Host": env.host, "X-AgentBox-Token": env.token, "Origin": f"http://{env.sibling}"})
    assert r.status == 200


async def test_a_form_post_gets_a_page_with_the_code(env):
    cookie = await cookie_for(env)
    r = await env.client.post("/echo", data={"a": "1"}, headers={
        "Host": env.host, "Cookie": cookie, "Origin": f"http://{env.sibling}",
        "Accept": "text/html"})
    assert r.status == 403 and "cross_origin_refused" in await r.text()


# -- cookies -----------------------------------------------------------------------------

async def test_cookie_names_differ_per_host_and_a_planted_one_cannot_shadow_ours(env):
    cookie = await cookie_for(env)
    name = cookie.split("=")[0]
    assert name == cookie_name(env.host, secure=False)
    sibling = await cookie_for(env, f"{env.up.port + 1}-{SID}.localhost")
    assert sibling.split("=")[0] != name
    # A guest on a sibling host set junk under our name for the parent domain; browsers send
    # it first (longer path, or older). Ours still works; junk alone does not.
    r = await env.client.get("/echo", headers={"Host": env.host,
                                               "Cookie": f"{name}=junk; {cookie}"})
    assert r.status == 200
    assert "Cookie" not in (await r.json())["headers"]  # neither reaches the app
    r = await env.client.get("/echo", headers={"Host": env.host, "Cookie": f"{name}=junk"})
    assert r.status == 401


async def test_the_old_shared_cookie_name_opens_nothing(env):
    value = (await cookie_for(env)).split("=", 1)[1]
    r = await env.client.get("/echo", headers={"Host": env.host,
                                               "Cookie": f"agentbox_preview={value}"})
    assert r.status == 401


async def test_secure_and_host_prefix_when_public_scheme_is_https(tmp_path, aiohttp_server,
                                                                  aiohttp_client):
    env = await make_env(tmp_path, aiohttp_server, aiohttp_client, public_scheme="https")
    try:
        r = await env.client.get(f"/p?token={env.token}", headers={"Host": env.host},
                                 allow_redirects=False)
        set_cookie = r.headers["Set-Cookie"]
        assert r.status == 302 and set_cookie.startswith("__Host-agentbox_preview_")
        assert "; Secure" in set_cookie and "Domain" not in set_cookie
        env.client.session.cookie_jar.clear()
        r = await env.client.get("/echo", headers={"Host": env.host,
                                                   "Cookie": set_cookie.split(";")[0]})
        assert r.status == 200
    finally:
        env.registry.close()


# -- redirect ----------------------------------------------------------------------------

async def raw_get(env, target: str) -> tuple[int, dict[str, str]]:
    reader, writer = await asyncio.open_connection(env.client.host, env.client.port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: {env.host}\r\nConnection: close\r\n\r\n"
                 .encode("latin-1"))
    raw = await reader.read()
    writer.close()
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    return int(head[0].split()[1]), headers


@pytest.mark.parametrize("target, location", [
    ("//evil.com/x?token={t}", "/evil.com/x"),
    ("///evil.com/?a=1&token={t}", "/evil.com/?a=1"),
    ("/\\evil.com/?token={t}", "/%5Cevil.com/"),
    ("/%2F%2Fevil.com?token={t}", "/%2F%2Fevil.com"),
    ("/ok/path?token={t}&b=2", "/ok/path?b=2"),
])
async def test_token_redirect_stays_on_the_host(env, target, location):
    status, headers = await raw_get(env, target.format(t=env.token))
    assert status == 302 and headers["location"] == location
    assert headers["set-cookie"].startswith(cookie_name(env.host, False) + "=")


# -- the agent port ----------------------------------------------------------------------

def insert_session(env, name: str, port: int, sandbox_id: str = SID) -> None:
    now = time.time()
    assert env.registry.insert_session({"name": name, "tenant": env.a.id, "port": port,
                                        "start": None, "metadata": {}, "created_at": now,
                                        "updated_at": now})
    env.registry.update_session(name, sandbox_id=sandbox_id)


async def test_agent_port_is_refused_where_a_port_is_accepted(env):
    api = {"Authorization": f"Bearer {env.a_key}"}
    r = await env.client.put("/v1/sessions/s1", json={"port": AGENT_PORT}, headers=api)
    assert r.status == 400 and await error_code(r) == "port_reserved"
    r = await env.client.patch(f"/v1/sandboxes/{SID}/preview",
                               json={"public_ports": [AGENT_PORT]}, headers=api)
    assert r.status == 400 and await error_code(r) == "port_reserved"
    assert env.registry.get_session("s1") is None


async def test_agent_port_is_refused_by_the_session_path_proxy(env):
    # A session row naming the agent port (written before PUT refused it): not proxied.
    insert_session(env, "legacy", AGENT_PORT)
    r = await env.client.get("/v1/sessions/legacy/proxy/x",
                             headers={"Authorization": f"Bearer {env.a_key}"})
    assert r.status == 403 and await error_code(r) == "port_reserved"


async def test_agent_port_is_refused_on_preview_and_session_hosts(env):
    r = await env.client.get("/", headers={"Host": f"{AGENT_PORT}-{SID}.localhost",
                                           "X-AgentBox-Token": env.token})
    assert r.status == 403 and await error_code(r) == "port_reserved"
    insert_session(env, "legacy", AGENT_PORT)
    r = await env.client.get("/x", headers={"Host": "legacy.sessions.localhost",
                                            "X-AgentBox-Token": env.token})
    assert r.status == 403 and await error_code(r) == "port_reserved"


async def test_session_on_an_ordinary_port_still_proxies(env):
    insert_session(env, "fine", env.up.port)
    r = await env.client.get("/v1/sessions/fine/proxy/echo/q",
                             headers={"Authorization": f"Bearer {env.a_key}"})
    assert r.status == 200 and (await r.json())["path_qs"] == "/echo/q"


# -- the terminal ------------------------------------------------------------------------

async def test_terminal_refuses_pages_on_preview_and_session_hosts(env, monkeypatch):
    opened = []

    async def fake_open_terminal(machine, cols, rows, cmd, **_):
        opened.append(cmd)
        raise web.HTTPServiceUnavailable()  # stop here: only whether we got this far matters

    monkeypatch.setattr(terminal.guest, "open_terminal", fake_open_terminal)
    api = {"Authorization": f"Bearer {env.a_key}"}
    for origin in (f"http://{env.host}:8080", "http://fine.sessions.localhost"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await env.client.ws_connect(f"/v1/sandboxes/{SID}/terminal",
                                        headers={**api, "Origin": origin})
        assert err.value.status == 403
    assert opened == []
    for extra in ({}, {"Origin": "http://app.example.com"}):  # programs; a UI's backend
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await env.client.ws_connect(f"/v1/sandboxes/{SID}/terminal",
                                        headers={**api, **extra})
        assert err.value.status == 503
    assert len(opened) == 2
