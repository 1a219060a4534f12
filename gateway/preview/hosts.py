"""Preview and session hosts: routing, access, wiring into the app.

Theory of operation
-------------------
A request whose Host is ``{port}-{sandbox_id}.{preview_domain}`` or
``{name}.{session_domain}`` belongs to an app inside a sandbox, whatever its
path: subdomains beat path prefixes because apps assume they live at ``/``.
Such hosts never reach the REST API. Two pieces make that so:

* a sub-application matched by host (``HostRule``, checked by aiohttp's router
  before any path) whose single catch-all route defers ``Expect: 100-continue``
  until the sandbox is awake (the default handler would answer at once);
* ``preview_middleware``, placed before the API-key middleware, which sends
  those requests to ``handle_host`` so API keys are neither required nor
  accepted there (access is the preview token, see ``gateway.preview.access``).

Errors on these hosts are pages for browsers and JSON for everything else.
The same ``Proxy`` serves ``/v1/sessions/{name}/proxy/...`` (API-key auth) in
``gateway.preview.sessions``.
"""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRuleMatching, MatchedSubAppResource

from gateway.preview import browser_rules, sessions
from gateway.http import info, wire
from gateway.http.sandbox_routes import SERVICE_KEY, json_response, read_json
from gateway.config import Config
from gateway.errors import (
    ApiError,
    Forbidden,
    NotFound,
    SandboxNotFound,
    Unauthorized,
)
from gateway.sandbox.states import State
from gateway.http.middleware import REGISTRY_KEY, Handler, current_key, error_response
from gateway.preview.access import (
    ACCESS_KEY,
    TOKEN_HEADER,
    TOKEN_PARAM,
    AccessStore,
    Allow,
    Credentials,
    Deny,
    Redirect,
    cookie_name,
    decide,
    preview_view,
    require_previewable,
    validate_public_ports,
)
from gateway.preview.proxy import (
    PROXY_KEY, Proxy, Target, UpstreamPool, deferred_expect, is_websocket,
)
from gateway.preview.proxy_headers import strip_query_param
from gateway.sandbox.vm_errors import VmError
from gateway.store.registry import SandboxRecord

_PORT = r"(6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})"


@dataclass(frozen=True)
class PreviewHost:
    hostname: str
    port: int
    sandbox_id: str


@dataclass(frozen=True)
class SessionHost:
    hostname: str
    name: str


class HostRouter:
    """Classifies a Host header (pure; the port, case and a trailing dot are ignored)."""

    def __init__(self, preview_domain: str, session_domain: str) -> None:
        self._preview = re.compile(rf"{_PORT}-([a-z0-9]+)\.{re.escape(preview_domain)}")
        self._session = re.compile(rf"({sessions.NAME_RE.pattern})\.{re.escape(session_domain)}")

    def classify(self, host: str | None) -> PreviewHost | SessionHost | None:
        hostname = _hostname(host)
        if hostname is None:
            return None
        m = self._preview.fullmatch(hostname)
        if m:
            return PreviewHost(hostname, int(m.group(1)), m.group(2))
        m = self._session.fullmatch(hostname)
        if m:
            return SessionHost(hostname, m.group(1))
        return None


def _hostname(host: str | None) -> str | None:
    if not host or host.startswith("["):  # absent, or an IPv6 literal
        return None
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".").lower() or None


HOSTS_KEY = web.AppKey("preview_hosts", HostRouter)


class HostRule(AbstractRuleMatching):
    """Matches requests for preview and session hosts (aiohttp checks these first)."""

    def __init__(self, router: HostRouter) -> None:
        self.router = router

    async def match(self, request: web.Request) -> bool:
        return self.router.classify(request.host) is not None

    def get_info(self) -> dict[str, object]:
        return {"rule": "preview/session host"}

    @property
    def canonical(self) -> str:
        return "preview-hosts"


@web.middleware
async def preview_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Send preview/session hosts to the proxy (before, and instead of, API-key auth)."""
    if request.config_dict[HOSTS_KEY].classify(request.host) is None:
        return await handler(request)
    return await handle_host(request)


async def handle_host(request: web.Request) -> web.StreamResponse:
    found = request.config_dict[HOSTS_KEY].classify(request.host)
    try:
        if found is None:
            raise NotFound(f"no preview or session host {request.host!r}")
        return await _serve_host(request, found)
    except (ApiError, VmError) as exc:
        return error_page(request, exc.status, exc.code, str(exc),
                          getattr(exc, "headers", None))


async def _serve_host(request: web.Request, found: PreviewHost | SessionHost) -> web.StreamResponse:
    cfg = request.config_dict
    if isinstance(found, SessionHost):
        session = await cfg[sessions.SESSIONS_KEY].find(None, found.name)
        if not session.sandbox_id:
            raise NotFound(f"session {found.name!r} has no sandbox yet", code="session_not_ready")
        sandbox_id, port = session.sandbox_id, session.port
    else:
        sandbox_id, port = found.sandbox_id, found.port
    require_previewable(port)
    rec = cfg[REGISTRY_KEY].get(sandbox_id)
    # Secure (and the __Host- name) when the URLs we hand out are https: behind a TLS proxy
    # the daemon itself only ever sees http.
    secure = request.scheme == "https" or cfg[info.SERVER_KEY].public_scheme == "https"
    routed = route(found.hostname, sandbox_id, port, rec, cfg[ACCESS_KEY], HostRequest(
        method=request.method, raw_path=request.raw_path,
        token_header=request.headers.get(TOKEN_HEADER),
        cookie_headers=tuple(request.headers.getall("Cookie", [])),
        origins=tuple(request.headers.getall("Origin", [])),
        query_token=request.query.get(TOKEN_PARAM), websocket=is_websocket(request),
        secure=secure))
    if isinstance(routed, RedirectTo):
        return web.Response(status=302, headers={
            "Location": routed.location, "Set-Cookie": routed.set_cookie,
            "Cache-Control": "no-store"})
    return await cfg[PROXY_KEY].handle(request, routed)


@dataclass(frozen=True)
class HostRequest:
    """What routing reads from a request for a preview or session host (the aiohttp path
    and ``gateway.preview.fastlane`` both fill it in)."""

    method: str
    raw_path: str  # path and query, still encoded
    token_header: str | None
    cookie_headers: tuple[str, ...]
    origins: tuple[str, ...]
    query_token: str | None  # the decoded ?token= value, if any
    websocket: bool
    secure: bool


@dataclass(frozen=True)
class RedirectTo:
    location: str
    set_cookie: str


def route(hostname: str, sandbox_id: str, port: int, rec: SandboxRecord | None,
          access: AccessStore, req: HostRequest) -> Target | RedirectTo:
    """The one place the rules live: where a request for a preview/session host goes
    (a ``Target``), or the redirect that sets the cookie; raises the ``ApiError`` to answer
    instead. No I/O but the access store's cached rows. Two steps: ``admit`` (everything
    but the path) and ``destination`` (the path, given that decision)."""
    decision = admit(hostname, sandbox_id, port, rec, access, req)
    assert rec is not None
    return destination(decision, rec.tenant, sandbox_id, port, hostname, req.secure,
                       req.raw_path)


def admit(hostname: str, sandbox_id: str, port: int, rec: SandboxRecord | None,
          access: AccessStore, req: HostRequest) -> Allow | Redirect:
    """May the request through (``Allow``), or must it be redirected to set the cookie?
    Reads all of ``req`` but ``raw_path``; raises the ``ApiError`` to answer instead."""
    require_previewable(port)
    if rec is None or rec.state is State.DESTROYED:
        raise SandboxNotFound(sandbox_id)
    cookie = cookie_name(hostname, req.secure)
    creds = Credentials(header=req.token_header,
                        cookies=browser_rules.read_cookies(req.cookie_headers, cookie),
                        query=req.query_token)
    redirectable = req.method in ("GET", "HEAD") and not req.websocket
    decision = decide(access.get(sandbox_id), port, hostname, creds,
                      redirectable=redirectable, secure=req.secure)
    if isinstance(decision, Deny):
        raise Unauthorized(decision.message, code=decision.code)
    if (isinstance(decision, Allow) and decision.ambient
            and browser_rules.needs_same_origin(req.method, req.websocket)
            and not browser_rules.origin_allowed(list(req.origins), hostname)):
        raise Forbidden(f"cross-origin {'WebSocket' if req.websocket else req.method} refused: "
                        f"the preview cookie only authorises pages on {hostname}",
                        code="cross_origin_refused")
    return decision


def destination(decision: Allow | Redirect, tenant: str, sandbox_id: str, port: int,
                hostname: str, secure: bool, raw_path: str) -> Target | RedirectTo:
    """Where an admitted request goes: our token dropped from the URL when it was ours."""
    path, _, query = raw_path.partition("?")
    if not isinstance(decision, Allow) or decision.strip_query_token:
        query = strip_query_param(query, TOKEN_PARAM)
    path_qs = f"{path}?{query}" if query else path
    if not isinstance(decision, Allow):  # Redirect: set the cookie, drop the token from the URL
        return RedirectTo(browser_rules.safe_location(path_qs), decision.set_cookie)
    return Target(tenant, sandbox_id, port, path_qs, drop_headers=_DROP,
                  drop_cookie=cookie_name(hostname, secure), set_cookie=decision.set_cookie)


_DROP = frozenset({TOKEN_HEADER.lower()})


def error_page(request: web.Request, status: int, code: str, message: str,
               headers: dict[str, str] | None = None) -> web.Response:
    """JSON (``{"error": {...}}``) for programs, a small page for browsers."""
    return error_page_for(request.headers.get("Accept", ""), is_websocket(request), status,
                          code, message, headers)


def error_page_for(accept: str, websocket: bool, status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> web.Response:
    if "text/html" not in accept or websocket:
        return error_response(status, code, message, headers)
    body = (f"<!doctype html><html><head><meta charset=utf-8><title>{status} {code}</title>"
            "<style>body{font:16px system-ui,sans-serif;margin:3em auto;max-width:40em}"
            "code{background:#eee;padding:0 .2em}</style></head><body>"
            f"<h1>{status}: {html.escape(code.replace('_', ' '))}</h1>"
            f"<p>{html.escape(message)}</p><p><code>{html.escape(code)}</code> &middot; "
            "AgentBox</p></body></html>")
    return web.Response(status=status, text=body, content_type="text/html",
                        headers=headers)


# -- API: a sandbox's preview access ------------------------------------------------------

routes = web.RouteTableDef()


def _owned(request: web.Request) -> str:
    rec = request.app[SERVICE_KEY].get(current_key(request).id, request.match_info["id"])
    return rec.id


@routes.get("/v1/sandboxes/{id}/preview")
async def get_preview(request: web.Request) -> web.Response:
    return json_response(preview_view(request, _owned(request)))


@routes.patch("/v1/sandboxes/{id}/preview")
async def update_preview(request: web.Request) -> web.Response:
    req = wire.parse(wire.UpdatePreviewRequest, await read_json(request))
    sandbox_id = _owned(request)
    ports = validate_public_ports(req.public_ports)
    request.config_dict[ACCESS_KEY].set_public_ports(sandbox_id, ports)
    return json_response(preview_view(request, sandbox_id))


@routes.post("/v1/sandboxes/{id}/preview-token")
async def rotate_token(request: web.Request) -> web.Response:
    sandbox_id = _owned(request)
    request.config_dict[ACCESS_KEY].rotate(sandbox_id)
    return json_response(preview_view(request, sandbox_id))


# -- wiring -------------------------------------------------------------------------------

def setup(app: web.Application, config: Config) -> None:
    """Register hosts, routes and the proxy's lifecycle (call after the service's cleanup_ctx:
    ours needs the sandbox service and closes first)."""
    hosts = HostRouter(config.server.preview_domain, config.server.session_domain)
    app[HOSTS_KEY] = hosts
    app[info.SERVER_KEY] = config.server
    hosts_app = web.Application()
    hosts_app.router.add_route("*", "/{tail:.*}", handle_host, expect_handler=deferred_expect)
    # aiohttp's add_domain() only knows fixed names and '*' masks; the resource is the same.
    app._add_subapp(lambda: MatchedSubAppResource(HostRule(hosts), hosts_app), hosts_app)
    app.add_routes(routes)
    app.add_routes(sessions.routes)
    app.add_routes(info.routes)
    app.cleanup_ctx.append(_proxy_lifecycle)


async def _proxy_lifecycle(app: web.Application) -> AsyncIterator[None]:
    server = app[info.SERVER_KEY]
    service, registry = app[SERVICE_KEY], app[REGISTRY_KEY]
    pool = UpstreamPool(server.proxy_connect_timeout, server.proxy_read_timeout)
    app[PROXY_KEY] = Proxy(service, pool, rewrite_host=server.preview_rewrite_host,
                           max_ws_message_bytes=server.max_ws_message_bytes)
    app[ACCESS_KEY] = AccessStore(registry)
    app[sessions.SESSIONS_KEY] = session_service = sessions.SessionService(service, registry)
    session_service.fleet = app.get(sessions.FLEET_NAMES_KEY)  # type: ignore[assignment]
    if session_service.fleet is not None:  # sessions follow their sandboxes
        service.spawn(session_service.follow(), "sessions-follow")
    try:
        yield
    finally:
        await session_service.aclose()
        await pool.aclose()
