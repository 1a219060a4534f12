"""Preview URLs through the real daemon to apps inside real microVMs (issue 4).

Requests go to the daemon on 127.0.0.1 with the Host header of the preview URL
(``{port}-{id}.localhost``), as a browser resolving ``*.localhost`` would send them.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest

pytestmark = pytest.mark.e2e

APP = Path(__file__).with_name("preview_app.py")


def host_for(sid: str, port: int) -> str:
    return f"{port}-{sid}.localhost"


def preview_token(api, sid: str) -> str:
    r = api.get(f"/v1/sandboxes/{sid}/preview")
    assert r.status_code == 200, r.text
    return r.json()["preview_token"]


def start_background(api, sid: str, command: str) -> int:
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"command": command, "background": True})
    assert r.status_code == 201, r.text
    return r.json()["pid"]


def start_app(api, sid: str, port: int = 8000, bind: str = "0.0.0.0") -> None:
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/preview_app.py"},
                content=APP.read_bytes())
    assert r.status_code == 201, r.text
    start_background(api, sid, f"python3 /root/preview_app.py {bind} {port}")


def wait_listening(client: httpx.Client, sid: str, port: int, token: str, path: str = "/",
                   timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(path, headers={"Host": host_for(sid, port), "X-AgentBox-Token": token})
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


@pytest.fixture
def web(daemon):
    with httpx.Client(base_url=daemon.url, timeout=120) as client:
        yield client


@pytest.fixture
def app_sandbox(api, sandbox, web):
    """A sandbox running tests/e2e/preview_app.py on port 8000 (and its preview token)."""
    sid = sandbox["id"]
    token = preview_token(api, sid)
    start_app(api, sid)
    r = wait_listening(web, sid, 8000, token, "/count")
    assert r.status_code == 200, r.text
    return sid, token


def test_http_server_get_and_private_by_default(api, sandbox, web):
    sid = sandbox["id"]
    token = preview_token(api, sid)
    start_background(api, sid, "cd /root && echo hello-preview > index.txt && "
                               "python3 -m http.server 8000")
    host = host_for(sid, 8000)
    r = wait_listening(web, sid, 8000, token, "/index.txt")
    assert r.status_code == 200 and r.text == "hello-preview\n", r.text
    assert "1.1 agentbox" in r.headers["via"]
    r = web.get("/index.txt", headers={"Host": host})
    assert r.status_code == 401 and r.json()["error"]["code"] == "preview_token_required"
    r = web.get("/index.txt", headers={"Host": host, "Accept": "text/html"})
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/html")
    # API keys are not preview credentials.
    r = web.get("/index.txt", headers={"Host": host, "Authorization":
                                       api.headers["Authorization"]})
    assert r.status_code == 401
    # ?token= once: redirect without the token, cookie set for this host only.
    r = web.get(f"/index.txt?a=1&token={token}", headers={"Host": host})
    assert r.status_code == 302 and r.headers["location"] == "/index.txt?a=1"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie
    r = web.get("/index.txt", headers={"Host": host, "Cookie": cookie.split(";")[0]})
    assert r.status_code == 200
    r = web.get("/index.txt", headers={"Host": host_for(sid, 8001),
                                       "Cookie": cookie.split(";")[0]})
    assert r.status_code == 401  # the cookie is bound to its host
    # Public ports need nothing; rotating the token revokes the old one.
    r = api.patch(f"/v1/sandboxes/{sid}/preview", json={"public_ports": [8000]})
    assert r.status_code == 200 and r.json()["public_ports"] == [8000]
    assert web.get("/index.txt", headers={"Host": host}).status_code == 200
    api.patch(f"/v1/sandboxes/{sid}/preview", json={"public_ports": []}).raise_for_status()
    new = api.post(f"/v1/sandboxes/{sid}/preview-token").json()["preview_token"]
    assert new != token
    r = web.get("/index.txt", headers={"Host": host, "X-AgentBox-Token": token})
    assert r.status_code == 401
    r = web.get("/index.txt", headers={"Host": host, "X-AgentBox-Token": new})
    assert r.status_code == 200


def test_forwarded_headers_and_host(app_sandbox, web, daemon):
    sid, token = app_sandbox
    host = host_for(sid, 8000)
    r = web.get("/headers", headers={"Host": f"{host}:{urlsplit(daemon.url).port}",
                                     "X-AgentBox-Token": token, "Connection": "keep-alive, X-Hop",
                                     "X-Hop": "1", "Cookie": "app=1"})
    seen = r.json()
    assert seen["Host"] == f"{host}:{urlsplit(daemon.url).port}"
    assert seen["X-Forwarded-For"] == "127.0.0.1" and seen["X-Forwarded-Proto"] == "http"
    assert seen["X-Forwarded-Host"] == seen["Host"] and seen["Via"] == "1.1 agentbox"
    assert seen["Cookie"] == "app=1"
    for hidden in ("X-Hop", "X-AgentBox-Token", "Authorization"):
        assert hidden not in seen


def test_post_50_mib_streamed_both_ways_and_chunked_response(app_sandbox, web):
    sid, token = app_sandbox
    headers = {"Host": host_for(sid, 8000), "X-AgentBox-Token": token}
    block = os.urandom(1 << 20)
    want = hashlib.sha256(block * 50).hexdigest()

    def body():
        for _ in range(50):
            yield block

    r = web.post("/sha", content=body(), headers=headers)  # chunked upload
    assert r.status_code == 200 and r.json() == {"sha256": want, "size": 50 << 20}
    # Echo: the app streams the body back while it is still arriving, so the client must
    # read and write at once (aiohttp does; httpx would deadlock on full buffers, which is
    # backpressure working). Expect: 100-continue is answered once the sandbox is awake.

    async def echo() -> str:
        got = hashlib.sha256()
        async with aiohttp.ClientSession() as s:
            url = str(web.base_url).rstrip("/") + "/echo"
            async with s.post(url, data=io.BytesIO(block * 50), headers=headers,
                              expect100=True) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    got.update(chunk)
        return got.hexdigest()

    assert asyncio.run(echo()) == want
    r = web.get("/chunks", headers=headers)
    assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked"
    assert r.text == "".join(f"chunk {i}\n" for i in range(10))


def test_websocket_text_binary_big_frame_and_close_codes(app_sandbox, daemon):
    sid, token = app_sandbox

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(daemon.url + "/ws", protocols=["echo.v1"], max_msg_size=0,
                                    headers={"Host": host_for(sid, 8000),
                                             "X-AgentBox-Token": token}) as ws:
                assert ws.protocol == "echo.v1"
                await ws.send_str("hello")
                assert (await ws.receive(timeout=30)).data == "hello"
                await ws.send_bytes(b"\x00\x01binary")
                assert (await ws.receive(timeout=30)).data == b"\x00\x01binary"
                big = os.urandom(5 << 20)
                await ws.send_bytes(big)
                msg = await ws.receive(timeout=60)
                assert msg.type is aiohttp.WSMsgType.BINARY and msg.data == big
                await ws.send_str("close:4001")  # the app closes with 4001: mirrored to us
                msg = await ws.receive(timeout=30)
                assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 4001
                assert msg.extra == "as asked"
            async with s.ws_connect(daemon.url + "/ws", headers={
                    "Host": host_for(sid, 8000), "X-AgentBox-Token": token}) as ws:
                await ws.send_str("x")
                await ws.receive(timeout=30)
                await ws.close(code=4321)  # we close with 4321: mirrored to the app
            for _ in range(100):
                async with s.get(daemon.url + "/closes", headers={
                        "Host": host_for(sid, 8000), "X-AgentBox-Token": token}) as r:
                    if 4321 in (await r.json())["closes"]:
                        return
                await asyncio.sleep(0.1)
            raise AssertionError("the app never saw close code 4321")

    asyncio.run(run())


def test_websocket_private_then_token_then_cookie(app_sandbox, daemon, web):
    sid, token = app_sandbox
    host = host_for(sid, 8000)

    async def run() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await s.ws_connect(daemon.url + "/ws", headers={"Host": host})
            assert err.value.status == 401
            async with s.ws_connect(f"{daemon.url}/ws?token={token}",
                                    headers={"Host": host}) as ws:
                await ws.send_str("via query token")
                assert (await ws.receive(timeout=30)).data == "via query token"
            r = web.get(f"/?token={token}", headers={"Host": host})
            assert r.status_code == 302
            cookie = r.headers["set-cookie"].split(";")[0]
            async with s.ws_connect(daemon.url + "/ws",
                                    headers={"Host": host, "Cookie": cookie}) as ws:
                await ws.send_str("via cookie")
                assert (await ws.receive(timeout=30)).data == "via cookie"

    asyncio.run(run())


def test_suspended_sandbox_wakes_on_a_preview_request(api, app_sandbox, web):
    sid, token = app_sandbox
    headers = {"Host": host_for(sid, 8000), "X-AgentBox-Token": token}
    before = web.get("/count", headers=headers).json()
    r = api.post(f"/v1/sandboxes/{sid}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
    r = web.get("/count", headers=headers)
    assert r.status_code == 200, r.text
    assert float(r.headers["x-agentbox-wake-ms"]) > 0
    after = r.json()
    assert (after["boot"], after["pid"], after["count"]) == \
        (before["boot"], before["pid"], before["count"] + 1)
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


def test_nothing_listening_is_502(api, sandbox, web):
    sid = sandbox["id"]
    r = web.get("/", headers={"Host": host_for(sid, 9999),
                              "X-AgentBox-Token": preview_token(api, sid)})
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_closed"
    assert "9999" in r.json()["error"]["message"]


def test_the_guest_agent_port_is_never_proxied(api, sandbox, web):
    sid = sandbox["id"]
    r = web.get("/health", headers={"Host": host_for(sid, 49983),
                                    "X-AgentBox-Token": preview_token(api, sid)})
    assert r.status_code == 403 and r.json()["error"]["code"] == "port_reserved"


def test_service_bound_to_guest_loopback_is_reachable(api, sandbox, web):
    pytest.importorskip("vmctl.agent_terminal", reason="expose_port not available")
    sid = sandbox["id"]
    token = preview_token(api, sid)
    start_background(api, sid, "cd /root && echo only-loopback > lo.txt && "
                               "python3 -m http.server 9000 --bind 127.0.0.1")
    r = wait_listening(web, sid, 9000, token, "/lo.txt")
    assert r.status_code == 200 and r.text == "only-loopback\n", r.text
