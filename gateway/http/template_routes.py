"""Template handlers: list and delete templates, snapshot a sandbox into one, fork.

Transport only: the catalog (gateway/templates/catalog.py) and gateway/sandbox/forks.py decide."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from gateway.sandbox import resources, forks
from gateway.http import wire
from gateway.http.sandbox_routes import _service, json_response, read_json, sandbox_view
from gateway.errors import TemplateNotFound
from gateway.http.middleware import current_key
from gateway.sandbox.service import SandboxService
from gateway.templates.catalog import Template

routes = web.RouteTableDef()


def _view(svc: SandboxService, t: Template) -> wire.Template:
    """A template's view; a built-in one also shows its default shape and limits."""
    view = t.view(svc.config.sandbox.default_template)
    golden = None if t.tenant else svc.goldens.get(t.name)
    if golden is not None:
        view = dataclasses.replace(view, **resources.template_view(
            golden, svc.config.resources.for_template(t.name)))
    return view


@routes.get("/v1/templates")
async def list_templates(request: web.Request) -> web.Response:
    svc = _service(request)
    pending = svc.builtin_builds.views() if svc.builtin_builds is not None else []
    return json_response(wire.TemplateList(templates=[
        _view(svc, t) for t in svc.templates.list(current_key(request).id)] + pending))


@routes.get("/v1/templates/{name}")
async def get_template(request: web.Request) -> web.Response:
    svc, name = _service(request), request.match_info["name"]
    for t in svc.templates.list(current_key(request).id):
        if t.name == name:
            return json_response(_view(svc, t))
    raise TemplateNotFound(f"template {name!r} not found")


@routes.delete("/v1/templates/{name}")
async def delete_template(request: web.Request) -> web.Response:
    _service(request).templates.delete(current_key(request).id, request.match_info["name"])
    return web.Response(status=204)


@routes.post("/v1/sandboxes/{id}/snapshot")
async def snapshot_sandbox(request: web.Request) -> web.Response:
    req = wire.parse(wire.SnapshotRequest, await read_json(request))
    view = await forks.snapshot(_service(request), current_key(request).id,
                                    request.match_info["id"], req.template)
    return json_response(view, status=201)


@routes.post("/v1/sandboxes/{id}/fork")
async def fork_sandbox(request: web.Request) -> web.Response:
    req = wire.parse(wire.ForkRequest, await read_json(request))
    recs = await forks.fork(_service(request), current_key(request).id,
                                request.match_info["id"], req.count)
    return json_response(wire.SandboxList(sandboxes=[sandbox_view(r) for r in recs]),
                         status=201)
