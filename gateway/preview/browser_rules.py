"""What preview hosts refuse from browsers: cross-origin use of the ambient cookie, and
redirects that could leave the host. Pure functions; ``gateway.preview.hosts`` and
``gateway.preview.terminal`` apply them.

Theory of operation
-------------------
With the documented layout (``*.preview.example.com``) every tenant's preview is
*same-site* with every other one, so a ``SameSite=Lax`` cookie does not stop a
page on tenant B's preview (a guest app B controls) from sending tenant A's
preview cookie along: browsers attach it to same-site WebSocket handshakes and
to same-site POSTs. WebSockets have no CORS either. So a request that only the
cookie authorises must come from a page on its own host when it can do harm:

* every WebSocket upgrade, and every unsafe method (anything but GET, HEAD,
  OPTIONS, TRACE), whose ``Origin`` is not the request's own host is refused;
* ``Origin: null`` (sandboxed iframes, ``data:`` URLs, ``Referrer-Policy:
  no-referrer`` form posts) is an origin we cannot attribute: refused;
* no ``Origin`` at all is allowed. Browsers send it on every WebSocket handshake
  and on every cross-origin unsafe request, so its absence means a program
  (curl with a copied cookie), which could as well have sent the cookie's token.

Only the host is compared, not the scheme or port: cookies ignore the port too,
and both schemes of one preview host reach the same daemon. Requests
authorised by the token header, by ``?token=`` or by an API key are not
ambient (a hostile page cannot know the secret), so none of this applies to
them -- except that the terminal WebSocket refuses any Origin that is a
preview or session host, so guest-controlled pages can never drive it.

A redirect's ``Location`` is a path on the same host. A request target such as
``//evil.com/x`` or ``/\\evil.com`` would read as scheme-relative (browsers treat
``\\`` as ``/`` and drop tabs and newlines), so control characters, spaces and
backslashes are percent-encoded and leading slashes collapse into one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_UNSAFE_IN_LOCATION = re.compile(r"[\x00-\x20\x7f\\]")


def needs_same_origin(method: str, websocket: bool) -> bool:
    """Whether a cookie-authorised request of this kind must come from its own host."""
    return websocket or method.upper() not in SAFE_METHODS


def origin_hostname(origin: str) -> str | None:
    """The host of an ``Origin`` header (lowercase, no port); None if opaque or malformed."""
    origin = origin.strip()
    if origin.lower() == "null":
        return None
    try:
        parts = urlsplit(origin)
        host = parts.hostname
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not host:
        return None
    return host.rstrip(".").lower() or None


def origin_allowed(origins: list[str], hostname: str) -> bool:
    """May a cookie-authorised request with these ``Origin`` headers reach ``hostname``?
    None sent: yes (a program, see above). More than one: no (no browser does that)."""
    if not origins:
        return True
    return len(origins) == 1 and origin_hostname(origins[0]) == hostname.lower()


def safe_location(path_qs: str) -> str:
    """``path_qs`` as a Location that can only mean a path on the same host."""
    encoded = _UNSAFE_IN_LOCATION.sub(lambda m: f"%{ord(m.group()):02X}", path_qs)
    return "/" + encoded.lstrip("/")


def read_cookies(cookie_headers: Iterable[str], name: str) -> tuple[str, ...]:
    """Every value sent for the cookie ``name``. A sibling host can plant a cookie of the
    same name for the parent domain (``Domain=``, or ``document.cookie``): the caller
    accepts the request if any value is valid, so a planted one cannot shadow ours."""
    found = []
    for header in cookie_headers:
        for part in header.split(";"):
            key, sep, value = part.strip().partition("=")
            if sep and key.strip() == name:
                found.append(value.strip().strip('"'))
    return tuple(found[:16])  # bounded: each costs an HMAC comparison


def from_guest_page(origins: list[str], is_guest_host: Callable[[str], bool]) -> bool:
    """Whether any ``Origin`` is a page a guest app serves (a preview or session host)."""
    return any(is_guest_host(host) for host in map(origin_hostname, origins) if host)
