"""The fast lane's request-head parser (gateway.preview.fastlane.request_head), sans I/O:
bytes in; a plain request, NEED_MORE or NOT_FAST out. Whatever it refuses goes to aiohttp, so a
refusal is always safe; what it accepts must be exactly what the bytes say."""

from __future__ import annotations

import random

import pytest

from gateway.preview.fastlane.request_head import (
    MAX_FIELD,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_LINE,
    HeadTemplate,
    Request,
    Verdict,
    frame_head,
    parse_head,
)

HEAD = b"GET /a?b=1 HTTP/1.1\r\nHost: p-8080-x.example\r\nAccept: */*\r\n\r\n"


def head(line: bytes = b"GET / HTTP/1.1", *fields: bytes) -> bytes:
    return line + b"\r\n" + b"".join(f + b"\r\n" for f in (b"Host: h",) + fields) + b"\r\n"


def test_a_plain_head_parses() -> None:
    req = parse_head(HEAD)
    assert isinstance(req, Request)
    assert (req.method, req.raw_path, req.version, req.host) == \
        ("GET", "/a?b=1", (1, 1), "p-8080-x.example")
    assert req.headers["Accept"] == "*/*" and req.raw == HEAD
    assert req.content_length is None and req.keep_alive


def test_content_length_and_keep_alive() -> None:
    req = parse_head(head(b"POST /up HTTP/1.1", b"Content-Length: 12"))
    assert isinstance(req, Request) and req.content_length == 12
    req = parse_head(head(b"GET / HTTP/1.0"))
    assert isinstance(req, Request) and req.version == (1, 0) and not req.keep_alive
    req = parse_head(head(b"GET / HTTP/1.0", b"Connection: keep-alive"))
    assert isinstance(req, Request) and req.keep_alive
    req = parse_head(head(b"GET / HTTP/1.1", b"Connection: close"))
    assert isinstance(req, Request) and not req.keep_alive


@pytest.mark.parametrize("raw", [
    head(b"POST / HTTP/1.1", b"Transfer-Encoding: chunked"),
    head(b"GET / HTTP/1.1", b"Upgrade: websocket", b"Connection: Upgrade"),
    head(b"PUT / HTTP/1.1", b"Expect: 100-continue", b"Content-Length: 1"),
    head(b"GET / HTTP/1.1", b"Host: other"),  # two Hosts
    b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n",  # no Host
    head(b"POST / HTTP/1.1", b"Content-Length: 0", b"Content-Length: 40"),  # smuggling
    head(b"POST / HTTP/1.1", b"Content-Length: +5"),
    head(b"POST / HTTP/1.1", b"Content-Length: 1234567890123456789"),  # 19 digits
    head(b"GET / HTTP/1.1", b"Accept: text/event-stream"),  # SSE: aiohttp's path
    head(b"GET http://h/ HTTP/1.1"),  # absolute form
    head(b"OPTIONS * HTTP/1.1"),
    head(b"GET /a#frag HTTP/1.1"),
    head(b"CONNECT h:443 HTTP/1.1"),
    head(b"GET / HTTP/2.0"),
    head(b"GET / HTTP/1.1", "X-Name: caf\u00e9".encode()),  # not ASCII
    b"GET / HTTP/1.1\nHost: h\r\n\r\n",  # a bare LF
    b"GET / HTTP/1.1\r\nHost: h\rX: y\r\n\r\n",  # a bare CR
    head(b"GET / HTTP/1.1", b"X-Folded: a", b" b"),  # obs-fold
    head(b"GET / HTTP/1.1", b"X-Folded: a", b"\tb"),
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS hello
    b"GET / HTTP/1.1\r\nHost h\r\n\r\n",  # a header without a colon
    b"GET / HTTP/1.1\r\nHost: h\r\n",  # incomplete
    b"",
])
def test_not_for_the_fast_lane(raw: bytes) -> None:
    assert parse_head(raw) is Verdict.NOT_FAST


def test_bytes_after_the_head_are_not_its_own() -> None:
    """parse_head takes exactly one head: a body or a second request in it is refused."""
    assert parse_head(head(b"POST / HTTP/1.1", b"Content-Length: 3") + b"abc") \
        is Verdict.NOT_FAST
    assert parse_head(HEAD + HEAD) is Verdict.NOT_FAST


def test_request_line_bounded_by_aiohttps_limit() -> None:
    def line(n: int) -> bytes:
        fixed = len(b"GET / HTTP/1.1")
        return b"GET /" + b"a" * (n - fixed) + b" HTTP/1.1"
    assert isinstance(parse_head(head(line(MAX_LINE))), Request)
    assert parse_head(head(line(MAX_LINE + 1))) is Verdict.NOT_FAST


def test_header_fields_bounded_in_size_and_number() -> None:
    fits = b"X-Big: " + b"v" * (MAX_FIELD - len("X-Big") - 2)
    assert isinstance(parse_head(head(b"GET / HTTP/1.1", fits)), Request)
    assert parse_head(head(b"GET / HTTP/1.1", fits + b"v")) is Verdict.NOT_FAST
    many = [b"X-%d: v" % i for i in range(MAX_HEADERS - 1)]  # and Host
    assert isinstance(parse_head(head(b"GET / HTTP/1.1", *many)), Request)
    assert parse_head(head(b"GET / HTTP/1.1", *many, b"X-One-More: v")) is Verdict.NOT_FAST


def test_frame_head_needs_a_complete_head() -> None:
    assert frame_head(b"") is Verdict.NEED_MORE
    assert frame_head(HEAD[:-1]) is Verdict.NEED_MORE
    assert frame_head(bytearray(HEAD)) == HEAD
    assert frame_head(HEAD + b"GET /next HTTP/1.1\r\n") == HEAD  # pipelined bytes stay


def test_frame_head_is_bounded() -> None:
    """No complete head within MAX_HEAD bytes: handed off (aiohttp refuses it), never
    buffered further."""
    assert frame_head(b"G" * MAX_HEAD) is Verdict.NEED_MORE
    assert frame_head(b"G" * (MAX_HEAD + 1)) is Verdict.NOT_FAST
    tail = b"\r\nHost: h\r\n\r\n"
    last = b"GET / HTTP/1.1" + b"X" * (MAX_HEAD - 14 - len(tail) + 4) + tail
    assert len(last) == MAX_HEAD + 4 and frame_head(last) == last  # ends within the bound
    assert frame_head(b"X" + last) is Verdict.NOT_FAST  # ends one byte beyond it


def test_frame_head_refuses_empty_lines_before_a_request() -> None:
    assert frame_head(b"\r\n" + HEAD) is Verdict.NOT_FAST
    assert frame_head(b"\n" + HEAD) is Verdict.NOT_FAST


def test_template_retargets_a_head_that_differs_only_in_its_target() -> None:
    first = parse_head(HEAD)
    assert isinstance(first, Request)
    template = HeadTemplate(first)
    again = HEAD.replace(b"/a?b=1", b"/other/path?x=%20y")
    req = template.retarget(again)
    assert req is not None and req.raw_path == "/other/path?x=%20y" and req.raw == again
    assert req.headers is first.headers and (req.method, req.version) == ("GET", (1, 1))


@pytest.mark.parametrize("raw", [
    HEAD.replace(b"Accept: */*", b"Accept: text/html"),  # another header
    HEAD.replace(b"GET ", b"HEAD "),  # another method
    HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"),  # another version
    HEAD.replace(b"/a?b=1", b"/a#f"),  # a fragment
    HEAD.replace(b"/a?b=1", b"/a b"),  # a space: not one target
    HEAD.replace(b"/a?b=1", b"*"),
    HEAD.replace(b"/a?b=1", b"http://h/"),
    HEAD.replace(b"/a?b=1", "/caf\u00e9".encode()),
    HEAD.replace(b"/a?b=1", b"/" + b"a" * MAX_LINE),  # over the line limit
    b"no line end",
])
def test_template_refuses_anything_else(raw: bytes) -> None:
    first = parse_head(HEAD)
    assert isinstance(first, Request)
    assert HeadTemplate(first).retarget(raw) is None


def test_template_agrees_with_the_parser_on_mutated_heads() -> None:
    """Whatever retarget answers, parsing the head whole answers the same."""
    first = parse_head(HEAD)
    assert isinstance(first, Request)
    template = HeadTemplate(first)
    rng = random.Random(24)
    alphabet = b"/?#=&%aZ09 -._~!$'()*+,;:@\t\r\n\x00\x7f\x80"
    answered = 0
    for _ in range(3000):
        target = b"/" + bytes(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        raw = HEAD.replace(b"/a?b=1", target)
        if rng.random() < 0.2:  # a byte changed anywhere
            i = rng.randrange(len(raw))
            raw = raw[:i] + bytes([rng.choice(alphabet)]) + raw[i + 1:]
        req, whole = template.retarget(raw), parse_head(raw)
        if req is not None:
            answered += 1
            assert isinstance(whole, Request), raw
            assert (req.method, req.raw_path, req.version, req.keep_alive) == \
                (whole.method, whole.raw_path, whole.version, whole.keep_alive), raw
            assert list(req.headers.items()) == list(whole.headers.items())
    assert answered > 100  # the property was exercised
