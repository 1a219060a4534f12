"""Who may open a preview or session URL: per-sandbox tokens, host cookies, public ports.

Theory of operation
-------------------
Preview URLs are private by default. Each sandbox has one random access token
(stored in the registry so its owner can read it back; rotating it revokes every
link and cookie made from the old one). A request to a private port is let
through when it carries, in this order of preference:

1. ``X-AgentBox-Token: TOKEN`` (programs),
2. the host's cookie (browsers, iframes, WebSockets), named per host
   (``agentbox_preview_<hash of the host>``, ``__Host-`` in front over https),
3. ``?token=TOKEN`` once: a GET/HEAD is redirected to the same URL without the
   token while the cookie is set; other methods and WebSocket handshakes (which
   cannot follow a redirect) go through with the token removed from the URL.

The cookie is host-only (``8000-<id>.localhost``), ``HttpOnly``, ``SameSite=Lax``,
``Path=/``, and its value is an HMAC of the host under the token, so a cookie
leaked from one port's host opens nothing else, and a rotation voids it. The
name is per host so that no two hosts ever read a cookie of the same name; a
cookie planted for the parent domain by a hostile sibling (``Domain=``) cannot
shadow ours either, because every value sent under the name is tried (and over
https the ``__Host-`` prefix makes browsers refuse such cookies outright). A
cookie alone is *ambient* (``Allow.ambient``): the caller checks its Origin
(``gateway.preview.browser_rules``). API
keys are never accepted here; an ``Authorization`` header belongs to the app.
A ``?token=`` that is not ours (Jupyter uses the same name) is left for the app.
Ports the owner marks public need nothing. Our header and cookie never reach
the guest app.

``decide`` is pure; ``AccessStore`` caches the registry rows (one daemon owns them).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.http import wire
from gateway.errors import BadRequest, Forbidden
from gateway.http.info import SERVER_KEY, url_templates
from gateway.store.registry import Registry
from guest.protocol import AGENT_PORT

TOKEN_HEADER = "X-AgentBox-Token"
TOKEN_PARAM = "token"
COOKIE = "agentbox_preview"  # the prefix of every host's cookie name (see cookie_name)
MAX_PUBLIC_PORTS = 64


@dataclass(frozen=True)
class Access:
    token: str
    public_ports: frozenset[int]


@dataclass(frozen=True)
class Credentials:
    """What a request offers (read by the transport; compared here)."""

    header: str | None = None
    cookies: tuple[str, ...] = ()  # every value sent under the host's cookie name
    query: str | None = None


@dataclass(frozen=True)
class Allow:
    strip_query_token: bool = False  # the URL's ?token= was ours: the app must not see it
    set_cookie: str | None = None  # a Set-Cookie value to add to the response
    ambient: bool = False  # only the cookie vouched for it: the browser may have sent it


@dataclass(frozen=True)
class Redirect:
    set_cookie: str


@dataclass(frozen=True)
class Deny:
    code: str
    message: str


Decision = Allow | Redirect | Deny


def new_token() -> str:
    return "pv_" + secrets.token_urlsafe(24)


def cookie_value(token: str, hostname: str) -> str:
    return hmac.new(token.encode(), hostname.lower().encode(), hashlib.sha256).hexdigest()


@functools.lru_cache(maxsize=4096)  # pure; asked on every preview request
def cookie_name(hostname: str, secure: bool) -> str:
    """The cookie ``hostname`` reads. ``__Host-`` (secure only: browsers require it) forbids
    ``Domain=``, so no sibling host can set it at all."""
    digest = hashlib.sha256(hostname.lower().encode()).hexdigest()[:16]
    return f"{'__Host-' if secure else ''}{COOKIE}_{digest}"


def set_cookie_header(token: str, hostname: str, secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return (f"{cookie_name(hostname, secure)}={cookie_value(token, hostname)}; Path=/; "
            f"HttpOnly; SameSite=Lax{flags}")


def require_previewable(port: int) -> None:
    """The guest agent has no authentication of its own: it is only ever reached by the
    daemon, never through a preview, session or proxy URL."""
    if port == AGENT_PORT or not 0 < port < 65536:
        raise Forbidden(f"port {port} is reserved and cannot be previewed", code="port_reserved")


def _same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def decide(access: Access, port: int, hostname: str, creds: Credentials, *,
           redirectable: bool, secure: bool) -> Decision:
    """May this request through? ``redirectable``: a GET/HEAD that is not a WebSocket."""
    query_ok = _same(creds.query, access.token)
    if port in access.public_ports:
        return Allow(strip_query_token=query_ok)
    if _same(creds.header, access.token):
        return Allow(strip_query_token=query_ok)
    expected = cookie_value(access.token, hostname)
    if any([_same(c, expected) for c in creds.cookies]):  # a list: compare all, in constant time
        return Allow(strip_query_token=query_ok, ambient=not query_ok)
    if query_ok:
        cookie = set_cookie_header(access.token, hostname, secure)
        return Redirect(cookie) if redirectable else Allow(True, cookie)
    if creds.header or creds.query or creds.cookies:
        return Deny("invalid_preview_token", "the preview token is not valid for this sandbox "
                    "(it may have been rotated)")
    return Deny("preview_token_required",
                f"this preview is private: send the sandbox's preview token as the "
                f"{TOKEN_HEADER} header or open the URL once with ?{TOKEN_PARAM}=TOKEN")


def validate_public_ports(value: Any) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_PUBLIC_PORTS or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in value):
        raise BadRequest(f"'public_ports' must be a list of up to {MAX_PUBLIC_PORTS} port "
                         "numbers (1-65535)")
    if AGENT_PORT in value:
        raise BadRequest(f"port {AGENT_PORT} is the guest agent's and cannot be public",
                         code="port_reserved")
    return sorted(set(value))


class AccessStore:
    """Tokens and public ports per sandbox, minted on first use."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._cache: dict[str, Access] = {}

    def get(self, sandbox_id: str) -> Access:
        access = self._cache.get(sandbox_id)
        if access is None:
            row = self.registry.preview_access(sandbox_id)
            if row is None:
                return self._save(sandbox_id, new_token(), [])
            access = self._cache[sandbox_id] = Access(row[0], frozenset(row[1]))
        return access

    def rotate(self, sandbox_id: str) -> Access:
        return self._save(sandbox_id, new_token(), sorted(self.get(sandbox_id).public_ports))

    def set_public_ports(self, sandbox_id: str, ports: list[int]) -> Access:
        return self._save(sandbox_id, self.get(sandbox_id).token, ports)

    def _save(self, sandbox_id: str, token: str, ports: list[int]) -> Access:
        self.registry.set_preview_access(sandbox_id, token, ports)
        access = self._cache[sandbox_id] = Access(token, frozenset(ports))
        return access


ACCESS_KEY = web.AppKey("preview_access", AccessStore)


def preview_view(request: web.Request, sandbox_id: str) -> wire.Preview:
    """A sandbox's preview fields, for its owner only (callers check ownership): the
    token, public ports and its URL template (``{port}`` left to fill in)."""
    access = request.config_dict[ACCESS_KEY].get(sandbox_id)
    template = url_templates(request.config_dict[SERVER_KEY])[0]
    return wire.Preview(preview_token=access.token, public_ports=sorted(access.public_ports),
                        preview_url_template=template.replace("{id}", sandbox_id))
