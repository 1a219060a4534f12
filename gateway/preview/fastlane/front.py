"""The client side of the fast lane: the listening socket's protocol, one per connection.

A ``FrontProtocol`` reads request heads (``request_head``), admits each one it can serve
(``_admit``: the preview router's ``admit`` and ``destination``, then the sandbox's
``try_request``) and runs it as an ``Exchange``, one at a time, later requests buffered up to
``PIPELINE_MAX`` (reading pauses beyond). The first request it cannot serve hands the connection
to aiohttp for good, at the request boundary (``hand_off``): the buffered bytes are replayed into
aiohttp's protocol. A head that repeats the last one's headers reuses its parse and admission
decision (``memo.Memo``; ``_again``). Reading the client pauses for two reasons (``Pause``):
too many pipelined bytes, or an upstream that cannot take more (or is still connecting).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from typing import TYPE_CHECKING

from yarl import URL

from gateway.errors import ApiError
from gateway.preview.access import TOKEN_HEADER, TOKEN_PARAM
from gateway.preview.fastlane.exchange import Exchange
from gateway.preview.fastlane.memo import Memo
from gateway.preview.fastlane.request_head import Request, Verdict, frame_head, parse_head
from gateway.preview.hosts import HostRequest, PreviewHost, Target, admit, destination

if TYPE_CHECKING:
    from gateway.preview.fastlane.lane import FastLane

log = logging.getLogger(__name__)

PIPELINE_MAX = 256 << 10  # buffered bytes of later requests before reading pauses


class Pause(enum.IntFlag):
    """Why reading the client is paused (both may hold)."""

    PIPELINE = 1  # more than PIPELINE_MAX bytes of later requests buffered
    UPSTREAM = 2  # the upstream is connecting, or its write buffer is full


def _query_token(query: str) -> str | None:
    """What ``request.query.get("token")`` is on aiohttp's side (yarl decodes the same way)."""
    if not query or (TOKEN_PARAM not in query and "%" not in query):
        return None
    return URL.build(query_string=query, encoded=True).query.get(TOKEN_PARAM)


class FrontProtocol(asyncio.Protocol):
    """One client connection: fast-lane requests until the first hand-off."""

    def __init__(self, lane: FastLane) -> None:
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.exchange: Exchange | None = None
        self.head_deadline = 0.0
        self.paused = Pause(0)  # why reading is paused
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
                self.pause(Pause.PIPELINE)

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
    def pause(self, reason: Pause) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self.paused |= reason

    def resume(self, reason: Pause) -> None:
        was = self.paused
        self.paused &= ~reason
        if was and not self.paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def pause_for_upstream(self) -> None:
        """The upstream is connecting, or cannot take more of the request body."""
        self.pause(Pause.UPSTREAM)

    def resume_for_upstream(self) -> None:
        self.resume(Pause.UPSTREAM)

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
        raw = frame_head(self.buf)
        if isinstance(raw, Verdict):
            if raw is Verdict.NOT_FAST:
                self.hand_off()
            return
        ex = self._take(raw)
        if ex is None:
            self.hand_off()
            return
        del self.buf[:len(raw)]
        self.exchange = ex
        ex.start()

    def _take(self, raw: bytes) -> Exchange | None:
        """The admitted exchange for the head ``raw``, or None: the request is aiohttp's."""
        memo = self.memo
        ex = self._again(memo, raw) if memo is not None else None
        if ex is None:
            req = parse_head(raw)
            ex = self._admit(req) if isinstance(req, Request) else None
        return ex

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
            decision = admit(found.hostname, found.sandbox_id, found.port, ctl.record,
                             lane.access, HostRequest(
                                 method=req.method, raw_path=req.raw_path,
                                 token_header=h.get(TOKEN_HEADER),
                                 cookie_headers=tuple(h.getall("Cookie", ())),
                                 origins=tuple(h.getall("Origin", ())),
                                 query_token=query_token, websocket=False, secure=secure))
            routed = destination(decision, ctl.record.tenant, found.sandbox_id, found.port,
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
        last_req, last_target = memo.last_req, memo.last_target
        if raw == memo.last_raw and last_req is not None and last_target is not None:
            # byte for byte the previous head: its target too
            if not memo.valid(self.lane):
                return None
            return self._lease(memo, last_req, last_target)
        # Only the target may be new (HeadTemplate.retarget); anything else is parsed whole.
        req = memo.template.retarget(raw)
        if req is None or not memo.valid(self.lane) \
                or _query_token(req.raw_path.partition("?")[2]) is not None:
            return None
        found = memo.found
        routed = destination(memo.decision, memo.ctl.record.tenant, found.sandbox_id,
                             found.port, found.hostname, memo.secure, req.raw_path)
        if not isinstance(routed, Target):
            return None
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
            self.resume(Pause.PIPELINE | Pause.UPSTREAM)
        self._arm()
        if self.buf:
            self.next_request()
