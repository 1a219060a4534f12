"""Streaming reverse proxy from the gateway to an app inside a sandbox (HTTP + WebSockets).

Theory of operation
-------------------
The caller (``gateway.preview.hosts``) has already decided *which* sandbox and port
and that the client may see it. Here a request is held in
``SandboxService.use()`` (``use_stream()`` for WebSockets, which are counted as
activity for as long as they are open), so a suspended sandbox wakes first and
an open exchange keeps it awake. Only then is ``100 Continue`` sent (the route's
expect handler defers it), and the request goes to ``guest_addr:port``, which
the host can reach for any TCP port.

Bodies stream both ways with backpressure: the request body is the server's
``StreamReader`` handed to the client (its reads pause the socket), the
response is relayed with ``iter_any()`` and every ``write`` waits for the client
to drain. Nothing is decompressed or re-encoded on either side.

Retries happen only where no byte went upstream: a refused connection (the
app may listen on 127.0.0.1 only: ask the guest agent to expose the port, then
try once more), and a pooled connection found dead for a bodiless idempotent
request. Errors before the response starts become JSON/HTML errors
(``port_closed`` 502, ``upstream_timeout`` 504, ``bad_gateway`` 502); once the
response has started, a broken upstream closes the client's connection, so a
truncated body is never taken for a complete one.

Connections are pooled per VMM: one ``ClientSession`` per (sandbox, VMM pid,
start time). A restore makes a new VMM, and the old pool is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from yarl import URL

from gateway.errors import ApiError
from gateway.preview.proxy_headers import downstream_headers, mirror_close_code, upstream_headers
from gateway.sandbox import guest

log = logging.getLogger(__name__)
T = TypeVar("T")
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
WS_CLOSE_TIMEOUT = 10.0
DEFAULT_WS_LIMIT = 16 << 20  # ServerConfig.max_ws_message_bytes


class PortClosed(ApiError):
    status = 502
    code = "port_closed"


class UpstreamTimeout(ApiError):
    status = 504
    code = "upstream_timeout"


class BadGateway(ApiError):
    status = 502
    code = "bad_gateway"


@dataclass(frozen=True)
class Target:
    """Where one request goes, and what the preview layer wants changed on the way."""

    tenant: str
    sandbox_id: str
    port: int
    path_qs: str  # raw (still encoded) path and query for the app
    drop_headers: frozenset[str] = frozenset()  # our credentials: never shown to the app
    drop_cookie: str | None = None  # the preview cookie: never shown to the app either
    set_cookie: str | None = None  # added to the response (preview token cookie)


def is_websocket(request: web.Request) -> bool:
    return request.method == "GET" and request.headers.get("Upgrade", "").lower() == "websocket"


async def send_continue(request: web.Request) -> None:
    """Answer ``Expect: 100-continue`` now (the route's expect handler deferred it)."""
    if request.headers.get("Expect", "").lower() == "100-continue" and \
            request.version >= (1, 1) and request.writer.output_size == 0:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0


async def deferred_expect(request: web.Request) -> None:
    """Expect handler for proxied routes: refuse unknown expectations, defer 100-continue."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown Expect: {request.headers['Expect']}")


class UpstreamPool:
    """One client session per running VMM of a sandbox (pooled connections die with it)."""

    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                             sock_read=read_timeout)
        self._sessions: dict[str, tuple[tuple[Any, ...], aiohttp.ClientSession]] = {}
        self._closing: set[asyncio.Task] = set()

    def session_for(self, sandbox_id: str, machine: Any) -> aiohttp.ClientSession:
        driver = getattr(machine, "driver", None)
        vmm = (getattr(driver, "pid", None), getattr(driver, "started_at", None))
        entry = self._sessions.get(sandbox_id)
        if entry is not None and entry[0] == vmm and not entry[1].closed:
            return entry[1]
        if entry is not None:
            self._close_later(entry[1], f"proxy-pool-close-{sandbox_id}")
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=self.timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=SKIP_AUTO_HEADERS, trust_env=False,
            max_line_size=65536, max_field_size=65536)
        self._sessions[sandbox_id] = (vmm, session)
        return session

    def _close_later(self, session: aiohttp.ClientSession, name: str) -> None:
        task = asyncio.ensure_future(session.close())
        task.set_name(name)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        sessions = [s for _, s in self._sessions.values()]
        self._sessions.clear()
        await asyncio.gather(*(s.close() for s in sessions), *self._closing,
                             return_exceptions=True)


class _OneWriteResponse(web.StreamResponse):
    """Headers buffered until the first body write (as ``web.Response`` does in aiohttp)."""

    _send_headers_immediately = False


class Proxy:
    def __init__(self, service: Any, pool: UpstreamPool, rewrite_host: bool = False,
                 max_ws_message_bytes: int = DEFAULT_WS_LIMIT) -> None:
        self.service = service
        self.pool = pool
        self.rewrite_host = rewrite_host
        # Both sockets of a spliced pair get the same bound, so any message one side may
        # send is one the other side accepts; aiohttp refuses a bigger frame from its
        # header (close 1009) before buffering any of its payload.
        self.max_ws = max_ws_message_bytes

    async def handle(self, request: web.Request, target: Target) -> web.StreamResponse:
        if is_websocket(request):
            return await self.websocket(request, target)
        return await self.http(request, target)

    # -- HTTP ------------------------------------------------------------------------

    async def http(self, request: web.Request, target: Target) -> web.StreamResponse:
        # Server-sent events stay open for as long as the page does: count them like a
        # WebSocket rather than take one of the sandbox's paced request slots for hours.
        sse = "text/event-stream" in request.headers.get("Accept", "")
        use = self.service.use_stream if sse else self.service.use
        async with use(target.tenant, target.sandbox_id) as machine:
            await send_continue(request)
            session = self.pool.session_for(target.sandbox_id, machine)
            headers = self._headers(request, target, websocket=False)
            if request.content_length is not None:
                headers["Content-Length"] = str(request.content_length)
            body = request.content if request.body_exists else None
            url = self._url(machine, target)
            replayable = body is None and request.method in IDEMPOTENT

            def attempt() -> Awaitable[aiohttp.ClientResponse]:
                return session.request(request.method, url, headers=headers, data=body,
                                       allow_redirects=False, compress=None)

            upstream = await self._connect(machine, target, attempt, replayable)
            try:
                return await self._relay(request, upstream, target)
            finally:
                upstream.release()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     target: Target) -> web.StreamResponse:
        return await relay(request, upstream, target.sandbox_id, target.set_cookie)

    # -- WebSockets -----------------------------------------------------------------

    async def websocket(self, request: web.Request, target: Target) -> web.StreamResponse:
        async with self.service.use_stream(target.tenant, target.sandbox_id) as machine:
            session = self.pool.session_for(target.sandbox_id, machine)
            headers = self._headers(request, target, websocket=True)
            offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "")
                       .split(",") if p.strip()]
            url = self._url(machine, target)

            def attempt() -> Awaitable[aiohttp.ClientWebSocketResponse]:
                return session.ws_connect(
                    url, protocols=offered, headers=headers, max_msg_size=self.max_ws,
                    autoping=False, autoclose=True, compress=0,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT))

            upstream = await self._connect(machine, target, attempt, replayable=True)
            try:
                down = web.WebSocketResponse(
                    protocols=[upstream.protocol] if upstream.protocol else [],
                    max_msg_size=self.max_ws, autoping=False, autoclose=True, compress=False,
                    timeout=WS_CLOSE_TIMEOUT)
                if target.set_cookie:
                    down.headers.add("Set-Cookie", target.set_cookie)
                await down.prepare(request)
                await splice(down, upstream)
                return down
            finally:
                if not upstream.closed:  # cancelled before any close was forwarded
                    await asyncio.shield(upstream.close(code=1001))

    # -- shared ---------------------------------------------------------------------

    def _headers(self, request: web.Request, target: Target, websocket: bool) -> Any:
        host = request.headers.get("Host", "")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return upstream_headers(
            request.headers, client_ip=peer[0] if peer else None, scheme=request.scheme,
            host=host, version=(request.version.major, request.version.minor),
            drop=target.drop_headers, drop_cookie=target.drop_cookie, websocket=websocket,
            host_override=f"localhost:{target.port}" if self.rewrite_host else None)

    @staticmethod
    def _url(machine: Any, target: Target) -> URL:
        addr = machine.plan.slot.guest_addr
        path_qs = target.path_qs if target.path_qs.startswith("/") else "/" + target.path_qs
        return URL(f"http://{addr}:{target.port}{path_qs}", encoded=True)

    async def _connect(self, machine: Any, target: Target,
                       attempt: Callable[[], Awaitable[T]], replayable: bool) -> T:
        """Run ``attempt``; retry only failures where nothing reached the app."""
        exposed = retried = False
        while True:
            try:
                return await attempt()
            except aiohttp.WSServerHandshakeError as exc:
                raise BadGateway(f"the app on port {target.port} refused the WebSocket "
                                 f"handshake ({exc.status} {exc.message})") from exc
            except aiohttp.ClientConnectorError as exc:
                if not isinstance(exc.os_error, ConnectionRefusedError):
                    raise BadGateway(f"cannot reach port {target.port} in sandbox "
                                     f"{target.sandbox_id}: {exc.os_error}") from exc
                if exposed or not await self._expose(machine, target):
                    raise PortClosed(f"nothing is listening on port {target.port} in sandbox "
                                     f"{target.sandbox_id}") from exc
                exposed = True
            except aiohttp.ServerTimeoutError as exc:
                raise UpstreamTimeout(f"the app on port {target.port} did not answer in "
                                      "time") from exc
            except aiohttp.ServerDisconnectedError as exc:
                if not replayable or retried:
                    raise BadGateway(f"the app on port {target.port} closed the connection "
                                     "without answering") from exc
                retried = True  # a pooled connection the app had closed: nothing was sent
            except aiohttp.ClientError as exc:
                raise BadGateway(f"proxying to port {target.port} failed: {exc}") from exc

    @staticmethod
    async def _expose(machine: Any, target: Target) -> bool:
        """Ask the guest agent to forward a port bound to 127.0.0.1 (True if it did)."""
        try:
            result = await guest.expose_port(machine, target.port)
        except Exception as exc:
            log.debug("%s: expose_port(%d) failed: %s", target.sandbox_id, target.port, exc)
            return False
        return result is not False


PROXY_KEY = web.AppKey("proxy", Proxy)


async def relay(request: web.Request, upstream: aiohttp.ClientResponse, label: str,
                set_cookie: str | None = None) -> web.StreamResponse:
    """Stream ``upstream``'s response to the client (also the cluster's forwarder's)."""
    # A body that has already arrived in full goes out in the headers' write (one
    # syscall instead of two: bench/gateway.py). Headers of a body still streaming are
    # sent at once, so an SSE or long-poll client sees them before the first event.
    cls = _OneWriteResponse if upstream.content.is_eof() else web.StreamResponse
    resp = cls(status=upstream.status, reason=upstream.reason,
               headers=downstream_headers(upstream.headers, request.version))
    if set_cookie:
        resp.headers.add("Set-Cookie", set_cookie)
    await resp.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        log.info("%s: upstream broke mid-response (%r); closing the client connection",
                 label, exc)
        if request.protocol is not None:
            request.protocol.force_close()  # type: ignore[attr-defined]
        return resp
    await resp.write_eof()
    return resp


async def splice(down: web.WebSocketResponse, up: aiohttp.ClientWebSocketResponse) -> None:
    """Pump frames both ways until one side closes; that side's pump closes the other."""
    to_up = asyncio.ensure_future(_pump(down, up, from_upstream=False))
    to_up.set_name("ws-client-to-app")
    to_down = asyncio.ensure_future(_pump(up, down, from_upstream=True))
    to_down.set_name("ws-app-to-client")
    try:
        await asyncio.wait({to_up, to_down}, return_when=asyncio.FIRST_COMPLETED)
        # The other pump ends when its socket is closed (at most the close timeout).
        await asyncio.wait({to_up, to_down}, timeout=WS_CLOSE_TIMEOUT)
    finally:
        for task in (to_up, to_down):
            task.cancel()
        await asyncio.gather(to_up, to_down, return_exceptions=True)


async def _pump(src: Any, dst: Any, from_upstream: bool) -> None:
    """Forward messages from ``src`` to ``dst``; when ``src`` ends, close ``dst`` with the
    mirrored code. The close is shielded: the client leaving right after its close frame
    cancels this handler, and the app must still hear the code."""
    while True:
        msg = await src.receive()
        kind = msg.type
        try:
            if kind is aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif kind is aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            elif kind is aiohttp.WSMsgType.PING:
                await dst.ping(msg.data)
            elif kind is aiohttp.WSMsgType.PONG:
                await dst.pong(msg.data)
            else:
                break
        except ConnectionError:
            return  # dst is gone; its own pump sees that and closes src
    if kind is aiohttp.WSMsgType.CLOSE:
        code, reason = msg.data, (msg.extra or "").encode()
    elif kind is aiohttp.WSMsgType.ERROR and isinstance(msg.data, aiohttp.WebSocketError):
        # A protocol error of src's, e.g. a frame over the limit: aiohttp sent src that code
        # (1009) and dropped its socket (so close_code reads 1006); the other side hears why.
        code, reason = msg.data.code, _reason(msg.data.code)
    else:  # CLOSING, CLOSED, ERROR: the connection broke without a close frame
        code, reason = src.close_code, b""
    if not dst.closed:
        await asyncio.shield(dst.close(code=mirror_close_code(code, from_upstream),
                                       message=reason))


def _reason(code: int) -> bytes:
    return b"the peer sent a message over the size limit" if code == 1009 else b""
