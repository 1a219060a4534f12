"""Template handlers: list and delete templates, snapshot a sandbox into one, fork.

Transport only: the catalog (gateway/templates.py) and gateway/snapshots.py decide."""

from __future__ import annotations

from aiohttp import web

from gateway import snapshots
from gateway.api import _service, json_response, read_json, sandbox_view
from gateway.errors import TemplateNotFound
from gateway.middleware import current_key
from gateway.sandboxes import parse_object

routes = web.RouteTableDef()


@routes.get("/v1/templates")
async def list_templates(request: web.Request) -> web.Response:
    svc = _service(request)
    default = svc.config.sandbox.default_template
    return json_response({"templates": [
        t.view(default) for t in svc.templates.list(current_key(request).id)]})


@routes.get("/v1/templates/{name}")
async def get_template(request: web.Request) -> web.Response:
    svc, name = _service(request), request.match_info["name"]
    for t in svc.templates.list(current_key(request).id):
        if t.name == name:
            return json_response(t.view(svc.config.sandbox.default_template))
    raise TemplateNotFound(f"template {name!r} not found")


@routes.delete("/v1/templates/{name}")
async def delete_template(request: web.Request) -> web.Response:
    _service(request).templates.delete(current_key(request).id, request.match_info["name"])
    return web.Response(status=204)


@routes.post("/v1/sandboxes/{id}/snapshot")
async def snapshot_sandbox(request: web.Request) -> web.Response:
    body = parse_object(await read_json(request), {"template"})
    view = await snapshots.snapshot(_service(request), current_key(request).id,
                                    request.match_info["id"], body.get("template"))
    return json_response(view, status=201)


@routes.post("/v1/sandboxes/{id}/fork")
async def fork_sandbox(request: web.Request) -> web.Response:
    body = parse_object(await read_json(request), {"count"})
    recs = await snapshots.fork(_service(request), current_key(request).id,
                                request.match_info["id"], body.get("count", 1))
    return json_response({"sandboxes": [sandbox_view(r) for r in recs]}, status=201)
