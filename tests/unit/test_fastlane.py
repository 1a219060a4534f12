"""The preview fast lane (gateway.preview.fastlane) on real loopback sockets: a raw upstream that
records every byte it receives, the real preview app and SandboxController, and raw
client sockets, each request through the fast lane and through aiohttp (fast_lane off)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from types import SimpleNamespace

import httptools
import pytest
from aiohttp import web

from gateway.preview import hosts
from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.config import Config, ServerConfig
from gateway.sandbox.controller import HoldCounter, SandboxController
from gateway.sandbox.core import Policy, VMLost
from gateway.sandbox.states import State
from gateway.http.middleware import (
    REGISTRY_KEY,
    api_error_middleware,
    auth_middleware,
    error_middleware,
)
from gateway.preview.access import ACCESS_KEY
from gateway.store.registry import Registry, SandboxRecord
from gateway.sandbox.slots import Slots
from tests.unit.fastlane_server import FastTestServer

SID = "0123456789abcdef"
BIG = bytes(range(256)) * (32 << 10)  # 8 MiB


# -- a raw upstream that records what it receives ---------------------------------------------

class _Req:
    def __init__(self) -> None:
        self.url = b""
        self.body = hashlib.sha256()
        self.size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.update(body)
        self.size += len(body)


class Recorder(asyncio.Protocol):
    """Answers by path; ``received`` holds every byte of every connection (in order)."""

    def __init__(self, up: Upstream) -> None:
        self.up = up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.up.connections += 1
        self.up.open.add(self)
        self.raw = bytearray()
        self.up.received.append(self.raw)
        self._new()

    def _new(self) -> None:
        self.req = _Req()
        self.start = len(self.raw)
        self.parser = httptools.HttpRequestParser(self)

    def on_url(self, url: bytes) -> None:
        self.req.on_url(url)
        if url.startswith(b"/stall"):  # an app that does not read its request body (yet)
            self.transport.pause_reading()
            self.up.stalled = self

    def on_body(self, body: bytes) -> None:
        self.req.on_body(body)

    def on_message_complete(self) -> None:
        self.up.requests += 1
        self.req.method = self.parser.get_method()
        self.pending.append(self.req)

    def data_received(self, data: bytes) -> None:
        self.raw += data
        self.pending: list[_Req] = []
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad\r\nContent-Length: 0\r\n\r\n")
            self.transport.close()
            return
        for req in self.pending:
            head = bytes(self.raw[self.start:]).split(b"\r\n\r\n", 1)[0]
            self.answer(req, head)

    def connection_lost(self, exc: Exception | None) -> None:
        self.up.open.discard(self)

    def answer(self, req: _Req, head: bytes) -> None:
        path = req.url.split(b"?")[0].decode()
        t = self.transport
        info = head + b"\n" + req.body.hexdigest().encode() + b" %d" % req.size
        if path == "/chunked":
            t.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Multi: 1\r\n"
                    b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\n\r\n")
            for part in (info[:10], info[10:], b"end"):
                t.write(b"%x\r\n%s\r\n" % (len(part), part))
            t.write(b"0\r\n\r\n")
        elif path == "/close":
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + info)
            t.close()
        elif path == "/204":
            t.write(b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n")
        elif path == "/304":
            t.write(b"HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\nContent-Length: 17\r\n\r\n")
        elif path == "/early":
            t.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(info), info))
        elif path == "/big":
            t.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BIG))
            t.write(BIG)
        elif path == "/hang":
            pass
        elif path == "/later":  # answers after 0.3 s
            asyncio.get_running_loop().call_later(0.3, t.write, b"HTTP/1.1 200 OK\r\n"
                                                  b"Content-Length: 5\r\n\r\nlater")
        elif path == "/drop":
            t.close()
        elif path == "/bighead":
            t.write(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70000 + b"\r\n\r\n")
        elif path == "/badhead":
            t.write(b"HTTP/1.1 2x0 Nope\r\n\r\n")
        elif path == "/cut":
            t.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly-ten!!")
            t.close()
        elif path == "/reason":
            t.write(b"HTTP/1.1 299 Custom Words\r\nContent-Length: 2\r\nConnection: close\r\n"
                    b"Keep-Alive: x\r\n\r\nok")
        else:
            t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                    b"Server: app\r\n\r\n%s" % (len(info), b"" if req.method == b"HEAD" else info))
        self._restart()

    def _restart(self) -> None:
        self.req = _Req()
        self.start = len(self.raw)


class Upstream:
    def __init__(self) -> None:
        self.received: list[bytearray] = []
        self.open: set[Recorder] = set()
        self.connections = self.requests = 0
        self.stalled: Recorder | None = None

    def all_bytes(self) -> bytes:
        return b"".join(self.received)


# -- the gateway -----------------------------------------------------------------------------

def make_app(registry: Registry, config: Config, ctl: SandboxController) -> web.Application:
    machine = ctl.machine

    class Service:
        def __init__(self) -> None:
            self.registry, self.config = registry, config

        def get(self, tenant, sandbox_id):  # type: ignore[no-untyped-def]
            return registry.get(sandbox_id)

        def running(self, sandbox_id):  # type: ignore[no-untyped-def]
            if sandbox_id != SID or ctl.state is not State.RUNNING or ctl.core.op:
                return None
            return ctl

        @contextlib.asynccontextmanager
        async def use(self, tenant, sandbox_id):  # type: ignore[no-untyped-def]
            async with ctl.request():
                yield machine

        @contextlib.asynccontextmanager
        async def use_stream(self, tenant, sandbox_id):  # type: ignore[no-untyped-def]
            async with ctl.stream():
                yield machine

    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       hosts.preview_middleware, auth_middleware])
    app[SERVICE_KEY] = Service()  # type: ignore[assignment]
    app[REGISTRY_KEY] = registry
    hosts.setup(app, config)
    return app


@pytest.fixture
async def env(tmp_path):
    async with make_env(tmp_path) as e:
        yield e


@contextlib.asynccontextmanager
async def make_env(tmp_path):  # type: ignore[no-untyped-def]
    up = Upstream()
    loop = asyncio.get_running_loop()
    up_server = await loop.create_server(lambda: Recorder(up), "127.0.0.1", 0)
    up_port = up_server.sockets[0].getsockname()[1]
    registry = Registry(tmp_path / "r.sqlite")
    key, _ = registry.create_key("t")
    now = time.time()
    registry.insert_sandbox(SandboxRecord(
        id=SID, tenant=key.id, template="python", state=State.RUNNING, slot=0, root="/x",
        golden="/g", idle_timeout=0, host="h", created_at=now, updated_at=now,
        last_activity=now))
    config = Config(server=ServerConfig(proxy_read_timeout=1.0, header_read_timeout=1.0))
    driver = SimpleNamespace(pid=1, started_at=1.0, exit_detail=lambda: "")
    machine = SimpleNamespace(plan=SimpleNamespace(slot=SimpleNamespace(guest_addr="127.0.0.1")),
                              driver=driver, require_agent=lambda: None, vmm_record=lambda: None)
    ctl = SandboxController(registry.get(SID), machine, registry, Policy(), HoldCounter(),
                            lambda aw, name: asyncio.ensure_future(aw))
    fast = FastTestServer(make_app(registry, config, ctl))
    slow = FastTestServer(make_app(registry, config, ctl), fast_lane=False)
    await fast.start_server()
    await slow.start_server()
    token = fast.app[ACCESS_KEY].get(SID).token
    yield SimpleNamespace(up=up, up_port=up_port, fast=fast, slow=slow, ctl=ctl, token=token,
                          host=f"{up_port}-{SID}.localhost", registry=registry, machine=machine)
    await fast.close()
    await slow.close()
    up_server.close()
    registry.close()


# -- a raw client ----------------------------------------------------------------------------

class Response:
    def __init__(self, head_only: bool) -> None:
        self.head_only = head_only
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.complete = False
        self.headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def connect(server: FastTestServer):  # type: ignore[no-untyped-def]
    return await asyncio.open_connection("127.0.0.1", server.port)


async def read_response(reader: asyncio.StreamReader, head_only: bool = False,
                        timeout: float = 10) -> tuple[bytes, Response]:
    """One response, raw, as it came (stops at its end; a closed connection ends it too)."""
    resp = Response(head_only)
    parser = httptools.HttpResponseParser(resp)
    raw = b""
    async with asyncio.timeout(timeout):
        while True:
            if head_only and resp.headers_done:
                break
            data = await reader.read(65536)
            if not data:
                break
            raw += data
            parser.feed_data(data)
            if resp.complete or (head_only and resp.headers_done):
                break
    resp.status = parser.get_status_code() if raw else 0
    return raw, resp


async def exchange(server: FastTestServer, request: bytes, head_only: bool = False
                   ) -> tuple[bytes, Response]:
    reader, writer = await connect(server)
    try:
        writer.write(request)
        return await read_response(reader, head_only)
    finally:
        writer.close()


def normal(raw: bytes, port_fast: int, port_slow: int) -> bytes:
    raw = re.sub(rb"\r\nDate: [^\r]*", b"\r\nDate: -", raw)
    return raw


def same(fast_raw: bytes, fast: Response, slow_raw: bytes, slow: Response) -> bool:
    """The same answer: status line, headers (names in any case, Date aside), body bytes;
    byte for byte too unless the body is chunked (aiohttp cuts chunks where its reads end)."""
    def headers(r: Response) -> list[tuple[bytes, bytes]]:
        return [(k.lower(), v) for k, v in r.headers if k.lower() != b"date"]

    if fast_raw.split(b"\r\n", 1)[0] != slow_raw.split(b"\r\n", 1)[0]:
        return False
    if headers(fast) != headers(slow) or fast.body != slow.body:
        return False
    chunked = (b"transfer-encoding", b"chunked") in headers(fast)
    return chunked or normal(fast_raw, 0, 0).lower() == normal(slow_raw, 0, 0).lower()


def req(env, method: str = "GET", path: str = "/", headers: str = "", body: bytes = b"",
        auth: bool = True) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {env.host}\r\n"
    if auth:
        head += f"X-AgentBox-Token: {env.token}\r\n"
    head += headers
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def until(condition, tries: int = 100) -> None:  # type: ignore[no-untyped-def]
    """Wait (up to a second) for ``condition()``; the assertion after it says what failed."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.01)


async def settle(env) -> None:  # type: ignore[no-untyped-def]
    for _ in range(100):
        if env.ctl.active == 0 and env.ctl.entering == 0:
            return
        await asyncio.sleep(0.01)


# -- parity ------------------------------------------------------------------------------------

PARITY = [
    ("GET", "/plain?x=1&y=%26", "", b""),
    ("GET", "/plain", "Cookie: app=1\r\nAccept: text/html\r\n", b""),
    ("HEAD", "/plain", "", b""),
    ("POST", "/plain", "Content-Type: application/json\r\n", b'{"a": 1}'),
    ("POST", "/plain", "", b""),
    ("DELETE", "/plain", "X-Forwarded-For: 10.0.0.1\r\nConnection: keep-alive, X-Hop\r\n"
                         "X-Hop: secret\r\n", b""),
    ("PUT", "/plain", "", BIG),
    ("GET", "/chunked", "", b""),
    ("GET", "/close", "", b""),
    ("GET", "/204", "", b""),
    ("GET", "/304", "If-None-Match: \"x\"\r\n", b""),
    ("GET", "/early", "", b""),
    ("GET", "/big", "", b""),
    ("GET", "/reason", "", b""),
    ("GET", "/plain", "Connection: close\r\n", b""),
]


@pytest.mark.parametrize(("method", "path", "headers", "body"), PARITY,
                         ids=[f"{m}{p}-{i}" for i, (m, p, _, _) in enumerate(PARITY)])
async def test_parity_with_aiohttp(env, method, path, headers, body):
    request = req(env, method, path, headers, body)
    head_only = method == "HEAD" or path in ("/204", "/304")
    got = {}
    for name, server in (("fast", env.fast), ("slow", env.slow)):
        raw, resp = await exchange(server, request, head_only)
        got[name] = raw, resp
        await settle(env)
        assert env.ctl.active == 0 and env.ctl.entering == 0
    fast_raw, fast = got["fast"]
    slow_raw, slow = got["slow"]
    assert fast.status == slow.status != 0
    assert same(fast_raw, fast, slow_raw, slow)
    assert env.fast.lane.served == 1 and env.fast.lane.handed_off == 0
    # What the app received is in the body: the same request head both ways.
    if path == "/plain" and method != "HEAD":
        assert f"X-Forwarded-For: {'10.0.0.1, ' if 'X-Forwarded' in headers else ''}127.0.0.1"\
            .encode() in fast.body
        assert b"X-AgentBox-Token" not in fast.body and b"X-Hop" not in fast.body
        assert hashlib.sha256(body).hexdigest().encode() in fast.body


async def test_preview_cookie_and_query_token_never_reach_the_app(env):
    raw, resp = await exchange(env.slow, req(env, "GET", f"/plain?token={env.token}",
                                             auth=False))
    assert resp.status == 302
    cookie = dict(resp.headers)[b"Set-Cookie"].split(b";")[0].decode()
    request = req(env, "GET", "/plain?a=1", f"Cookie: app=1; {cookie}; b=2\r\n", auth=False)
    fast_raw, fast = await exchange(env.fast, request)
    slow_raw, _ = await exchange(env.slow, request)
    assert fast.status == 200 and normal(fast_raw, 0, 0) == normal(slow_raw, 0, 0)
    assert b"Cookie: app=1; b=2" in fast.body and cookie.encode() not in fast.body
    # A POST with ?token= goes through (no redirect) with the cookie set, token stripped.
    request = req(env, "POST", f"/plain?token={env.token}&k=v", auth=False, body=b"abc")
    fast_raw, fast = await exchange(env.fast, request)
    slow_raw, _ = await exchange(env.slow, request)
    assert fast.status == 200 and normal(fast_raw, 0, 0) == normal(slow_raw, 0, 0)
    assert b"POST /plain?k=v HTTP/1.1" in fast.body and b"Set-Cookie: " in fast_raw
    assert env.fast.lane.served == 2 and env.fast.lane.handed_off == 0


async def test_activity_is_touched_and_counts_return_to_zero(env):
    env.ctl._last_activity = None
    raw, resp = await exchange(env.fast, req(env, "GET", "/plain"))
    assert resp.status == 200
    await settle(env)
    assert env.ctl.active == 0 and env.ctl._last_activity is not None
    assert env.ctl.core.idle_since > 0


# -- keep-alive, pipelining, hand-off -----------------------------------------------------

async def test_keep_alive_and_pipelining(env):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/plain?n=1") + req(env, "POST", "/plain?n=2", body=b"xy")
                 + req(env, "GET", "/chunked?n=3"))
    bodies = []
    for _ in range(3):
        _, resp = await read_response(reader)
        assert resp.status == 200 and resp.complete
        bodies.append(resp.body)
    assert b"?n=1" in bodies[0] and b"?n=2" in bodies[1] and b"?n=3" in bodies[2]
    writer.write(req(env, "GET", "/plain?n=4"))
    _, resp = await read_response(reader)
    assert b"?n=4" in resp.body
    writer.close()
    assert env.fast.lane.served == 4 and env.up.connections == 1  # one pooled connection


async def test_fast_request_then_hand_off_on_one_connection(env):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/plain?first"))
    _, resp = await read_response(reader)
    assert resp.status == 200
    writer.write(req(env, "GET", f"/plain?token={env.token}", auth=False))  # a redirect
    _, resp = await read_response(reader)
    assert resp.status == 302
    writer.write(req(env, "GET", "/plain?third"))  # aiohttp's from now on, still answers
    _, resp = await read_response(reader)
    assert resp.status == 200 and b"?third" in resp.body
    writer.close()
    assert env.fast.lane.served == 1 and env.fast.lane.handed_off == 1
    await settle(env)
    assert env.ctl.active == 0


@pytest.mark.parametrize("request_bytes", [
    "GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # the API
    "GET /plain?token=TOKEN HTTP/1.1\r\nHost: HOST\r\n\r\n",  # redirect with the cookie
    "GET /plain HTTP/1.1\r\nHost: HOST\r\n\r\n",  # 401: no token
    "GET /ws HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\nUpgrade: websocket\r\n"
    "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    "Sec-WebSocket-Version: 13\r\n\r\n",
    "POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\nContent-Length: 3\r\n"
    "Expect: 100-continue\r\n\r\nabc",
    "POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\n"
    "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "GET /sse HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\n"
    "Accept: text/event-stream\r\n\r\n",
], ids=["api", "redirect", "no-token", "websocket", "expect", "chunked-upload", "sse"])
async def test_hand_off_matches_aiohttp(env, request_bytes):
    request = request_bytes.replace("TOKEN", env.token).replace("HOST", env.host).encode()
    fast_raw, fast = await exchange(env.fast, request)
    slow_raw, slow = await exchange(env.slow, request)
    assert fast.status == slow.status != 0
    assert normal(fast_raw, 0, 0) == normal(slow_raw, 0, 0)
    assert env.fast.lane.handed_off == 1 and env.fast.lane.served == 0
    await settle(env)
    assert env.ctl.active == 0


async def test_no_free_pacing_slot_is_handed_off(env):
    env.ctl._pace = slots = Slots(1)
    assert slots.try_take()  # every slot taken: the fast lane never waits
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/plain"))
    await asyncio.sleep(0.2)
    assert env.fast.lane.handed_off == 1 and env.fast.lane.served == 0 and not env.up.requests
    slots.release()  # aiohttp's path was queued for a slot, and now goes
    _, resp = await read_response(reader)
    assert resp.status == 200
    writer.close()
    await settle(env)
    assert env.ctl.active == 0


async def test_refused_connect_is_handed_off(env):
    host = f"1-{SID}.localhost"  # nothing listens on port 1
    request = f"GET / HTTP/1.1\r\nHost: {host}\r\nX-AgentBox-Token: {env.token}\r\n\r\n".encode()
    fast_raw, fast = await exchange(env.fast, request)
    slow_raw, slow = await exchange(env.slow, request)
    assert fast.status == slow.status == 502 and b"port_closed" in fast.body
    assert env.fast.lane.handed_off == 1 and env.fast.lane.served == 0
    await settle(env)
    assert env.ctl.active == 0


# -- smuggling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("request_bytes", [
    b"POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\nContent-Length: 44\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: HOST\r\n\r\n",
    b"POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\nContent-Length: 0\r\n"
    b"Content-Length: 40\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: HOST\r\n\r\n",
    b"POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\nX-Fold: a\r\n"
    b" Content-Length: 38\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: HOST\r\n\r\n",
    b"POST /plain HTTP/1.1\nHost: HOST\nX-AgentBox-Token: TOKEN\nContent-Length: 38\n\n"
    b"GET /smuggled HTTP/1.1\r\nHost: HOST\r\n\r\n",
    b"GET /plain HTTP/1.1\r\nHost: HOST\r\nHost: other\r\nX-AgentBox-Token: TOKEN\r\n\r\n",
], ids=["cl-te", "two-cl", "obs-fold", "bare-lf", "two-hosts"])
async def test_smuggling_never_forwards_two_requests(env, request_bytes):
    request = request_bytes.replace(b"TOKEN", env.token.encode()).replace(b"HOST",
                                                                          env.host.encode())
    raw, resp = await exchange(env.fast, request)
    await asyncio.sleep(0.1)
    assert b"/smuggled" not in env.up.all_bytes()
    assert env.up.requests <= 1
    assert resp.status == 400
    assert env.fast.lane.served == 0 and env.fast.lane.handed_off == 1
    await settle(env)
    assert env.ctl.active == 0


# -- bounds ------------------------------------------------------------------------------------

async def test_oversized_head_is_refused_by_aiohttp(env):
    request = req(env, "GET", "/plain", "X-Big: " + "a" * 40000 + "\r\n")
    raw, resp = await exchange(env.fast, request)
    assert resp.status in (400, 431) and env.up.requests == 0
    assert env.fast.lane.handed_off == 1


async def test_slow_head_is_cut_off(env):
    reader, writer = await connect(env.fast)
    started = time.monotonic()
    writer.write(b"GET /plain HTTP/1.1\r\n")
    for _ in range(40):
        await asyncio.sleep(0.05)
        if reader.at_eof() or writer.is_closing():
            break
        with contextlib.suppress(ConnectionError):
            writer.write(b"X-A: b\r\n")
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    assert 0.9 < time.monotonic() - started < 3  # header_read_timeout = 1 s
    writer.close()
    assert env.up.requests == 0


@pytest.mark.parametrize(("path", "status", "code"), [
    ("/bighead", 502, b"bad_gateway"), ("/badhead", 502, b"bad_gateway"),
    ("/hang", 504, b"upstream_timeout"), ("/drop", 502, b"bad_gateway")])
async def test_upstream_failures_before_the_response(env, path, status, code):
    fast_raw, fast = await exchange(env.fast, req(env, "GET", path))
    slow_raw, slow = await exchange(env.slow, req(env, "GET", path))
    assert fast.status == slow.status == status
    assert code in fast.body and code in slow.body
    assert env.fast.lane.served == 1
    await settle(env)
    assert env.ctl.active == 0


async def test_upstream_closing_mid_body_closes_the_client(env):
    for server in (env.fast, env.slow):
        reader, writer = await connect(server)
        writer.write(req(env, "GET", "/cut"))
        raw, resp = await read_response(reader)
        assert resp.status == 200 and not resp.complete and b"only-ten!!" in raw
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed, not left open as if complete
        writer.close()
    await settle(env)
    assert env.ctl.active == 0


async def test_client_leaving_releases_and_closes_upstream(env):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/hang"))
    await until(lambda: env.up.requests)
    assert env.ctl.active == 1
    writer.close()
    await settle(env)
    assert env.ctl.active == 0
    await until(lambda: not env.up.open)
    assert not env.up.open  # the upstream connection was closed, not pooled
    assert not env.fast.lane.pool.idle


async def test_shutdown_finishes_what_is_in_flight_and_closes_idle_connections(env):
    idle_r, idle_w = await connect(env.fast)
    idle_w.write(req(env, "GET", "/plain"))
    assert (await read_response(idle_r))[1].complete  # now an idle keep-alive connection
    busy_r, busy_w = await connect(env.fast)
    busy_w.write(req(env, "GET", "/later"))
    await until(lambda: env.up.requests == 2)
    stop = asyncio.ensure_future(env.fast.site.stop())
    async with asyncio.timeout(1):
        assert await idle_r.read() == b""  # closed at once
    raw, resp = await read_response(busy_r)
    assert resp.status == 200 and resp.complete and resp.body == b"later"  # not cut off
    async with asyncio.timeout(1):
        assert await busy_r.read() == b""  # and then closed: nothing new starts
    await stop
    idle_w.close()
    busy_w.close()
    await settle(env)
    assert env.ctl.active == 0


async def test_vm_lost_aborts_the_exchange(env):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/hang"))
    await until(lambda: env.up.requests)
    env.ctl._abort_requests(VMLost("gone", headers={"Retry-After": "1"}))
    raw, resp = await read_response(reader)
    assert resp.status == 503 and b"sandbox_crashed" in resp.body
    writer.close()
    assert env.ctl.active == 0


async def test_new_vmm_gets_new_connections(env):
    assert (await exchange(env.fast, req(env, "GET", "/plain")))[1].status == 200
    assert (await exchange(env.fast, req(env, "GET", "/plain")))[1].status == 200
    assert env.up.connections == 1
    env.machine.driver = SimpleNamespace(pid=2, started_at=2.0)  # a restore: another VMM
    assert (await exchange(env.fast, req(env, "GET", "/plain")))[1].status == 200
    assert env.up.connections == 2
    await asyncio.sleep(0.05)
    assert len(env.up.open) == 1  # the old VMM's idle connection was closed


async def test_large_bodies_stream_both_ways_with_flow_control(env):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/big"))
    await asyncio.sleep(0.3)  # the client reads nothing: the gateway must not buffer 8 MiB
    front = next(iter(env.fast.lane.clients))
    assert front.writing_paused and front.exchange.up.reading_paused
    assert front.transport.get_write_buffer_size() < (1 << 20)  # not the 8 MiB
    raw, resp = await read_response(reader)
    assert resp.body == BIG
    writer.close()
    raw, resp = await exchange(env.fast, req(env, "PUT", "/plain", body=BIG))
    assert hashlib.sha256(BIG).hexdigest().encode() in resp.body


async def test_a_repeated_head_is_routed_again_when_access_changes(env):
    reader, writer = await connect(env.fast)
    request = req(env, "GET", "/plain?same")
    answers = []
    for _ in range(3):
        writer.write(request)
        raw, resp = await read_response(reader)
        assert resp.status == 200
        answers.append(normal(raw, 0, 0))
    assert answers[0] == answers[1] == answers[2]
    assert env.fast.lane.served == 3
    env.fast.app[ACCESS_KEY].rotate(SID)  # the same bytes no longer carry a valid token
    writer.write(request)
    raw, resp = await read_response(reader)
    assert resp.status == 401 and b"invalid_preview_token" in resp.body
    assert env.fast.lane.handed_off == 1
    writer.close()
    await settle(env)
    assert env.ctl.active == 0


async def test_a_repeated_head_is_not_served_while_the_sandbox_is_busy(env):
    reader, writer = await connect(env.fast)
    request = req(env, "GET", "/plain?same")
    writer.write(request)
    assert (await read_response(reader))[1].status == 200
    env.ctl._pace = slots = Slots(1)
    assert slots.try_take()
    writer.write(request)
    await asyncio.sleep(0.1)
    assert env.fast.lane.handed_off == 1 and env.up.requests == 1
    slots.release()
    assert (await read_response(reader))[1].status == 200
    writer.close()


async def test_idle_connections_of_a_sandbox_that_stopped_running_are_closed(env):
    assert (await exchange(env.fast, req(env, "GET", "/plain")))[1].status == 200
    pool = env.fast.lane.pool
    assert sum(map(len, pool.idle.values())) == 1
    pool._sweep()  # still running, not idle for long: kept
    assert sum(map(len, pool.idle.values())) == 1
    env.ctl.core.op = object()  # e.g. a suspend under way
    try:
        pool._sweep()
        assert not pool.idle
        await asyncio.sleep(0.05)
        assert not env.up.open
    finally:
        env.ctl.core.op = None


def test_sandbox_service_running_is_running_and_idle_only():
    from gateway.sandbox.core import SandboxCore
    from gateway.sandbox.service import SandboxService

    class Ctl:  # the controller's fact, read from its core
        core = SandboxCore(State.RUNNING, Policy(), now=0.0)
        serving = property(lambda self: self.core.serving)

    ctl = Ctl()
    service = SimpleNamespace(_controllers={SID: ctl})
    assert SandboxService.running(service, SID) is ctl
    assert SandboxService.running(service, "other") is None  # no controller: use() makes one
    ctl.core.op = object()  # an operation (suspend, pause) under way
    assert SandboxService.running(service, SID) is None
    ctl.core.op, ctl.core.state = None, State.SUSPENDED
    assert SandboxService.running(service, SID) is None


async def test_same_headers_other_targets_reuse_the_decision_and_check_each_line(env):
    reader, writer = await connect(env.fast)
    for n in range(3):  # only the target changes: admit() is not run again, destination() is
        writer.write(req(env, "GET", f"/plain?n={n}"))
        _, resp = await read_response(reader)
        assert resp.status == 200 and f"GET /plain?n={n} HTTP/1.1".encode() in resp.body
    writer.write(req(env, "GET", f"/plain?token={env.token}", auth=True))  # our token: per URL
    _, resp = await read_response(reader)
    assert resp.status == 200 and b"GET /plain HTTP/1.1" in resp.body  # stripped
    writer.write(req(env, "GET", "/plain?n=4"))
    _, resp = await read_response(reader)
    assert resp.status == 200 and b"?n=4" in resp.body
    assert env.fast.lane.served == 5 and env.fast.lane.handed_off == 0
    writer.write(req(env, "GET", "/a b"))  # a request line llhttp refuses: aiohttp's 400
    _, resp = await read_response(reader)
    assert resp.status == 400 and env.fast.lane.handed_off == 1
    writer.close()
    assert b"/a b" not in env.up.all_bytes()
    await settle(env)
    assert env.ctl.active == 0


@pytest.mark.parametrize("target", [b"/p#frag", b"/p\x01", b"/p\xff", b"http://x/p", b"*",
                                    b"/p\x7f", b"/a\tb"])
async def test_after_a_memo_an_unusual_target_takes_the_whole_parse(env, target):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "GET", "/plain"))
    assert (await read_response(reader))[1].status == 200  # the memo is set
    writer.write(req(env, "GET", "/plain").replace(b"/plain", target, 1))
    await read_response(reader)
    assert env.fast.lane.served == 1 and env.fast.lane.handed_off == 1  # not the memo's path
    writer.close()
    await settle(env)


async def read_until_eof(reader: asyncio.StreamReader, timeout: float) -> tuple[bytes, bool]:
    data = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
            return data, True
    return data, False


async def test_http_1_0_keep_alive_without_a_length_is_close_delimited(env):
    """aiohttp sends such a body close-delimited but leaves the connection open (the client
    cannot tell where it ends); the fast lane sends the same bytes and closes."""
    request = req(env, "GET", "/chunked", "Connection: keep-alive\r\n").replace(
        b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    got = {}
    for name, server in (("fast", env.fast), ("slow", env.slow)):
        reader, writer = await connect(server)
        writer.write(request)
        got[name] = await read_until_eof(reader, 1.5)
        writer.close()
    (fast_raw, fast_closed), (slow_raw, _) = got["fast"], got["slow"]
    assert normal(fast_raw, 0, 0) == normal(slow_raw, 0, 0) and b"0end" in fast_raw
    assert fast_closed and b"Transfer-Encoding" not in fast_raw
    await settle(env)
    assert env.ctl.active == 0


@pytest.mark.parametrize(("path", "headers"), [
    ("/plain", ""), ("/plain", "Connection: keep-alive\r\n"), ("/close", ""),
    ("/chunked", "")])
async def test_http_1_0_parity(env, path, headers):
    request = req(env, "GET", path, headers).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    fast_raw, fast = await exchange(env.fast, request)
    slow_raw, slow = await exchange(env.slow, request)
    assert fast.status == slow.status == 200
    assert same(fast_raw, fast, slow_raw, slow)
    assert fast_raw.startswith(b"HTTP/1.0 200 OK\r\n")
    assert env.fast.lane.served == 1 and env.fast.lane.handed_off == 0
    await settle(env)
    assert env.ctl.active == 0


async def test_a_request_body_the_app_does_not_read_pauses_the_client(env):
    reader, writer = await connect(env.fast)
    writer.write(req(env, "PUT", "/stall", body=BIG))
    for _ in range(200):
        front = next(iter(env.fast.lane.clients), None)
        if front is not None and front.paused and front.exchange.up is not None:
            break  # connected, and reading the client stopped: the app's socket is full
        await asyncio.sleep(0.01)
    assert front is not None and front.paused and front.exchange.up is not None
    await asyncio.sleep(0.2)
    up = front.exchange.up
    assert up is not None and up.transport.get_write_buffer_size() < (1 << 20)
    assert len(front.buf) < (1 << 20)  # the gateway holds no more than a few buffers
    env.up.stalled.transport.resume_reading()
    _, resp = await read_response(reader)
    assert resp.status == 200 and hashlib.sha256(BIG).hexdigest().encode() in resp.body
    writer.close()
    await settle(env)
    assert env.ctl.active == 0
