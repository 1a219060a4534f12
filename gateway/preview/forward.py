"""Forwarding a request to the host that owns its sandbox (``[cluster]``, docs/cluster.md).

The reverse proxy's pieces (gateway.preview.proxy, proxy_headers) do the work, pointed at
another gateway instead of a guest: bodies stream both ways with backpressure (the
request's ``StreamReader`` is the client's body, the response is relayed chunk by chunk),
WebSockets are spliced frame by frame, hop-by-hop headers are dropped, and everything
else crosses unchanged: the original Host (so the owner sees the same preview or session
host), ``Authorization`` and cookies (the owner authenticates, as it would the client).
The hop header (``gateway.cluster.routing.HOP_HEADER``) names this host, so the owner
never forwards it again.

Bounded: connecting to the owner has ``connect_timeout`` seconds and each read from it
``read_timeout`` (the proxy's own: ``[server] proxy_connect_timeout``/``proxy_read_timeout``,
since the owner may be waking the sandbox or waiting on its app). A failure
before the response started is ``owner_unavailable`` (503) or ``upstream_timeout`` (504);
after it started, the client's connection is closed (a truncated body is never passed off
as whole). A WebSocket the owner refuses is a 502 ``bad_gateway`` naming the owner's status
(its error body is not relayed).

The owner leaving the fleet ends what is in flight to it: the caller's ``live()`` (the
route cache still has that host's record) is checked every
``LIVENESS_POLL`` seconds, and once false a request still waiting for its answer gets 504
``upstream_timeout`` (it may have run there: its outcome is unknown), a response being
relayed is cut as above, and a spliced WebSocket is closed (1001). Without it, a request
on a pooled connection to a host that was cut off waited the whole ``read_timeout``
(tests/cluster/test_fleet_e2e.py found it), and a terminal WebSocket forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gateway.cluster.routing import HOP_HEADER
from gateway.errors import OwnerUnavailable
from gateway.preview.proxy import (
    SKIP_AUTO_HEADERS, WS_CLOSE_TIMEOUT, BadGateway, UpstreamTimeout, is_websocket, relay,
    send_continue, splice,
)
from gateway.preview.proxy_headers import upstream_headers

log = logging.getLogger(__name__)
LIVENESS_POLL = 0.25  # seconds between checks that the owner is still the live owner
Live = Callable[[], bool]


class _Watchdog:
    """Calls an entry's ``on_left()`` once its ``live()`` is false; one task polls every
    entry each ``LIVENESS_POLL`` seconds, and only while there are entries (a request
    pays a dict insert and delete, no timer of its own)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Live, Callable[[], object]]] = {}
        self._count = 0
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def watching(self, live: Live | None, on_left: Callable[[], object]) -> Iterator[None]:
        if live is None:
            yield
            return
        self._count += 1
        key = self._count
        self._entries[key] = (live, on_left)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        try:
            yield
        finally:
            self._entries.pop(key, None)

    async def _run(self) -> None:
        while self._entries:
            await asyncio.sleep(LIVENESS_POLL)
            for key, (live, on_left) in list(self._entries.items()):
                if key in self._entries and not live():
                    del self._entries[key]
                    try:
                        on_left()
                    except Exception:  # one entry's failure must not stop the others'
                        log.exception("ending a forward to an owner that left")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Forwarder:
    """One pooled client session to every other host; ``aclose()`` closes it."""

    def __init__(self, self_host: str, connect_timeout: float = 5.0,
                 read_timeout: float = 300.0, max_ws_message_bytes: int = 16 << 20) -> None:
        self.self_host, self.max_ws = self_host, max_ws_message_bytes
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                              sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._watchdog = _Watchdog()
        self.forwarded = 0

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=self._timeout,
                auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=SKIP_AUTO_HEADERS, trust_env=False,
                max_line_size=65536, max_field_size=65536)
        return self._session

    async def aclose(self) -> None:
        await self._watchdog.aclose()
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: web.Request, host: str, address: str,
                      live: Live | None = None) -> web.StreamResponse:
        """``live``: whether ``host`` is still live in the fleet (checked while the request
        is in flight; None: not checked). Not whether it still owns the sandbox: a DELETE
        removes the sandbox's record before the owner answers it."""
        self.forwarded += 1
        url = URL(f"http://{address}{request.raw_path}", encoded=True)
        if is_websocket(request):
            return await self._websocket(request, host, url, live)
        headers = self._headers(request, websocket=False)
        if request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        if request.body_exists:
            await send_continue(request)
        # A handler that read the body before the request was sent on (a sandbox that moved
        # while it waited: gateway/http/cluster_forward.py) left it in aiohttp's cache.
        read = getattr(request, "_read_bytes", None)
        body = read if read is not None else (request.content if request.body_exists else None)
        left = asyncio.timeout(None)  # expired at once by the watchdog if the owner leaves
        try:
            async with left:
                with self._watchdog.watching(live, lambda: left.reschedule(-1)):
                    upstream = await self.session().request(
                        request.method, url, headers=headers, data=body,
                        allow_redirects=False, compress=None)
        except aiohttp.ServerTimeoutError as exc:
            raise UpstreamTimeout(f"the owner {host} ({address}) did not answer in "
                                  "time") from exc
        except aiohttp.ClientError as exc:
            raise OwnerUnavailable(f"cannot forward to the owner {host} ({address}): "
                                   f"{exc}") from exc
        except TimeoutError as exc:
            if not left.expired():
                raise
            raise UpstreamTimeout(f"the owner {host} ({address}) left the fleet before it "
                                  "answered; the request may have run there") from exc
        try:
            # Closing the upstream makes relay() cut the client's connection.
            with self._watchdog.watching(live, upstream.close):
                return await relay(request, upstream, f"forward to {host}")
        finally:
            upstream.release()

    async def _websocket(self, request: web.Request, host: str, url: URL,
                         live: Live | None) -> web.StreamResponse:
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "")
                   .split(",") if p.strip()]
        try:
            upstream = await self.session().ws_connect(
                url, protocols=offered, headers=self._headers(request, websocket=True),
                max_msg_size=self.max_ws, autoping=False, autoclose=True, compress=0,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT))
        except aiohttp.WSServerHandshakeError as exc:
            raise BadGateway(f"the owner {host} refused the WebSocket ({exc.status} "
                             f"{exc.message})") from exc
        except aiohttp.ServerTimeoutError as exc:
            raise UpstreamTimeout(f"the owner {host} did not answer in time") from exc
        except aiohttp.ClientError as exc:
            raise OwnerUnavailable(f"cannot forward to the owner {host}: {exc}") from exc
        try:
            down = web.WebSocketResponse(
                protocols=[upstream.protocol] if upstream.protocol else [],
                max_msg_size=self.max_ws, autoping=False, autoclose=True, compress=False,
                timeout=WS_CLOSE_TIMEOUT)
            await down.prepare(request)
            closing: list[asyncio.Task[bool]] = []
            with self._watchdog.watching(live, lambda: closing.append(asyncio.ensure_future(
                    down.close(code=aiohttp.WSCloseCode.GOING_AWAY,
                               message=b"the sandbox's owner left the fleet")))):
                await splice(down, upstream)
            await asyncio.gather(*closing, return_exceptions=True)
            return down
        finally:
            if not upstream.closed:
                await upstream.close(code=1001)

    def _headers(self, request: web.Request, websocket: bool) -> CIMultiDict[str]:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        out = upstream_headers(
            request.headers, client_ip=peer[0] if peer else None, scheme=request.scheme,
            host=request.headers.get("Host", ""),
            version=(request.version.major, request.version.minor), websocket=websocket)
        out[HOP_HEADER] = self.self_host
        return out

