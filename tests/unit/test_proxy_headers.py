"""Pure parts of the reverse proxy: hosts, hop-by-hop filtering, forwarded headers, close codes."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from gateway.preview.hosts import HostRouter, PreviewHost, SessionHost
from gateway.preview.proxy_headers import (
    downstream_headers,
    mirror_close_code,
    read_cookie,
    strip_cookie,
    strip_hop_by_hop,
    strip_query_param,
    upstream_headers,
)

SID = "0123456789abcdef"


@pytest.mark.parametrize("host, want", [
    (f"8000-{SID}.localhost", PreviewHost(f"8000-{SID}.localhost", 8000, SID)),
    (f"8000-{SID}.localhost:8080", PreviewHost(f"8000-{SID}.localhost", 8000, SID)),
    (f"8000-{SID.upper()}.LOCALHOST.", PreviewHost(f"8000-{SID}.localhost", 8000, SID)),
    (f"65535-{SID}.localhost", PreviewHost(f"65535-{SID}.localhost", 65535, SID)),
    (f"1-{SID}.localhost", PreviewHost(f"1-{SID}.localhost", 1, SID)),
    ("alice.sessions.localhost:8080", SessionHost("alice.sessions.localhost", "alice")),
    ("a-b-1.sessions.localhost", SessionHost("a-b-1.sessions.localhost", "a-b-1")),
    (f"8000-{SID}.sessions.localhost", SessionHost(f"8000-{SID}.sessions.localhost",
                                                   f"8000-{SID}")),
])
def test_hosts_that_route(host, want):
    assert HostRouter("localhost", "sessions.localhost").classify(host) == want


@pytest.mark.parametrize("host", [
    None, "", "localhost", "localhost:8080", "127.0.0.1:8080", "[::1]:8080",
    f"0-{SID}.localhost", f"65536-{SID}.localhost", f"08000-{SID}.localhost",
    f"8000-{SID}.example.com", f"8000-{SID}.localhost.evil.com", f"x.8000-{SID}.localhost",
    f"8000_{SID}.localhost", f"8000-{SID}.localhost:80x", "sessions.localhost",
    "-alice.sessions.localhost", "alice-.sessions.localhost", "a.b.sessions.localhost",
    "alice.sessionsXlocalhost", "a" * 64 + ".sessions.localhost",
])
def test_hosts_that_do_not_route(host):
    assert HostRouter("localhost", "sessions.localhost").classify(host) is None


def test_domain_is_literal_not_a_pattern():
    router = HostRouter("preview.example.com", "s.example.com")
    assert router.classify(f"80-{SID}.previewXexample.com") is None
    assert router.classify(f"80-{SID}.preview.example.com").port == 80


def test_hop_by_hop_and_connection_tokens_are_removed():
    headers = CIMultiDict([
        ("Connection", "keep-alive, X-Secret"), ("Connection", "Foo"), ("Keep-Alive", "5"),
        ("Proxy-Connection", "x"), ("Proxy-Authorization", "Basic x"), ("TE", "trailers"),
        ("Trailer", "X"), ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"),
        ("X-Secret", "1"), ("Foo", "2"), ("Proxy-Authenticate", "x"),
        ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("Content-Type", "text/plain")])
    out = strip_hop_by_hop(headers)
    assert list(out.items()) == [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),
                                 ("Content-Type", "text/plain")]


def test_upstream_headers_forwarding():
    headers = CIMultiDict([
        ("Host", "8000-x.localhost:8080"), ("X-Forwarded-For", "10.0.0.1"),
        ("Via", "1.0 edge"), ("Expect", "100-continue"), ("Connection", "close"),
        ("Authorization", "Basic app"), ("X-AgentBox-Token", "pv_x"),
        ("Cookie", "a=1; agentbox_preview=secret; b=2"), ("Content-Length", "5")])
    out = upstream_headers(headers, client_ip="127.0.0.1", scheme="http",
                           host="8000-x.localhost:8080", version=(1, 1),
                           drop=("x-agentbox-token",), drop_cookie="agentbox_preview")
    assert out["Host"] == "8000-x.localhost:8080"
    assert out["X-Forwarded-For"] == "10.0.0.1, 127.0.0.1"
    assert out["X-Forwarded-Proto"] == "http"
    assert out["X-Forwarded-Host"] == "8000-x.localhost:8080"
    assert out["Via"] == "1.0 edge, 1.1 agentbox"
    assert out["Authorization"] == "Basic app"  # belongs to the app on preview hosts
    assert out["Cookie"] == "a=1; b=2" and out["Content-Length"] == "5"
    for gone in ("Expect", "Connection", "X-AgentBox-Token"):
        assert gone not in out


def test_upstream_headers_host_rewrite_and_websocket():
    headers = CIMultiDict([("Host", "h"), ("Upgrade", "websocket"), ("Connection", "Upgrade"),
                           ("Sec-WebSocket-Key", "k"), ("Sec-WebSocket-Version", "13"),
                           ("Sec-WebSocket-Protocol", "chat"), ("Origin", "http://h"),
                           ("Cookie", "agentbox_preview=x")])
    out = upstream_headers(headers, client_ip=None, scheme="https", host="h", version=(1, 1),
                           host_override="localhost:3000", websocket=True,
                           drop_cookie="agentbox_preview")
    assert out["Host"] == "localhost:3000" and out["X-Forwarded-Host"] == "h"
    assert "X-Forwarded-For" not in out and "Cookie" not in out
    assert sorted(out) == sorted(["Host", "Origin", "X-Forwarded-Proto", "X-Forwarded-Host",
                                  "Via"])


def test_downstream_headers_keep_framing_out():
    up = CIMultiDict([("Transfer-Encoding", "chunked"), ("Connection", "keep-alive"),
                      ("Content-Encoding", "gzip"), ("Content-Length", "10")])
    out = downstream_headers(up, (1, 1))
    assert dict(out) == {"Content-Encoding": "gzip", "Content-Length": "10",
                         "Via": "1.1 agentbox"}


@pytest.mark.parametrize("code, from_upstream, want", [
    (1000, True, 1000), (1001, False, 1001), (4000, True, 4000), (4999, False, 4999),
    (3000, True, 3000), (1011, True, 1011), (1012, False, 1012), (1014, True, 1014),
    (1005, True, 1000), (1005, False, 1000),
    (1006, True, 1011), (1006, False, 1001), (None, True, 1011), (None, False, 1001),
    (1015, True, 1011), (1015, False, 1001), (1004, True, 1011), (999, False, 1001),
    (5000, True, 1011),
])
def test_close_code_mirroring(code, from_upstream, want):
    assert mirror_close_code(code, from_upstream) == want


def test_query_and_cookie_helpers():
    assert strip_query_param("token=abc", "token") == ""
    assert strip_query_param("a=1&token=abc&b=%20&tokens=2&token", "token") == "a=1&b=%20&tokens=2"
    assert strip_cookie("a=1; agentbox_preview=x;b=2", "agentbox_preview") == "a=1; b=2"
    assert strip_cookie("agentbox_preview=x", "agentbox_preview") == ""
    assert read_cookie(["a=1", "b=2; agentbox_preview=\"v\""], "agentbox_preview") == "v"
    assert read_cookie(["xagentbox_preview=v"], "agentbox_preview") is None
