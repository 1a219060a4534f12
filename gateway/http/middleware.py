"""The two places where errors become HTTP, and authentication.

``error_middleware`` (outermost) turns anything unexpected into a 500 with a
request id and logs it. ``api_error_middleware`` (inside it) maps our errors by
class: ``ApiError`` and the VM layer's ``VmError`` (gateway.sandbox.vm_errors) both
carry ``status`` and ``code``. Neither touches a response that has already started streaming.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.http import wire
from gateway.errors import ApiError, Unauthorized
from gateway.sandbox.vm_errors import GuestAgentError, VmError
from gateway.store.registry import ApiKey, Registry
from guest.protocol import ProtocolError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REGISTRY_KEY = web.AppKey("registry", Registry)
TENANT_KEY = web.RequestKey("agentbox.key", ApiKey)
PUBLIC_PATHS = frozenset({"/healthz", "/v1/openapi.json"})
# The dashboard's static files (gateway.http.dashboard): no data in them, and the page then
# calls the API with the key in the Authorization header like any client.
PUBLIC_PREFIX = "/dashboard"


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = wire.dumps(wire.Error(error=wire.ErrorDetail(code=code, message=message)))
    return web.Response(status=status, body=body, content_type="application/json",
                        headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp raises these for requests no route matches (our own 404s are ApiErrors).
        code = {404: "no_route", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status, "http_error")
        return error_response(exc.status, code, exc.reason or exc.text or "error")
    except Exception:
        request_id = secrets.token_hex(6)
        log.exception("unhandled error [request %s] %s %s", request_id, request.method,
                      request.path)
        return error_response(500, "internal", f"internal error (request id {request_id})")


@web.middleware
async def api_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.code, str(exc), exc.headers)
    except ProtocolError as exc:
        return error_response(400, "bad_request", str(exc))
    except GuestAgentError as exc:
        return error_response(exc.status, exc.code, str(exc))
    except VmError as exc:
        log.warning("%s %s: %s", request.method, request.path, exc)
        return error_response(exc.status, exc.code, str(exc))


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in PUBLIC_PATHS or _is_dashboard(request.path):
        return await handler(request)
    header = request.headers.get("Authorization", "") or _websocket_bearer(request)
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("missing API key: send 'Authorization: Bearer KEY'",
                           code="missing_api_key")
    key = request.app[REGISTRY_KEY].lookup_key(secret.strip())
    if key is None:
        raise Unauthorized("invalid API key", code="invalid_api_key")
    request[TENANT_KEY] = key
    return await handler(request)


def _is_dashboard(path: str) -> bool:
    return path == PUBLIC_PREFIX or path.startswith(PUBLIC_PREFIX + "/")


WS_KEY_PREFIX = "agentbox.key."
# Only the terminal takes a key this way: a proxied WebSocket (/v1/sessions/{name}/proxy)
# passes its subprotocols on to the guest app, which must never see a key.
_WS_KEY_PATH = re.compile(r"/v1/sandboxes/[^/]+/terminal")


def _websocket_bearer(request: web.Request) -> str:
    """A browser cannot set headers on a WebSocket: it offers the key as a subprotocol,
    ``new WebSocket(url, ["agentbox.terminal", "agentbox.key." + KEY])`` ("Bearer KEY"
    here; "" if absent). Still a header, never the URL; a cross-site page cannot know
    it. The server answers with the other subprotocol only (gateway.preview.terminal)."""
    if request.headers.get("Upgrade", "").lower() != "websocket" \
            or not _WS_KEY_PATH.fullmatch(request.path):
        return ""
    for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(WS_KEY_PREFIX) and len(proto) > len(WS_KEY_PREFIX):
            return "Bearer " + proto[len(WS_KEY_PREFIX):]
    return ""


def current_key(request: web.Request) -> ApiKey:
    key: ApiKey = request[TENANT_KEY]
    return key
