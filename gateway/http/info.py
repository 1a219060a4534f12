"""``GET /v1/info``: what a client needs to build URLs (the SDK reads
``preview_url_template``; ``{port}``, ``{id}`` and ``{name}`` are placeholders).
Imports nothing from ``gateway.http.sandbox_routes``, so
 the API's sandbox view can use these helpers."""

from __future__ import annotations

import importlib.metadata

from aiohttp import web

from gateway.http import wire
from gateway.config import ServerConfig
from gateway.http.middleware import TENANT_KEY

SERVER_KEY = web.AppKey("server_config", ServerConfig)
DEFAULT_PORTS = {"http": 80, "https": 443}

routes = web.RouteTableDef()


def _version() -> str:
    try:
        return importlib.metadata.version("agentbox-server")  # the server distribution
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def url_templates(server: ServerConfig) -> tuple[str, str]:
    """(preview, session) URL templates, e.g. ``http://{port}-{id}.localhost:8080``."""
    port = server.public_port or server.port
    suffix = "" if DEFAULT_PORTS[server.public_scheme] == port else f":{port}"
    scheme = server.public_scheme
    return (f"{scheme}://{{port}}-{{id}}.{server.preview_domain}{suffix}",
            f"{scheme}://{{name}}.{server.session_domain}{suffix}")


@routes.get("/v1/info")
async def get_info(request: web.Request) -> web.Response:
    server = request.config_dict[SERVER_KEY]
    preview, session = url_templates(server)
    key = request.get(TENANT_KEY)  # who is asking: the dashboard learns if it is an admin
    info = wire.Info(version=_version(), preview_domain=server.preview_domain,
                     session_domain=server.session_domain, preview_url_template=preview,
                     session_url_template=session,
                     key=wire.KeyRef(id=key.id, name=key.name, admin=key.admin) if key else None)
    return web.Response(body=wire.dumps(info), content_type="application/json")
