"""WebSocket message limits: a frame over ``server.max_ws_message_bytes`` from either side
of the preview proxy or the terminal is refused from its header (close 1009 to the sender),
the other side is closed too, and the daemon never buffers the frame."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import struct
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
    TENANT_KEY,
    api_error_middleware,
    auth_middleware,
    error_middleware,
)
from gateway.preview.access import ACCESS_KEY
from gateway.store.registry import ApiKey, Registry, SandboxRecord
from tests.unit.test_proxy import SID, FakeService
from vmctl.agent_client import AgentClient

LIMIT = 1 << 20
HUGE = 256 << 20  # what the hostile peer claims to send
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class HostileWSApp:
    """A raw 'guest app': accepts the WebSocket handshake, then starts one binary frame of
    HUGE bytes and streams it until the connection breaks; counts what it got out."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key:"))
        accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest())
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        writer.write(b"\x82\x7f" + struct.pack("!Q", HUGE))
        chunk = b"\0" * (1 << 16)
        try:
            while self.sent < HUGE:
                writer.write(chunk)
                await writer.drain()
                self.sent += len(chunk)
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.done.set()


class RawUpstream:
    """A raw TCP server running ``handler`` per connection."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.handler, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def proxy_env(tmp_path, aiohttp_client):
    registry = Registry(tmp_path / "r.sqlite")
    key, secret = registry.create_key("t")
    now = time.time()
    registry.insert_sandbox(SandboxRecord(
        id=SID, tenant=key.id, template="python", state=State.RUNNING, slot=0, root="/x",
        golden="/g", idle_timeout=0, host="h", created_at=now, updated_at=now,
        last_activity=now))
    config = Config(server=ServerConfig(proxy_read_timeout=5.0, max_ws_message_bytes=LIMIT))
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       hosts.preview_middleware, auth_middleware])
    app[SERVICE_KEY] = FakeService(registry, config)  # type: ignore[assignment]
    app[REGISTRY_KEY] = registry
    hosts.setup(app, config)
    client = await aiohttp_client(app, auto_decompress=False)
    token = client.app[ACCESS_KEY].get(SID).token
    yield SimpleNamespace(client=client, token=token)
    registry.close()


def auth(env, port: int) -> dict[str, str]:
    return {"Host": f"{port}-{SID}.localhost", "X-AgentBox-Token": env.token}


async def test_oversize_frame_from_the_guest_app_closes_1009_without_buffering(proxy_env):
    app = HostileWSApp()
    async with RawUpstream(app.serve) as port:
        async with proxy_env.client.ws_connect("/", headers=auth(proxy_env, port),
                                               max_msg_size=0) as ws:
            msg = await asyncio.wait_for(ws.receive(), 15)
            assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
        await asyncio.wait_for(app.done.wait(), 15)
    # The proxy dropped the app's socket after the frame header: far less than the frame
    # went out (socket buffers only). Unbounded, all 256 MiB would have been read and sent.
    assert app.sent < 32 << 20, app.sent


async def test_oversize_frame_from_the_client_closes_1009_and_the_app_hears(proxy_env):
    seen: dict[str, object] = {}

    async def ws_app(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse(max_msg_size=0)
        await sock.prepare(request)
        async for msg in sock:
            seen.setdefault("got", []).append(len(msg.data))  # type: ignore[union-attr]
        seen["close_code"] = sock.close_code
        return sock

    upstream = web.Application()
    upstream.router.add_get("/", ws_app)
    runner = web.AppRunner(upstream)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with proxy_env.client.ws_connect("/", headers=auth(proxy_env, port),
                                               max_msg_size=0) as ws:
            await ws.send_bytes(b"a" * 1000)  # under the limit: passes
            await ws.send_bytes(b"b" * (LIMIT + 1))
            msg = await asyncio.wait_for(ws.receive(), 15)
            assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
        for _ in range(200):
            if "close_code" in seen:
                break
            await asyncio.sleep(0.02)
        assert seen["got"] == [1000]  # the oversize message never reached the app
        assert seen["close_code"] == 1009
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("headers", [
    b"X-Big: " + b"a" * (100 << 10) + b"\r\n",  # one header over max_field_size
    b"".join(b"X-H%d: v\r\n" % i for i in range(1000)),  # too many headers
])
async def test_oversize_response_headers_from_the_guest_app_are_502_json(proxy_env, headers):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            writer.write(b"HTTP/1.1 200 OK\r\n" + headers + b"Content-Length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    async with RawUpstream(serve) as port:
        r = await proxy_env.client.get("/", headers=auth(proxy_env, port))
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "bad_gateway"


# -- the terminal ------------------------------------------------------------------------


class TerminalService:
    """``use_stream`` yields a machine whose agent is the fake agent on ``port``."""

    def __init__(self, port: int) -> None:
        self.agent = AgentClient("127.0.0.1", port)

    @contextlib.asynccontextmanager
    async def use_stream(self, tenant, sandbox_id):
        yield SimpleNamespace(require_agent=lambda: self.agent)


@pytest.fixture
async def terminal_env(aiohttp_client):
    """The real terminal route in front of a fake guest agent whose /pty sends what the
    test queues and records what it receives."""
    agent_seen: dict[str, object] = {"got": []}
    to_send: asyncio.Queue[bytes] = asyncio.Queue()

    async def pty(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse(max_msg_size=0)
        await sock.prepare(request)

        async def sender() -> None:
            while True:
                data = await to_send.get()
                with contextlib.suppress(ConnectionError):
                    await sock.send_bytes(data)

        task = asyncio.create_task(sender(), name="fake-pty-sender")
        try:
            async for msg in sock:
                agent_seen["got"].append(len(msg.data))  # type: ignore[union-attr]
        finally:
            task.cancel()
        agent_seen["close_code"] = sock.close_code
        return sock

    fake = web.Application()
    fake.router.add_get("/pty", pty)
    runner = web.AppRunner(fake)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @web.middleware
    async def tenant(request: web.Request, handler):
        request[TENANT_KEY] = ApiKey("t", "t", False, 0.0)
        return await handler(request)

    app = web.Application(middlewares=[error_middleware, api_error_middleware, tenant])
    app.add_routes(terminal.routes)
    service = TerminalService(port)
    app[SERVICE_KEY] = service  # type: ignore[assignment]
    app[terminal.MAX_WS_KEY] = LIMIT
    client = await aiohttp_client(app)
    yield SimpleNamespace(client=client, seen=agent_seen, to_send=to_send)
    await service.agent.aclose()
    await runner.cleanup()


async def wait_for_key(d: dict, key: str) -> None:
    for _ in range(300):
        if key in d:
            return
        await asyncio.sleep(0.02)


async def test_terminal_oversize_frame_from_the_client_is_1009(terminal_env):
    async with terminal_env.client.ws_connect(f"/v1/sandboxes/{SID}/terminal",
                                              max_msg_size=0) as ws:
        await ws.send_bytes(b"ls\n")
        await ws.send_bytes(b"x" * (LIMIT + 1))
        msg = await asyncio.wait_for(ws.receive(), 15)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
    await wait_for_key(terminal_env.seen, "close_code")
    assert terminal_env.seen["got"] == [3]
    assert terminal_env.seen["close_code"] == 1009  # the agent was closed too, with why


async def test_terminal_oversize_frame_from_the_guest_is_refused(terminal_env):
    async with terminal_env.client.ws_connect(f"/v1/sandboxes/{SID}/terminal",
                                              max_msg_size=0) as ws:
        terminal_env.to_send.put_nowait(b"$ ")
        msg = await asyncio.wait_for(ws.receive(), 15)
        assert msg.type is aiohttp.WSMsgType.BINARY and msg.data == b"$ "
        terminal_env.to_send.put_nowait(b"y" * (LIMIT + 1))
        msg = await asyncio.wait_for(ws.receive(), 15)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
    await wait_for_key(terminal_env.seen, "close_code")
    assert terminal_env.seen["close_code"] == 1009  # the agent (the sender) got 1009
