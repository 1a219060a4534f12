"""The app side of a fast-lane exchange: one raw connection to an app in a sandbox.

An ``Upstream`` carries one exchange at a time. It parses the app's response with httptools,
drops 1xx interim responses, rewrites the head as aiohttp's path would (``proxy_headers``,
``response_head.head_for``) and streams the body to the client: re-chunked when the app sent
no length to an HTTP/1.1 client, close-delimited to an HTTP/1.0 one. A failure before the
response started becomes the error answer aiohttp's path gives (504 ``upstream_timeout``, 502
``bad_gateway``); after, the client connection closes, so a truncated body is never taken for
a complete one. Bounded: the response head by ``MAX_RESPONSE_HEAD`` in all and
``MAX_RESPONSE_FIELD`` per line, silence by ``proxy_read_timeout`` (the lane's sweep calls
``timed_out``).

A response head the same as the last one for this connection's request (``memo.RespMemo``),
with a Content-Length body, skips the parse: its rewrite is known, and the body is counted
through as raw bytes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

import httptools
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time
from multidict import CIMultiDict

from gateway.errors import ApiError
from gateway.preview.fastlane.memo import RespMemo
from gateway.preview.fastlane.request_head import MAX_HEADERS
from gateway.preview.fastlane.response_head import head_for, out_length
from gateway.preview.proxy import BadGateway, UpstreamTimeout
from gateway.preview.proxy_headers import downstream_headers

if TYPE_CHECKING:
    from gateway.preview.fastlane.exchange import Exchange
    from gateway.preview.fastlane.upstream_pool import RawPool

log = logging.getLogger(__name__)

MAX_RESPONSE_HEAD = 256 << 10  # in all
MAX_RESPONSE_FIELD = 65536  # per line: aiohttp's client (proxy.UpstreamPool) refuses longer


class Unanswered(BadGateway):
    """The app closed the connection before any byte of a response."""


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
            self.ex.front.pause_for_upstream()

    def resume_writing(self) -> None:
        if self.ex is not None:
            self.ex.front.resume_for_upstream()

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
            ex.broke(Unanswered(f"the app on port {ex.target.port} closed the connection "
                                 "without answering"))

    def close(self) -> None:
        if not self.lost and self.transport is not None:
            self.lost = True
            self.transport.close()
