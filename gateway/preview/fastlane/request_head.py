"""Request heads for the fast lane, sans I/O: bytes in; a parsed head, NEED_MORE, or NOT_FAST out.

The fast lane serves only requests whose framing is plain, so that it and aiohttp can never
disagree about where a request ends (request smuggling) and what it says. ``frame_head`` finds a
complete head at the start of a connection's buffer, within aiohttp's limits; ``parse_head``
parses one with httptools (llhttp) and accepts it only if the framing is plain: origin-form
target, HTTP/1.0 or 1.1, no Upgrade, Expect or Transfer-Encoding, one Host, at most one
Content-Length, ASCII only, CRLF only, no obs-fold, within aiohttp's line and header limits, and
not an SSE request. Anything else is NOT_FAST: aiohttp gets the connection and refuses or serves
it (the limits here are aiohttp's, so a head too big for us is too big for it).

``HeadTemplate`` is a parsed head minus its target: keep-alive clients repeat their headers byte
for byte, and a head that differs only in an origin-form target reuses the parse.

No asyncio, no sockets: the front protocol (``front.py``) does the I/O.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any

import httptools
from multidict import CIMultiDict

# aiohttp's server defaults (web_protocol.RequestHandler): anything beyond goes to aiohttp.
MAX_LINE = 8190
MAX_FIELD = 8190
MAX_HEADERS = 128
MAX_HEAD = 32 << 10  # bytes buffered without a complete head before handing off

_ORIGIN_FORM = re.compile(rb"/[!-\"$-~]*")  # "/" then printable ASCII but "#"


class Verdict(enum.Enum):
    """What a head that is not (yet) a request for the fast lane gets."""

    NEED_MORE = "need more bytes"  # no complete head yet, within the bounds
    NOT_FAST = "not for the fast lane"  # aiohttp's: hand the connection off


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

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.raw_path} HTTP/{self.version[0]}.{self.version[1]}>"


def frame_head(buf: bytes | bytearray) -> bytes | Verdict:
    """The complete head at the start of ``buf`` (through its CRLF CRLF), NEED_MORE while
    none is there within ``MAX_HEAD`` bytes, or NOT_FAST (too long, or empty lines before the
    request: llhttp's leniency, not ours)."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
    if end < 0:
        return Verdict.NOT_FAST if len(buf) > MAX_HEAD else Verdict.NEED_MORE
    if buf[0] in (13, 10):
        return Verdict.NOT_FAST
    return bytes(buf[:end + 4])


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


def _plain_bytes(raw: bytes) -> bool:
    """ASCII, CRLF line ends only, no obs-fold, a request line within MAX_LINE."""
    return raw.isascii() and raw.count(b"\n") == raw.count(b"\r\n") \
        and raw.count(b"\r") == raw.count(b"\r\n") and b"\n " not in raw \
        and b"\n\t" not in raw and raw.find(b"\r\n") <= MAX_LINE


def _feed(raw: bytes) -> _Head | None:
    """llhttp's parse of ``raw``: one message, its head complete, no body bytes, no upgrade."""
    cb = _Head()
    parser = cb.parser = httptools.HttpRequestParser(cb)
    try:
        parser.feed_data(raw)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    if cb.begun != 1 or cb.complete != 1 or cb.body or cb.done > 1 or parser.should_upgrade():
        return None
    return cb


def _content_length(lengths: Sequence[str]) -> int | None | Verdict:
    if not lengths:
        return None
    if not lengths[0].isdigit() or len(lengths[0]) > 18:
        return Verdict.NOT_FAST
    return int(lengths[0])


def parse_head(raw: bytes) -> Request | Verdict:
    """The request in ``raw`` (one complete head, ending in CRLF CRLF) if its framing is
    plain enough for the fast lane; NOT_FAST: hand it to aiohttp, which refuses or serves it."""
    cb = _feed(raw) if _plain_bytes(raw) else None
    if cb is None:
        return Verdict.NOT_FAST
    pairs = cb.headers
    if len(pairs) > MAX_HEADERS or any(len(k) + len(v) + 2 > MAX_FIELD for k, v in pairs):
        return Verdict.NOT_FAST
    headers = CIMultiDict(pairs)
    if any(name in headers for name in ("Transfer-Encoding", "Upgrade", "Expect")):
        return Verdict.NOT_FAST
    hosts = headers.getall("Host", ())
    lengths = headers.getall("Content-Length", ())
    if len(hosts) != 1 or len(lengths) > 1:
        return Verdict.NOT_FAST
    length = _content_length(lengths)
    if isinstance(length, Verdict) or cb.done != (1 if not length else 0):
        return Verdict.NOT_FAST
    if any("text/event-stream" in a for a in headers.getall("Accept", ())):
        return Verdict.NOT_FAST  # SSE holds a stream slot, not a paced one: aiohttp's path
    url = cb.url.decode("latin-1")
    method = cb.parser.get_method().decode("latin-1")
    version = cb.parser.get_http_version()
    if not url.startswith("/") or "#" in url or method == "CONNECT" \
            or version not in ("1.1", "1.0"):
        return Verdict.NOT_FAST
    return Request(raw, method, url, (1, 1) if version == "1.1" else (1, 0), headers,
                   hosts[0], length, cb.keep_alive)


class HeadTemplate:
    """A parsed head but for its request target. A head that is byte for byte the same but
    for an origin-form target of printable ASCII without a fragment (a subset of what llhttp
    takes) is that request with another target: its headers are ones llhttp accepted, and its
    request line is the same method and version around the new target."""

    __slots__ = ("block", "prefix", "req", "tail")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.block = req.raw[req.raw.find(b"\r\n"):]  # from the CRLF ending the request line
        self.prefix = req.method.encode("latin-1") + b" "
        self.tail = b" HTTP/%d.%d" % req.version

    def retarget(self, raw: bytes) -> Request | None:
        """``raw`` as this head with another target, or None (parse it whole)."""
        line_end = raw.find(b"\r\n")
        prefix, tail = self.prefix, self.tail
        if line_end < 0 or line_end > MAX_LINE or raw[line_end:] != self.block \
                or not raw.startswith(prefix) or raw[line_end - len(tail):line_end] != tail:
            return None
        url = raw[len(prefix):line_end - len(tail)]
        if _ORIGIN_FORM.fullmatch(url) is None:
            return None
        req = self.req
        return Request(raw, req.method, url.decode("ascii"), req.version, req.headers,
                       req.host, req.content_length, req.keep_alive)
