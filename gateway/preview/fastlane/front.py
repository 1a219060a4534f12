"""The preview fast lane: simple preview requests proxied without aiohttp on either side.

Theory of operation
-------------------
The daemon's listening socket speaks ``FrontProtocol``. Per connection it reads
request heads and parses them with httptools (llhttp), then either serves the
request itself or hands the connection to aiohttp for good.

It serves a request when all of these hold: the Host is a preview host, the
framing is plain (origin-form target, HTTP/1.0 or 1.1, no Upgrade, Expect or
Transfer-Encoding, at most one Content-Length, ASCII only, CRLF only, no
obs-fold, within aiohttp's line and header limits), it is not an SSE request,
``preview.admit`` and ``preview.destination`` (the two steps of ``preview.route``,
the aiohttp path's: one set of rules) answer with a ``Target``, the sandbox's
controller is RUNNING and admits it at once (``SandboxController.try_request``:
a free pacing slot, then the core's AdmitNow -> Admit; RequestLeft when the
exchange ends) and an upstream connection is pooled or connects. Anything else
(API hosts, errors, wakes, holds, redirects, WebSockets, chunked uploads,
malformed or ambiguous framing, a refused connect: aiohttp does the expose-port
retry) goes to aiohttp at the
request boundary, before any byte of that request went upstream: the buffered
bytes are replayed into ``runner.server()``'s protocol, which owns the
connection from then on.

What the app and the client see is what the aiohttp path gives them: the same
header rewriting (``proxy_headers``), the request line and headers aiohttp's
client would send, the response framing aiohttp's server would choose (bodies
without a length are re-chunked for HTTP/1.1 clients; an HTTP/1.0 client gets
a close-delimited body), 1xx interim responses dropped, and the same error
bodies for upstream failures before the response starts (504
``upstream_timeout``, 502 ``bad_gateway``). Once the response has started, a
broken upstream closes the client connection, so a truncated body is never
taken for a complete one.

Per connection, the last request's headers are memoized with their admission
decision and rewrite (``Memo``): a head that repeats them (keep-alive clients do)
skips the parse and ``preview.admit`` while the routing inputs are unchanged;
llhttp still checks every head that is not byte for byte the previous one, and
admission, pacing and activity are never memoized. Counts: ``/metrics``
``agentbox_events_total{event="fast_lane_served"|"fast_lane_handed_off"}``.

Not done here (aiohttp's path keeps them): the expose-port retry of a refused
connect, wakes and holds, WebSockets and SSE, and any request after a hand-off
(a connection never comes back from aiohttp).

Bounded: request heads by aiohttp's limits (anything bigger is handed off and
refused there), the time to send a head by ``header_read_timeout`` (armed when
the connection opens and after each response, like aiohttp's keep-alive
timer), pipelined bytes by ``PIPELINE_MAX`` (reading pauses), the upstream's
response head by ``MAX_RESPONSE_HEAD`` (502), silence from the upstream by
``proxy_read_timeout``, idle pooled connections by count and age. Flow control
both ways: a side whose write buffer is full pauses reading the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Callable
from typing import Any

import httptools
from aiohttp import web
from aiohttp.client_reqrep import ClientRequest
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time, should_remove_content_length
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_runner import BaseRunner, SockSite
from multidict import CIMultiDict
from yarl import URL

from gateway.http import info
from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.errors import ApiError
from gateway.preview.hosts import (
    HOSTS_KEY,
    HostRequest,
    PreviewHost,
    Target,
    admit,
    destination,
    error_page_for,
)
from gateway.preview.access import ACCESS_KEY, TOKEN_HEADER, TOKEN_PARAM
from gateway.preview.proxy import BadGateway, UpstreamTimeout
from gateway.preview.proxy_headers import downstream_headers, upstream_headers

log = logging.getLogger(__name__)

# aiohttp's server defaults (web_protocol.RequestHandler): anything beyond goes to aiohttp.
MAX_LINE = 8190
MAX_FIELD = 8190
MAX_HEADERS = 128
MAX_HEAD = 32 << 10  # bytes buffered without a complete head before handing off
PIPELINE_MAX = 256 << 10  # buffered bytes of later requests before reading pauses
MAX_RESPONSE_HEAD = 256 << 10  # in all
MAX_RESPONSE_FIELD = 65536  # per line: aiohttp's client (proxy.UpstreamPool) refuses longer
POOL_MAX_IDLE = 64  # idle upstream connections per (sandbox, VMM, port)
POOL_IDLE_S = 15.0
DRAIN_POLL_S = 0.05
GET_METHODS = ClientRequest.GET_METHODS

_PAUSE_PIPE, _PAUSE_UP = 1, 2


class FastLane:
    """Shared state of the front protocol (one per server, made once the app started)."""

    def __init__(self, app: web.Application, fallback: Callable[[], asyncio.Protocol]) -> None:
        server = app[info.SERVER_KEY]
        self.loop = asyncio.get_running_loop()
        self.hosts = app[HOSTS_KEY]
        self.access = app[ACCESS_KEY]
        self.service = app[SERVICE_KEY]
        self.running = getattr(self.service, "running", None)
        self.fallback = fallback
        self.rewrite_host = server.preview_rewrite_host
        self.public_https = server.public_scheme == "https"
        self.head_timeout = server.header_read_timeout
        self.read_timeout = server.proxy_read_timeout
        self.pool = RawPool(self.loop, server.proxy_connect_timeout, self.running)
        self.clients: set[FrontProtocol] = set()
        self.served = self.handed_off = 0  # counters (tests, debugging)
        self.draining = False  # shutting down: finish what is in flight, start nothing new
        # /metrics: agentbox_events_total{event="fast_lane_served"|"fast_lane_handed_off"}
        metrics = getattr(self.service, "metrics", None)
        self.events = metrics.events if metrics is not None else None
        # One timer for every deadline (no timer per request): late by at most a tick.
        self.tick = min(1.0, self.head_timeout / 4, self.read_timeout / 4)
        self.ticker = self.loop.call_later(self.tick, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        for client in list(self.clients):
            ex = client.exchange
            if ex is None:
                if client.head_deadline <= now:
                    client.close()  # its head did not arrive in time (or it idled too long)
            elif ex.up is not None and now - ex.up.last_read >= self.read_timeout:
                ex.up.timed_out()
        self.ticker = self.loop.call_later(self.tick, self._sweep)

    def __call__(self) -> FrontProtocol:
        return FrontProtocol(self)

    async def drain(self, timeout: float) -> None:
        """Shutting down (the listener is closed): idle connections close now, busy ones
        after their response, as aiohttp's own shutdown does; waits up to ``timeout``."""
        self.draining = True
        deadline = self.loop.time() + timeout
        while True:
            busy = False
            for client in list(self.clients):
                if client.exchange is None:
                    client.close()
                else:
                    busy = True
            if not busy or self.loop.time() >= deadline:
                return
            await asyncio.sleep(DRAIN_POLL_S)

    def close(self) -> None:
        self.ticker.cancel()
        for client in list(self.clients):
            client.close()
        self.pool.close()


class FastSite(SockSite):
    """``SockSite`` whose connections start in the fast lane (aiohttp's protocol is the
    fallback). Without a preview router or sandbox service it is a plain ``SockSite``."""

    def __init__(self, runner: BaseRunner, sock: socket.socket, **kwargs: Any) -> None:
        super().__init__(runner, sock, **kwargs)
        self.lane: FastLane | None = None

    async def start(self) -> None:
        await super(SockSite, self).start()  # BaseSite.start: registers the site
        server = self._runner.server
        assert server is not None
        app = getattr(self._runner, "app", None)
        factory: Callable[[], asyncio.Protocol] = server
        if app is not None and HOSTS_KEY in app and SERVICE_KEY in app and ACCESS_KEY in app:
            self.lane = FastLane(app, server)
            factory = self.lane
            log.info("preview fast lane on (gateway.preview.fastlane; [server] fast_lane = false "
                     "turns it off)")
        self._server = await asyncio.get_running_loop().create_server(
            factory, sock=self._sock, ssl=self._ssl_context, backlog=self._backlog)

    async def stop(self) -> None:
        if self.lane is not None:
            log.info("preview fast lane: %d requests served, %d connections handed to aiohttp",
                     self.lane.served, self.lane.handed_off)
            server = self._server
            if server is not None:
                server.close()
            await self.lane.drain(self._runner._shutdown_timeout)
            self.lane.close()
        await super().stop()


def run_app(app: web.Application, sock: socket.socket, loop: asyncio.AbstractEventLoop,
            **runner_options: Any) -> None:
    """``web.run_app(app, sock=sock, loop=loop, print=None, ...)`` with a ``FastSite``."""

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=True, **runner_options)
        await runner.setup()
        try:
            await FastSite(runner, sock).start()
            while True:
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket as ``TCPSite`` makes one (reuse_address)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.setblocking(False)
    return sock


# -- request heads --------------------------------------------------------------------------

class _Head:
    """httptools callbacks for one request head."""

    __slots__ = ("begun", "body", "complete", "done", "headers", "keep_alive", "parser", "url")

    def __init__(self) -> None:
        self.parser: Any = None
        self.keep_alive = True
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.begun = self.complete = self.done = 0
        self.body = False

    def on_message_begin(self) -> None:
        self.begun += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.complete += 1
        self.keep_alive = self.parser.should_keep_alive()  # reset once the message ends

    def on_body(self, body: bytes) -> None:
        self.body = True

    def on_message_complete(self) -> None:
        self.done += 1


_ORIGIN_FORM = re.compile(rb"/[!-\"$-~]*")  # "/" then printable ASCII but "#"


class Request:
    """One parsed request head the fast lane may serve."""

    __slots__ = ("content_length", "headers", "host", "keep_alive", "method", "raw",
                 "raw_path", "version")

    def __init__(self, raw: bytes, method: str, raw_path: str, version: tuple[int, int],
                 headers: CIMultiDict[str], host: str, content_length: int | None,
                 keep_alive: bool) -> None:
        self.raw, self.method, self.raw_path, self.version = raw, method, raw_path, version
        self.headers, self.host = headers, host
        self.content_length, self.keep_alive = content_length, keep_alive


def parse_head(raw: bytes) -> Request | None:
    """The request in ``raw`` (one complete head, ending in CRLF CRLF) if its framing is
    plain enough for the fast lane; None: hand it to aiohttp, which refuses or serves it."""
    if not raw.isascii() or raw.count(b"\n") != raw.count(b"\r\n") \
            or raw.count(b"\r") != raw.count(b"\r\n") or b"\n " in raw or b"\n\t" in raw \
            or raw.find(b"\r\n") > MAX_LINE:
        return None
    cb = _Head()
    parser = cb.parser = httptools.HttpRequestParser(cb)
    try:
        parser.feed_data(raw)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    if cb.begun != 1 or cb.complete != 1 or cb.body or cb.done > 1 or parser.should_upgrade():
        return None
    pairs = cb.headers
    if len(pairs) > MAX_HEADERS or any(len(k) + len(v) + 2 > MAX_FIELD for k, v in pairs):
        return None
    headers = CIMultiDict(pairs)
    for name in ("Transfer-Encoding", "Upgrade", "Expect"):
        if name in headers:
            return None
    hosts = headers.getall("Host", ())
    lengths = headers.getall("Content-Length", ())
    if len(hosts) != 1 or len(lengths) > 1:
        return None
    length = None
    if lengths:
        if not lengths[0].isdigit() or len(lengths[0]) > 18:
            return None
        length = int(lengths[0])
    if cb.done != (1 if not length else 0):
        return None
    if any("text/event-stream" in a for a in headers.getall("Accept", ())):
        return None  # SSE holds a stream slot, not a paced one: aiohttp's path
    url = cb.url.decode("latin-1")
    method = parser.get_method().decode("latin-1")
    version = parser.get_http_version()
    if not url.startswith("/") or "#" in url or method == "CONNECT" \
            or version not in ("1.1", "1.0"):
        return None
    return Request(raw, method, url, (1, 1) if version == "1.1" else (1, 0), headers,
                   hosts[0], length, cb.keep_alive)


def _query_token(query: str) -> str | None:
    """What ``request.query.get("token")`` is on aiohttp's side (yarl decodes the same way)."""
    if not query or (TOKEN_PARAM not in query and "%" not in query):
        return None
    return URL.build(query_string=query, encoded=True).query.get(TOKEN_PARAM)


def serialize(status_line: str, headers: CIMultiDict[str]) -> bytes:
    """A message head as aiohttp writes one (``_serialize_headers``)."""
    parts = [status_line, "\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError("a header contains a newline")
        parts += (name, ": ", value, "\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")


# -- the front protocol -----------------------------------------------------------------------

class FrontProtocol(asyncio.Protocol):
    """One client connection: fast-lane requests until the first hand-off."""

    def __init__(self, lane: FastLane) -> None:
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.exchange: Exchange | None = None
        self.head_deadline = 0.0
        self.paused = 0  # reasons reading is paused (bits)
        self.closed = False
        self.client_ip: str | None = None
        self.scheme = "http"
        self.writing_paused = False
        self.memo: Memo | None = None

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.lane.clients.add(self)
        peer = transport.get_extra_info("peername")
        self.client_ip = peer[0] if peer else None
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm()

    def data_received(self, data: bytes) -> None:
        try:
            self._received(data)
        except Exception:  # a bug of ours: never leave the connection (or its lease) hanging
            log.exception("fast lane: unexpected error; closing the client connection")
            self.close()

    def _received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is not None and ex.body_left and not self.buf and ex.up is not None:
            n = ex.body_left
            if len(data) <= n:
                ex.send_body(data)
                return
            ex.send_body(data[:n])
            data = data[n:]
        self.buf += data
        if ex is None:
            self.next_request()
        else:
            ex.pump_body()
            if len(self.buf) > PIPELINE_MAX:
                self.pause(_PAUSE_PIPE)

    def eof_received(self) -> bool | None:
        return None  # the transport closes, as aiohttp's protocol lets it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lane.clients.discard(self)
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.abandon()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.exchange is not None:
            self.exchange.pause_upstream()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.exchange is not None:
            self.exchange.resume_upstream()

    # reading
    def pause(self, reason: int) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self.paused |= reason

    def resume(self, reason: int) -> None:
        was = self.paused
        self.paused &= ~reason
        if was and not self.paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # the head timer (aiohttp's keepalive_timeout): FastLane._sweep checks it
    def _arm(self) -> None:
        self.head_deadline = self.lane.loop.time() + self.lane.head_timeout

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    # requests
    def next_request(self) -> None:
        """Start the next buffered request, or hand the connection off at its start."""
        if self.exchange is not None or self.closed:
            return
        buf = self.buf
        if not buf:
            return
        end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
        if end < 0:
            if len(buf) > MAX_HEAD:
                self.hand_off()
            return
        if buf[0] in (13, 10):  # empty lines before a request: llhttp's leniency, not ours
            self.hand_off()
            return
        raw = bytes(buf[:end + 4])
        memo = self.memo
        ex = self._again(memo, raw) if memo is not None else None
        if ex is None:
            req = parse_head(raw)
            ex = self._admit(req) if req is not None else None
        if ex is None:
            self.hand_off()
            return
        del buf[:end + 4]
        self.exchange = ex
        ex.start()

    def _admit(self, req: Request) -> Exchange | None:
        lane = self.lane
        found = lane.hosts.classify(req.host)
        if not isinstance(found, PreviewHost) or lane.running is None:
            return None
        ctl = lane.running(found.sandbox_id)
        if ctl is None:
            return None
        h = req.headers
        query_token = _query_token(req.raw_path.partition("?")[2])
        secure = self.scheme == "https" or lane.public_https
        try:
            decision = admit(found.hostname, found.sandbox_id, found.port, ctl.rec,
                             lane.access, HostRequest(
                                 method=req.method, raw_path=req.raw_path,
                                 token_header=h.get(TOKEN_HEADER),
                                 cookie_headers=tuple(h.getall("Cookie", ())),
                                 origins=tuple(h.getall("Origin", ())),
                                 query_token=query_token, websocket=False, secure=secure))
            routed = destination(decision, ctl.rec.tenant, found.sandbox_id, found.port,
                                 found.hostname, secure, req.raw_path)
        except (ApiError, ValueError):
            return None
        if not isinstance(routed, Target):
            return None
        memo = Memo(req, found, decision, secure, ctl, lane.access.get(found.sandbox_id))
        memo.last_raw, memo.last_req, memo.last_target = req.raw, req, routed
        self.memo = memo if query_token is None else None  # a URL token: decided per URL
        return self._lease(memo, req, routed)

    def _again(self, memo: Memo, raw: bytes) -> Exchange | None:
        """The head repeats the memo's but for the request target, perhaps: llhttp checks
        it whole; the headers, the access decision and their rewrite are the memo's."""
        if raw == memo.last_raw:  # byte for byte the previous head: its target too
            if not memo.valid(self.lane):
                return None
            return self._lease(memo, memo.last_req, memo.last_target)
        line_end = raw.find(b"\r\n")
        prefix, tail = memo.prefix, memo.tail
        if raw[line_end:] != memo.block or not raw.startswith(prefix) \
                or raw[line_end - len(tail):line_end] != tail or line_end > MAX_LINE \
                or not memo.valid(self.lane):
            return None
        # The headers are byte for byte ones llhttp accepted, and the request line is the
        # memo's method and version around a target: only the target is new. It must be an
        # origin-form target of printable ASCII without a fragment, a subset of what llhttp
        # takes (anything else is parsed whole on the first path).
        url = raw[len(prefix):line_end - len(tail)]
        if _ORIGIN_FORM.fullmatch(url) is None:
            return None
        raw_path = url.decode("ascii")
        if _query_token(raw_path.partition("?")[2]) is not None:
            return None
        found = memo.found
        routed = destination(memo.decision, memo.ctl.rec.tenant, found.sandbox_id, found.port,
                             found.hostname, memo.secure, raw_path)
        if not isinstance(routed, Target):
            return None
        req = Request(raw, memo.method, raw_path, memo.version, memo.headers, memo.host,
                      memo.content_length, memo.keep_alive)
        memo.last_raw, memo.last_req, memo.last_target = raw, req, routed
        return self._lease(memo, req, routed)

    def _lease(self, memo: Memo, req: Request, target: Target) -> Exchange | None:
        ex = Exchange(self, memo, req, target)
        lease = memo.ctl.try_request(ex.aborted)
        if lease is None:
            return None
        ex.lease = lease
        return ex

    def hand_off(self) -> None:
        """From now on the connection is aiohttp's: replay what we buffered into it."""
        if self.closed or self.transport is None:
            return
        self.lane.clients.discard(self)
        self.lane.handed_off += 1
        if self.lane.events is not None:
            self.lane.events["fast_lane_handed_off"] += 1
        transport, data = self.transport, bytes(self.buf)
        self.buf.clear()
        self.closed = True  # for us
        proto = self.lane.fallback()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if self.paused:
            transport.resume_reading()
        if self.writing_paused:
            proto.pause_writing()
        if data:
            proto.data_received(data)

    def finished(self, ex: Exchange, keep_alive: bool) -> None:
        """The exchange's response is complete (or the connection must close)."""
        if self.exchange is not ex:
            return
        self.exchange = None
        self.lane.served += 1
        if self.lane.events is not None:
            self.lane.events["fast_lane_served"] += 1
        if not keep_alive or self.lane.draining:
            self.close()
            return
        if self.paused:
            self.resume(_PAUSE_PIPE | _PAUSE_UP)
        self._arm()
        if self.buf:
            self.next_request()


# -- one exchange ---------------------------------------------------------------------------

class Memo:
    """A connection's last request headers, parsed, admitted and rewritten for the app, and
    the last response head's rewrite. Keep-alive clients repeat their headers byte for byte
    (browsers, polling, load) and often the method and version: such a head differs at most
    in its target, which ``preview.admit`` does not read (a URL carrying a token is never
    memoized), so while the routing inputs are the same objects (the running controller,
    its registry row, the access row) the decision holds and only ``preview.destination``
    runs again. A response head is reused only for a Content-Length body, while its Date
    holds."""

    __slots__ = ("access", "block", "content_length", "ctl", "decision", "found", "headers",
                 "host", "keep_alive", "last_raw", "last_req", "last_target", "method",
                 "prefix", "rec", "resp", "secure", "tail", "up_block", "version")

    def __init__(self, req: Request, found: PreviewHost, decision: Any, secure: bool,
                 ctl: Any, access: Any) -> None:
        line_end = req.raw.find(b"\r\n")
        self.block = req.raw[line_end:]  # the headers, from the CRLF ending the request line
        self.method, self.version = req.method, req.version
        self.prefix = req.method.encode("latin-1") + b" "
        self.tail = b" HTTP/%d.%d" % req.version
        self.headers, self.host = req.headers, req.host
        self.content_length, self.keep_alive = req.content_length, req.keep_alive
        self.found, self.decision, self.secure = found, decision, secure
        self.ctl = ctl
        self.rec = ctl.rec
        self.access = access
        self.up_block: bytes | None = None
        self.resp: RespMemo | None = None
        self.last_raw = b""  # the last head served, its request and target (set by the caller)
        self.last_req: Request | None = None
        self.last_target: Target | None = None

    def valid(self, lane: FastLane) -> bool:
        sid = self.found.sandbox_id
        return lane.running(sid) is self.ctl and self.ctl.rec is self.rec \
            and lane.access.get(sid) is self.access


class RespMemo:
    __slots__ = ("client_keep_alive", "date", "length", "out", "raw", "up_keep_alive")

    def __init__(self, raw: bytes, out: bytes, length: int, up_keep_alive: bool,
                 client_keep_alive: bool, date: str | None) -> None:
        self.raw, self.out, self.length = raw, out, length
        self.up_keep_alive, self.client_keep_alive, self.date = \
            up_keep_alive, client_keep_alive, date

class Exchange:
    """One request through the fast lane: admitted, sent upstream, answered."""

    def __init__(self, front: FrontProtocol, memo: Memo, req: Request, target: Target) -> None:
        self.front = front
        self.memo = memo
        self.req = req
        self.target = target
        self.lease: Any = None
        self.up: Upstream | None = None
        self.body_left = req.content_length or 0
        self.started = False  # a byte of the response went to the client
        self.done = False
        self.replayable = not self.body_left and req.method in ("GET", "HEAD", "OPTIONS")
        self.retried = False
        self.reused = False
        self.connecting: asyncio.Task | None = None

    # sending
    def start(self) -> None:
        lane = self.front.lane
        machine = self.lease.machine
        addr = machine.plan.slot.guest_addr
        driver = getattr(machine, "driver", None)
        key = (self.target.sandbox_id, getattr(driver, "pid", None),
               getattr(driver, "started_at", None), addr, self.target.port)
        self.key = key
        up = lane.pool.take(key)
        if up is not None:
            self._send(up, reused=True)
            return
        self.front.pause(_PAUSE_UP)
        self.connecting = lane.loop.create_task(self._connect(addr))

    async def _connect(self, addr: str) -> None:
        try:
            up = await self.front.lane.pool.connect(self.key, addr, self.target.port)
        except asyncio.CancelledError:
            return
        except OSError as exc:
            self.connecting = None
            if self.done:
                return
            log.debug("fast lane: connect to %s:%d failed (%r): aiohttp's path",
                      addr, self.target.port, exc)
            self._decline()
            return
        self.connecting = None
        if self.done:
            up.close()
            return
        self.front.resume(_PAUSE_UP)
        self._send(up, reused=False)

    def _decline(self) -> None:
        """Nothing went upstream: give the request (head and body) back and hand off."""
        front = self.front
        self.done = True
        self.lease.release()
        front.exchange = None
        front.buf[:0] = self.req.raw
        front.resume(_PAUSE_UP)
        front.hand_off()

    def _send(self, up: Upstream, reused: bool) -> None:
        self.up = up
        self.reused = reused
        up.begin(self)
        up.transport.write(self._request_head())
        if self.front.writing_paused:
            up.transport.pause_reading()
        self.pump_body()

    def _request_head(self) -> bytes:
        memo = self.memo
        if memo.up_block is None:
            memo.up_block = self._rewrite_headers()
        path_qs = self.target.path_qs
        if not path_qs.startswith("/"):
            path_qs = "/" + path_qs
        return f"{self.req.method} {path_qs} HTTP/1.1".encode("latin-1") + memo.up_block

    def _rewrite_headers(self) -> bytes:
        req, target = self.req, self.target
        out = upstream_headers(
            req.headers, client_ip=self.front.client_ip, scheme=self.front.scheme,
            host=req.host, version=req.version, drop=target.drop_headers,
            drop_cookie=target.drop_cookie, websocket=False,
            host_override=f"localhost:{target.port}" if self.front.lane.rewrite_host else None)
        if req.content_length is not None:
            out["Content-Length"] = str(req.content_length)
        elif req.method not in GET_METHODS:
            out["Content-Length"] = "0"  # what aiohttp's client adds
        # aiohttp's client puts Host first (ClientRequest.update_headers).
        headers: CIMultiDict[str] = CIMultiDict(Host=out.pop("Host"))
        headers.extend(out)
        return serialize("", headers)  # from the CRLF ending the request line

    def send_body(self, data: bytes) -> None:
        assert self.up is not None
        self.body_left -= len(data)
        self.up.transport.write(data)

    def pump_body(self) -> None:
        buf = self.front.buf
        if self.up is None or not self.body_left or not buf:
            return
        n = min(self.body_left, len(buf))
        chunk = bytes(buf[:n])
        del buf[:n]
        self.send_body(chunk)

    # flow control, response to the client
    def pause_upstream(self) -> None:
        if self.up is not None:
            self.up.pause_reading()

    def resume_upstream(self) -> None:
        if self.up is not None:
            self.up.resume_reading()

    def write(self, data: bytes) -> None:
        self.started = True
        front = self.front
        if front.transport is not None and not front.closed:
            front.transport.write(data)

    # endings
    def complete(self, keep_alive: bool) -> None:
        """The response went out in full."""
        if self.done:
            return
        self.done = True
        self.lease.release()
        self.front.finished(self, keep_alive and not self.body_left)

    def broke(self, error: ApiError | None) -> None:
        """The upstream failed: an error answer if nothing was sent yet, else close."""
        if self.done:
            return
        if not self.started and error is not None:
            if self.reused and self.replayable and not self.retried \
                    and isinstance(error, _Unanswered):
                self._retry()
                return
            self.done = True
            self.lease.release()
            keep = self.req.keep_alive and not self.body_left
            self._answer_error(error, keep)
            self.front.finished(self, keep_alive=keep)
            return
        log.info("%s: upstream broke mid-response (%s); closing the client connection",
                 self.target.sandbox_id, error)
        self.done = True
        self.lease.release()
        self.front.finished(self, keep_alive=False)

    def _retry(self) -> None:
        """A pooled connection the app had closed, for a bodiless idempotent request:
        nothing was sent that matters; once more on a new connection."""
        self.retried = True
        self.up = None
        self.front.pause(_PAUSE_UP)
        addr = self.key[3]
        self.connecting = self.front.lane.loop.create_task(self._connect(addr))

    def _answer_error(self, error: ApiError, keep_alive: bool) -> None:
        headers = self.req.headers
        resp = error_page_for(headers.get("Accept", ""), False, error.status, error.code,
                              str(error), getattr(error, "headers", None))
        out = CIMultiDict(resp.headers)
        body = resp.body if isinstance(resp.body, bytes) else b""
        out["Content-Length"] = str(len(body))
        self.write(head_for(self.req, resp.status, resp.reason, out, length=len(body),
                            keep_alive=keep_alive)[0] + body)

    def aborted(self, error: ApiError) -> None:
        """The VM died (the controller's AbortRequests): stop, answer if we still can."""
        if self.done:
            return
        self.done = True
        self._close_upstream()
        if not self.started:
            self._answer_error(error, keep_alive=False)
        self.front.finished(self, keep_alive=False)

    def abandon(self) -> None:
        """The client went away: release the admission, drop the upstream connection."""
        if self.connecting is not None:
            self.connecting.cancel()
        if not self.done:
            self.done = True
            self._close_upstream()
            self.lease.release()

    def _close_upstream(self) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.ex = None
            up.close()


def head_for(req: Request, status: int, reason: str, headers: CIMultiDict[str],
             length: int | None, keep_alive: bool) -> tuple[bytes, bool, bool]:
    """The response head aiohttp's server would write (``StreamResponse._prepare_headers``):
    returns it, whether the body is chunked, and whether the connection stays open."""
    chunked = False
    empty = must_be_empty_body(req.method, status)
    if length is None:
        if req.version >= (1, 1):
            if not empty:
                chunked = True
                headers["Transfer-Encoding"] = "chunked"
        elif not empty:
            keep_alive = False
    if empty:
        if "Content-Length" in headers and should_remove_content_length(req.method, status):
            del headers["Content-Length"]
        headers.popall("Transfer-Encoding", None)
    elif length != 0:
        headers.setdefault("Content-Type", "application/octet-stream")
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    headers.setdefault("Server", SERVER_SOFTWARE)
    if "Connection" not in headers:
        if keep_alive:
            if req.version == (1, 0):
                headers["Connection"] = "keep-alive"
        elif req.version == (1, 1):
            headers["Connection"] = "close"
    line = f"HTTP/{req.version[0]}.{req.version[1]} {status} {reason}"
    return serialize(line, headers), chunked, keep_alive


# -- upstream connections -----------------------------------------------------------------------

class _Unanswered(BadGateway):
    """The app closed the connection before any byte of a response."""


class RawPool:
    """Idle upstream connections per (sandbox, VMM pid, VMM start, address, port): a new
    VMM has a new key, so connections to an old one are never reused (and die with it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connect_timeout: float,
                 running: Callable[[str], Any] | None = None) -> None:
        self.loop = loop
        self.running = running
        self.connect_timeout = connect_timeout
        self.idle: dict[tuple[Any, ...], list[Upstream]] = {}
        self.vmm: dict[str, tuple[Any, ...]] = {}  # the VMM each sandbox's connections reach
        self.sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    def take(self, key: tuple[Any, ...]) -> Upstream | None:
        conns = self.idle.get(key)
        while conns:
            up = conns.pop()
            if not up.lost:
                up.idle = False
                return up
        return None

    async def connect(self, key: tuple[Any, ...], host: str, port: int) -> Upstream:
        async with asyncio.timeout(self.connect_timeout):
            _, up = await self.loop.create_connection(lambda: Upstream(self, key), host, port)
        return up

    def give_back(self, up: Upstream) -> None:
        if self.closed or up.lost:
            up.close()
            return
        sandbox, vmm = up.key[0], up.key[1:3]
        if self.vmm.get(sandbox) != vmm:  # a new VMM: the old one's connections are dead
            self.vmm[sandbox] = vmm
            for key in [k for k in self.idle if k[0] == sandbox and k[1:3] != vmm]:
                for old in self.idle.pop(key):
                    old.close()
        conns = self.idle.setdefault(up.key, [])
        if len(conns) >= POOL_MAX_IDLE:
            up.close()
            return
        up.idle = True
        up.idle_since = self.loop.time()
        conns.append(up)
        if self.sweeper is None:
            self.sweeper = self.loop.call_later(POOL_IDLE_S, self._sweep)

    def forget(self, up: Upstream) -> None:
        conns = self.idle.get(up.key)
        if conns and up in conns:
            conns.remove(up)
            if not conns:
                del self.idle[up.key]

    def _sweep(self) -> None:
        """Close connections idle for POOL_IDLE_S, and those of sandboxes no longer running
        (a stopped VMM's guest never sends the FIN)."""
        self.sweeper = None
        cutoff = self.loop.time() - POOL_IDLE_S
        for key, conns in list(self.idle.items()):
            gone = self.running is not None and self.running(key[0]) is None
            for up in [u for u in conns if gone or u.idle_since <= cutoff]:
                conns.remove(up)
                up.close()
            if not conns:
                del self.idle[key]
        live = {key[0] for key in self.idle}
        self.vmm = {sandbox: vmm for sandbox, vmm in self.vmm.items() if sandbox in live}
        if self.idle:
            self.sweeper = self.loop.call_later(POOL_IDLE_S, self._sweep)

    def close(self) -> None:
        self.closed = True
        if self.sweeper is not None:
            self.sweeper.cancel()
        for conns in self.idle.values():
            for up in conns:
                up.close()
        self.idle.clear()


class Upstream(asyncio.Protocol):
    """One raw connection to an app in a sandbox; one exchange at a time."""

    def __init__(self, pool: RawPool, key: tuple[Any, ...]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.ex: Exchange | None = None
        self.lost = False
        self.idle = False
        self.idle_since = 0.0
        self.reading_paused = False
        self.last_read = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # one exchange
    def begin(self, ex: Exchange) -> None:
        self.ex = ex
        self.parser: Any = None  # made on the first bytes, unless a memo answers them
        self.raw_left = 0  # bytes of a memoized Content-Length body still to come
        self.candidate: tuple[bytes, int, bool, str | None] | None = None
        self.head_bytes = 0
        self.headers: list[tuple[str, str]] = []
        self.reason = ""
        self.status = 0
        self.responded = False  # headers of the final response seen
        self.chunked = False
        self.until_close = False
        self.keep_alive = True
        self.out: list[bytes] = []
        self.message_done = False
        self.interim = False
        self.last_read = self.pool.loop.time()

    def timed_out(self) -> None:
        """Nothing from the app for ``proxy_read_timeout`` (FastLane._sweep)."""
        ex = self.ex
        if ex is None:
            return
        self._fail(UpstreamTimeout(f"the app on port {ex.target.port} did not answer in time"))

    def data_received(self, data: bytes) -> None:
        try:
            self._received(data)
        except Exception:  # a bug of ours: never leave either connection hanging
            log.exception("fast lane: unexpected error; closing both connections")
            ex = self.ex
            self.close()
            if ex is not None:
                ex.front.close()

    def _received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None:  # bytes on an idle connection: it cannot be trusted for the next
            self.close()
            return
        self.last_read = self.pool.loop.time()
        if self.raw_left:
            self._raw_body(ex, data)
            return
        first = self.parser is None
        if first:
            rm = ex.memo.resp
            if rm is not None and data.startswith(rm.raw) \
                    and (rm.date is None or rm.date == rfc822_formatted_time()):
                self._memo_head(ex, rm, data)
                return
            self.parser = httptools.HttpResponseParser(self)
        if not self.responded:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadGateway(f"proxying to port {ex.target.port} failed: the app sent "
                                  f"an invalid response ({exc})"))
            return
        except httptools.HttpParserUpgrade:
            self._fail(BadGateway(f"the app on port {ex.target.port} switched protocols "
                                  "unasked"))
            return
        if self.ex is not ex:
            return  # failed inside the callbacks
        if first and self.candidate is not None and self.responded:
            out, length, ka, date = self.candidate
            ex.memo.resp = RespMemo(data[:data.index(b"\r\n\r\n") + 4], out, length,
                                    self.keep_alive, ka, date)
        if self.message_done:
            self._done()
            return
        if not self.responded and self.head_bytes > MAX_RESPONSE_HEAD:
            self._fail(BadGateway(f"the app on port {ex.target.port} sent a response head "
                                  f"over {MAX_RESPONSE_HEAD} bytes"))
            return
        self._flush()

    def _memo_head(self, ex: Exchange, rm: RespMemo, data: bytes) -> None:
        """The same response head as last time for this request: its rewrite is known."""
        self.responded = True
        self.keep_alive = rm.up_keep_alive
        self.client_keep_alive = rm.client_keep_alive
        body = data[len(rm.raw):]
        if len(body) > rm.length:  # more than the length said: never reuse it
            body = body[:rm.length]
            self.keep_alive = False
        self.raw_left = rm.length - len(body)
        ex.write(rm.out + body)  # one write, as aiohttp's path does for a body already here
        if not self.raw_left:
            self._done()

    def _raw_body(self, ex: Exchange, data: bytes) -> None:
        if len(data) > self.raw_left:  # more than the length said: never reuse it
            data = data[:self.raw_left]
            self.keep_alive = False
        self.raw_left -= len(data)
        ex.write(data)
        if not self.raw_left:
            self._done()

    def _flush(self) -> None:
        if self.out and self.ex is not None:
            out, self.out = self.out, []
            self.ex.write(out[0] if len(out) == 1 else b"".join(out))

    # httptools callbacks (they only record: data_received acts once feed_data returns)
    def on_message_begin(self) -> None:
        if self.message_done:
            self.keep_alive = False  # bytes after the response: never reuse the connection

    def on_status(self, reason: bytes) -> None:
        self.reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > MAX_RESPONSE_FIELD:
            raise ValueError("a response header line over the limit")
        if len(self.headers) >= MAX_HEADERS:
            raise ValueError("too many response headers")
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        ex = self.ex
        assert ex is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): aiohttp drops them
            self.headers, self.reason = [], ""
            self.interim = True
            return
        self.responded = True
        self.status = status
        raw = CIMultiDict(self.headers)
        self.keep_alive = self.parser.should_keep_alive()
        te = raw.get("Transfer-Encoding", "")
        lengths = raw.getall("Content-Length", ())
        length = int(lengths[0]) if len(lengths) == 1 and lengths[0].isdigit() else None
        req = ex.req
        no_body = req.method == "HEAD" or status in (204, 304)
        if not no_body and length is None and "chunked" not in te.lower():
            self.until_close = True
            self.keep_alive = False
        if req.method == "HEAD":
            self.keep_alive = False  # llhttp cannot be told the request was HEAD
        out = downstream_headers(raw, req.version)
        if ex.target.set_cookie:
            out.add("Set-Cookie", ex.target.set_cookie)
        try:
            head, self.chunked, ka = head_for(req, status, self.reason, out,
                                              length=out_length(out), keep_alive=req.keep_alive)
        except ValueError:
            raise BadGateway("the app sent a header aiohttp would refuse") from None
        self.client_keep_alive = ka
        self.out.append(head)
        if req.method == "HEAD":
            self.message_done = True
        elif length is not None and "Transfer-Encoding" not in raw and self.keep_alive \
                and not self.interim and not must_be_empty_body(req.method, status):
            self.candidate = (head, length, ka, None if "Date" in raw else out["Date"])

    def on_body(self, body: bytes) -> None:
        if self.ex is None or not self.responded or self.message_done:
            return
        if must_be_empty_body(self.ex.req.method, self.status):
            return
        if self.chunked:
            self.out += (b"%x\r\n" % len(body), body, b"\r\n")
        else:
            self.out.append(body)

    def on_message_complete(self) -> None:
        if self.responded:
            self.message_done = True

    def _done(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self._flush()
        ex, self.ex = self.ex, None
        assert ex is not None
        ex.up = None
        if self.keep_alive and not self.until_close and not ex.body_left:
            self.pool.give_back(self)
        else:
            self.close()
        ex.complete(self.client_keep_alive)

    def _fail(self, error: ApiError) -> None:
        ex, self.ex = self.ex, None
        self.close()
        if ex is not None:
            ex.up = None
            if self.responded:
                self._flush_to(ex)
                ex.broke(None if not isinstance(error, ApiError) else error)
                return
            ex.broke(error)

    def _flush_to(self, ex: Exchange) -> None:
        if self.out:
            out, self.out = self.out, []
            ex.write(b"".join(out))

    # flow control
    def pause_reading(self) -> None:
        if not self.reading_paused and not self.lost:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and not self.lost:
            self.reading_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        if self.ex is not None:
            self.ex.front.pause(_PAUSE_UP)

    def resume_writing(self) -> None:
        if self.ex is not None:
            self.ex.front.resume(_PAUSE_UP)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.idle:
            self.pool.forget(self)
        ex = self.ex
        if ex is None:
            return
        if (self.until_close or self.message_done) and self.responded and exc is None:
            self._done()  # a close-delimited body ends here
            return
        self.ex = None
        ex.up = None
        if self.responded:
            self._flush_to(ex)
            ex.broke(None)
        else:
            ex.broke(_Unanswered(f"the app on port {ex.target.port} closed the connection "
                                 "without answering"))

    def close(self) -> None:
        if not self.lost and self.transport is not None:
            self.lost = True
            self.transport.close()


def out_length(headers: CIMultiDict[str]) -> int | None:
    value = headers.get("Content-Length")
    return int(value) if value is not None and value.isdigit() else None
