"""The preview proxy in-process: the real gateway middlewares and proxy against an app on
loopback, with a fake sandbox service (wakes are scripted; no VMs)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import time
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from gateway.preview import hosts
from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.config import Config, ServerConfig
from gateway.errors import SandboxNotFound
from gateway.sandbox.states import State
from gateway.http.middleware import (
    REGISTRY_KEY,
    api_error_middleware,
    auth_middleware,
    error_middleware,
)
from gateway.preview.access import ACCESS_KEY
from gateway.store.registry import Registry, SandboxRecord
from tests.unit.fastlane_server import FastTestServer

SID = "0123456789abcdef"
# gateway.http.middleware stores the API key under a str request key (aiohttp warns; reported).


class FakeService:
    """What the proxy needs from SandboxService: ``use``/``use_stream`` hold a machine."""

    def __init__(self, registry: Registry, config: Config) -> None:
        self.registry, self.config = registry, config
        self.wake_gate: asyncio.Event | None = None  # set: the "sandbox" is awake
        self.uses = self.streams = self.active = self.fast = 0
        self.machine = SimpleNamespace(plan=SimpleNamespace(slot=SimpleNamespace(
            guest_addr="127.0.0.1")), driver=SimpleNamespace(pid=1, started_at=1.0),
            require_agent=lambda: None)

    def get(self, tenant, sandbox_id):
        rec = self.registry.get(sandbox_id)
        if rec is None or rec.tenant != tenant:
            raise SandboxNotFound(sandbox_id)
        return rec

    @contextlib.asynccontextmanager
    async def use(self, tenant, sandbox_id):
        self.get(tenant, sandbox_id)
        if self.wake_gate is not None:
            await self.wake_gate.wait()
        self.uses += 1
        self.active += 1
        try:
            yield self.machine
        finally:
            self.active -= 1

    def running(self, sandbox_id):
        """The fast lane's entry (SandboxService.running): awake sandboxes only."""
        rec = self.registry.get(sandbox_id)
        if self.wake_gate is not None or rec is None or rec.state is not State.RUNNING:
            return None
        return SimpleNamespace(record=rec, try_request=lambda on_abort: FakeLease(self))

    @contextlib.asynccontextmanager
    async def use_stream(self, tenant, sandbox_id):
        async with self.use(tenant, sandbox_id) as m:
            self.streams += 1
            try:
                yield m
            finally:
                self.streams -= 1


class FakeLease:
    """A request the fast lane admitted (SandboxController.try_request), counted as use()."""

    def __init__(self, service: FakeService) -> None:
        self.service: FakeService | None = service
        self.machine = service.machine
        service.uses += 1
        service.active += 1
        service.fast += 1

    def release(self) -> None:
        if self.service is not None:
            self.service.active -= 1
            self.service = None


SEEN: dict[str, object] = {}


async def upstream_app() -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
        return web.json_response({
            "method": request.method, "path_qs": request.raw_path, "size": size,
            "sha256": digest.hexdigest(), "headers": {k: v for k, v in request.headers.items()}})

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"X-Multi": "1"})
        resp.headers.add("Set-Cookie", "a=1")
        resp.headers.add("Set-Cookie", "b=2")
        await resp.prepare(request)
        for i in range(5):
            await resp.write(f"part{i}\n".encode())
        await resp.write_eof()
        return resp

    async def gz(request: web.Request) -> web.Response:
        return web.Response(body=b"\x1f\x8bnot-really-gzip",
                            headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="late")

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse(protocols=["chat.v2"], max_msg_size=0)
        await sock.prepare(request)
        while True:
            msg = await sock.receive()
            if msg.type is aiohttp.WSMsgType.TEXT and msg.data.startswith("close:"):
                await sock.close(code=int(msg.data[6:]), message=b"bye")
            elif msg.type is aiohttp.WSMsgType.TEXT:
                await sock.send_str(f"{sock.ws_protocol or ''}:{msg.data}")
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await sock.send_bytes(msg.data)
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                SEEN["closed_with"] = msg.data
                return sock
            else:
                return sock

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    async def late_body(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"X-Early": "1"})
        await resp.prepare(request)
        await asyncio.sleep(0.6)
        await resp.write(b"late")
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/late-body", late_body)
    app.router.add_get("/sse", sse)
    app.router.add_route("*", "/echo{tail:.*}", echo)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/gz", gz)
    app.router.add_get("/slow", slow)
    app.router.add_get("/ws", ws)
    return app


@pytest.fixture
async def env(tmp_path, aiohttp_server, aiohttp_client):
    up = await aiohttp_server(await upstream_app())
    registry = Registry(tmp_path / "r.sqlite")
    key, secret = registry.create_key("t")
    now = time.time()
    registry.insert_sandbox(SandboxRecord(
        id=SID, tenant=key.id, template="python", state=State.RUNNING, slot=0, root="/x",
        golden="/g", idle_timeout=0, host="h", created_at=now, updated_at=now,
        last_activity=now))
    config = Config(server=ServerConfig(proxy_read_timeout=1.0))
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       hosts.preview_middleware, auth_middleware])
    service = FakeService(registry, config)
    app[SERVICE_KEY] = service  # type: ignore[assignment]
    app[REGISTRY_KEY] = registry
    hosts.setup(app, config)
    # Served as the daemon serves: through the front lane (gateway.preview.fastlane).
    client = await aiohttp_client(FastTestServer(app), auto_decompress=False)
    token = client.app[ACCESS_KEY].get(SID).token
    host = f"{up.port}-{SID}.localhost"
    yield SimpleNamespace(client=client, up=up, host=host, token=token, service=service,
                          api_key=secret, registry=registry, server=client.server)
    registry.close()


def auth(env, **extra):
    return {"Host": env.host, "X-AgentBox-Token": env.token, **extra}


async def test_get_forwards_path_query_and_headers(env):
    r = await env.client.get("/echo/a%2Fb%20c?x=1&y=%26", headers=auth(env, Cookie="app=1"))
    assert r.status == 200
    body = await r.json()
    assert body["path_qs"] == "/echo/a%2Fb%20c?x=1&y=%26"
    h = body["headers"]
    assert h["Host"] == env.host and h["X-Forwarded-Host"] == env.host
    assert h["X-Forwarded-For"] == "127.0.0.1" and h["X-Forwarded-Proto"] == "http"
    assert h["Via"] == "1.1 agentbox" and h["Cookie"] == "app=1"
    assert "X-AgentBox-Token" not in h and h["User-Agent"].startswith("Python/")
    assert r.headers["Via"].endswith("1.1 agentbox")
    assert env.service.fast == 1  # served by the front lane (gateway.preview.fastlane)


async def test_private_without_token_is_401_json_or_html(env):
    r = await env.client.get("/echo", headers={"Host": env.host})
    assert r.status == 401
    assert (await r.json())["error"]["code"] == "preview_token_required"
    r = await env.client.get("/echo", headers={"Host": env.host, "Accept": "text/html"})
    assert r.status == 401 and "private" in await r.text()
    assert r.content_type == "text/html"


async def test_api_keys_are_not_accepted_on_preview_hosts(env):
    r = await env.client.get("/echo", headers={"Host": env.host,
                                                "Authorization": f"Bearer {env.api_key}"})
    assert r.status == 401


async def test_query_token_redirects_then_cookie_works(env):
    r = await env.client.get(f"/echo/p?a=1&token={env.token}&b=2",
                             headers={"Host": env.host}, allow_redirects=False)
    assert r.status == 302 and r.headers["Location"] == "/echo/p?a=1&b=2"
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Domain" not in cookie
    value = cookie.split(";")[0]
    r = await env.client.get("/echo/p", headers={"Host": env.host, "Cookie": value})
    assert r.status == 200
    assert "Cookie" not in (await r.json())["headers"]  # the app never sees our cookie
    # Rotation revokes it.
    env.client.app[ACCESS_KEY].rotate(SID)
    r = await env.client.get("/echo/p", headers={"Host": env.host, "Cookie": value})
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_preview_token"


async def test_public_port_needs_no_token(env):
    env.client.app[ACCESS_KEY].set_public_ports(SID, [env.up.port])
    r = await env.client.get("/echo", headers={"Host": env.host})
    assert r.status == 200


async def test_streamed_upload_chunked_and_sized(env):
    data = b"x" * (8 << 20) + b"end"

    async def gen():
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    for body in (io.BytesIO(data), gen()):
        r = await env.client.post("/echo", data=body, headers=auth(env))
        got = await r.json()
        assert r.status == 200 and got["size"] == len(data)
        assert got["sha256"] == hashlib.sha256(data).hexdigest()
        sent = got["headers"]
        assert sent.get("Content-Length") == str(len(data)) or \
            sent.get("Transfer-Encoding") == "chunked"


async def test_bodiless_request_sends_no_body(env):
    r = await env.client.get("/echo", headers=auth(env))
    h = (await r.json())["headers"]
    assert "Content-Length" not in h and "Transfer-Encoding" not in h


async def test_chunked_response_multi_headers_and_no_decompression(env):
    r = await env.client.get("/chunked", headers=auth(env))
    assert r.status == 200 and await r.text() == "".join(f"part{i}\n" for i in range(5))
    assert r.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    r = await env.client.get("/gz", headers=auth(env))
    assert r.headers["Content-Encoding"] == "gzip"
    assert await r.read() == b"\x1f\x8bnot-really-gzip"


async def test_server_sent_events_count_as_a_stream(env):
    async with env.client.get("/sse", headers=auth(env, Accept="text/event-stream")) as r:
        first = await r.content.readuntil(b"\n\n")
        assert first == b"data: 0\n\n" and env.service.streams == 1
        assert (await r.read()).count(b"data:") == 2
    assert env.service.streams == 0


async def test_headers_of_a_body_still_streaming_are_sent_at_once(env):
    # Only a body that has fully arrived is coalesced with the headers into one write.
    started = time.monotonic()
    async with env.client.get("/late-body", headers=auth(env)) as r:
        assert r.headers["X-Early"] == "1" and time.monotonic() - started < 0.5
        assert await r.read() == b"late"
    r = await env.client.get("/echo", headers=auth(env))
    assert r.status == 200 and (await r.json())["method"] == "GET"


async def test_port_closed_is_502(env):
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    r = await env.client.get("/", headers={"Host": f"{free}-{SID}.localhost",
                                           "X-AgentBox-Token": env.token})
    assert r.status == 502 and (await r.json())["error"]["code"] == "port_closed"


async def test_upstream_timeout_is_504(env):
    r = await env.client.get("/slow", headers=auth(env))
    assert r.status == 504 and (await r.json())["error"]["code"] == "upstream_timeout"


async def test_unknown_sandbox_is_404(env):
    r = await env.client.get("/", headers={"Host": f"80-{'f' * 16}.localhost"})
    assert r.status == 404 and (await r.json())["error"]["code"] == "sandbox_not_found"


async def test_expect_100_continue_waits_for_the_wake(env):
    env.service.wake_gate = asyncio.Event()
    reader, writer = await asyncio.open_connection("127.0.0.1", env.server.port)
    writer.write((f"POST /echo HTTP/1.1\r\nHost: {env.host}\r\nX-AgentBox-Token: {env.token}\r\n"
                  "Content-Length: 5\r\nExpect: 100-continue\r\n\r\n").encode())
    await writer.drain()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.readline(), 0.3)  # asleep: no 100 yet
    env.service.wake_gate.set()
    assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(b"hello")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 5)
    assert status.startswith(b"HTTP/1.1 200")
    writer.close()


async def test_expect_without_token_gets_401_and_no_100(env):
    reader, writer = await asyncio.open_connection("127.0.0.1", env.server.port)
    writer.write((f"POST /echo HTTP/1.1\r\nHost: {env.host}\r\nContent-Length: 5\r\n"
                  "Expect: 100-continue\r\n\r\n").encode())
    await writer.drain()
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 401")
    writer.close()


async def test_websocket_text_binary_big_frame_subprotocol_and_close_code(env):
    async with env.client.ws_connect("/ws", headers=auth(env), protocols=["chat.v2", "x"],
                                     max_msg_size=0) as ws:
        assert ws.protocol == "chat.v2"
        assert env.service.streams == 1
        await ws.send_str("hi")
        assert (await ws.receive()).data == "chat.v2:hi"
        big = bytes(range(256)) * (5 * 4096 + 1)  # > 5 MiB, over aiohttp's 4 MiB default
        await ws.send_bytes(big)
        msg = await ws.receive()
        assert msg.type is aiohttp.WSMsgType.BINARY and msg.data == big
        await ws.send_str("close:4001")
        msg = await ws.receive()
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 4001 and msg.extra == "bye"
    for _ in range(100):
        if env.service.streams == 0:
            break
        await asyncio.sleep(0.01)
    assert env.service.streams == 0


async def test_websocket_client_close_code_reaches_the_app(env):
    async with env.client.ws_connect("/ws", headers=auth(env)) as ws:
        await ws.send_str("ping")
        await ws.receive()
        await ws.close(code=4321)
    for _ in range(200):
        if SEEN.get("closed_with"):
            break
        await asyncio.sleep(0.01)
    assert SEEN.pop("closed_with") == 4321


async def test_websocket_with_query_token(env):
    async with env.client.ws_connect(f"/ws?token={env.token}",
                                     headers={"Host": env.host}) as ws:
        await ws.send_str("q")
        assert (await ws.receive()).data == ":q"
    assert env.client.session.cookie_jar.filter_cookies(env.client.make_url("/"))
    env.client.session.cookie_jar.clear()
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await env.client.ws_connect("/ws", headers={"Host": env.host})
    assert err.value.status == 401


async def test_api_is_untouched_on_the_api_host(env):
    r = await env.client.get("/v1/info")
    assert r.status == 401  # still needs an API key
    r = await env.client.get("/v1/info", headers={"Authorization": f"Bearer {env.api_key}"})
    body = await r.json()
    assert body["preview_url_template"] == "http://{port}-{id}.localhost:8080"
    assert body["session_url_template"] == "http://{name}.sessions.localhost:8080"


async def test_preview_api_for_the_owner(env):
    h = {"Authorization": f"Bearer {env.api_key}"}
    r = await env.client.get(f"/v1/sandboxes/{SID}/preview", headers=h)
    view = await r.json()
    assert view["preview_token"] == env.token and view["public_ports"] == []
    assert view["preview_url_template"] == f"http://{{port}}-{SID}.localhost:8080"
    r = await env.client.patch(f"/v1/sandboxes/{SID}/preview", json={"public_ports": [80, 80]},
                               headers=h)
    assert (await r.json())["public_ports"] == [80]
    r = await env.client.patch(f"/v1/sandboxes/{SID}/preview", json={"x": 1}, headers=h)
    assert r.status == 400
    r = await env.client.post(f"/v1/sandboxes/{SID}/preview-token", headers=h)
    assert (await r.json())["preview_token"] != env.token
    other, secret = env.registry.create_key("other")
    r = await env.client.get(f"/v1/sandboxes/{SID}/preview",
                             headers={"Authorization": f"Bearer {secret}"})
    assert r.status == 404
