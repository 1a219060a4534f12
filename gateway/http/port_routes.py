"""``GET /v1/sandboxes/{id}/ports``: the TCP ports something listens on in the guest.

What a preview URL can reach (``{port}-{id}.<preview_domain>``; a port bound to loopback
only is exposed on first use, gateway.preview.proxy). The dashboard lists preview links
from it. Like any guest call it wakes a sleeping sandbox.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http import wire
from gateway.http.middleware import current_key
from gateway.http.sandbox_routes import SERVICE_KEY, json_response
from gateway.sandbox import guest

routes = web.RouteTableDef()


@routes.get("/v1/sandboxes/{id}/ports")
async def ports(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    async with service.use(current_key(request).id, request.match_info["id"]) as machine:
        found = await guest.list_ports(machine)
    return json_response(wire.PortList(ports=sorted(found, key=lambda p: p.port)))
