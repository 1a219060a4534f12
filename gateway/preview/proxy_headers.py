"""Pure helpers of the reverse proxy: which headers cross, which are added,
how WebSocket close codes are mirrored. No I/O; tested in tests/unit/test_proxy_headers.py.

Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, not the message, so
they never cross the proxy in either direction: ``Connection`` and every header it
names, plus the fixed list below. ``Expect`` is answered by the gateway itself
(after the sandbox is awake), so it does not go upstream either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
})
# Set by aiohttp's ws_connect itself (key, version) or negotiated per hop (extensions).
WS_HANDSHAKE = frozenset({"sec-websocket-key", "sec-websocket-version",
                          "sec-websocket-extensions", "sec-websocket-protocol",
                          "sec-websocket-accept"})
VIA = "agentbox"

# WebSocket close codes a peer may put on the wire (RFC 6455 7.4, IANA registry).
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


def connection_tokens(headers: Mapping[str, str] | CIMultiDict[str]) -> set[str]:
    """Header names listed in (every) Connection header, lower-cased."""
    values = headers.getall("Connection", []) if hasattr(headers, "getall") else \
        [headers.get("Connection", "")]
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


def strip_hop_by_hop(headers: CIMultiDict[str] | Mapping[str, str],
                     drop: Iterable[str] = ()) -> CIMultiDict[str]:
    """A copy without hop-by-hop headers (and without ``drop``), duplicates kept in order."""
    skip = HOP_BY_HOP | connection_tokens(headers) | {d.lower() for d in drop}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in skip:
            out.add(name, value)
    return out


def upstream_headers(headers: CIMultiDict[str] | Mapping[str, str], *, client_ip: str | None,
                     scheme: str, host: str, version: tuple[int, int],
                     drop: Iterable[str] = (), drop_cookie: str | None = None,
                     host_override: str | None = None,
                     websocket: bool = False) -> CIMultiDict[str]:
    """Request headers for the guest app: hop-by-hop removed, X-Forwarded-* and Via added.

    ``host`` is the Host the client asked for; it is preserved unless ``host_override``
    (the rewrite for dev servers that only answer to localhost)."""
    skip = {"expect", "host", *drop, *(WS_HANDSHAKE if websocket else ())}
    out = strip_hop_by_hop(headers, drop=skip)
    out["Host"] = host_override or host
    if drop_cookie and "Cookie" in out:
        cookies = strip_cookie("; ".join(out.popall("Cookie")), drop_cookie)
        if cookies:
            out["Cookie"] = cookies
    prior = ", ".join(out.getall("X-Forwarded-For", []))
    if client_ip:
        out["X-Forwarded-For"] = f"{prior}, {client_ip}" if prior else client_ip
    out["X-Forwarded-Proto"] = scheme
    out["X-Forwarded-Host"] = host
    _add_via(out, version)
    return out


def downstream_headers(headers: CIMultiDict[str] | Mapping[str, str],
                       version: tuple[int, int]) -> CIMultiDict[str]:
    """Response headers for the client: hop-by-hop removed (the framing is ours), Via added."""
    out = strip_hop_by_hop(headers)
    _add_via(out, version)
    return out


def _add_via(headers: CIMultiDict[str], version: tuple[int, int]) -> None:
    hop = f"{version[0]}.{version[1]} {VIA}"
    prior = ", ".join(headers.getall("Via", []))
    headers["Via"] = f"{prior}, {hop}" if prior else hop


def mirror_close_code(code: int | None, from_upstream: bool) -> int:
    """The close code to send on one side after the other side closed with ``code``.

    1005 (no code given) becomes a plain 1000. 1006 (connection dropped, also
    ``None``) and 1015 can never be sent: a dead guest app becomes 1011 (server
    error) for the client; a vanished client becomes 1001 (going away) for the app.
    """
    if code is not None and (code in _SENDABLE or 3000 <= code <= 4999):
        return code
    if code == 1005:
        return 1000
    return 1011 if from_upstream else 1001


def strip_query_param(query_string: str, name: str) -> str:
    """``query_string`` (raw, still percent-encoded) without any ``name=...`` pair."""
    kept = [p for p in query_string.split("&") if p and p.split("=", 1)[0] != name]
    return "&".join(kept)


def strip_cookie(cookie_header: str, name: str) -> str:
    """A Cookie header value without the cookie ``name`` ('' if nothing is left)."""
    kept = [c.strip() for c in cookie_header.split(";")
            if c.strip() and c.split("=", 1)[0].strip() != name]
    return "; ".join(kept)


def read_cookie(cookie_headers: Iterable[str], name: str) -> str | None:
    for header in cookie_headers:
        for part in header.split(";"):
            key, sep, value = part.strip().partition("=")
            if sep and key.strip() == name:
                return value.strip().strip('"')
    return None
