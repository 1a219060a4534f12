"""REST API handlers (/v1/...). Transport only: parse, call the service, shape JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from gateway.sandbox import expiry, listing
from gateway.http import wire
from gateway.sandbox import resources
from gateway.errors import BadRequest, Forbidden, NotFound, PayloadTooLarge
from gateway.sandbox.egress_policy import egress_view, parse_egress
from gateway.http.middleware import current_key
from gateway.preview.access import ACCESS_KEY, preview_view, validate_public_ports
from gateway.store.registry import SandboxRecord
from gateway.sandbox.service import SandboxService, parse_metadata
from guest.protocol import ExecRequest, validate_path

SERVICE_KEY = web.AppKey("service", SandboxService)
MAX_UPLOAD_KEY = web.AppKey("max_upload", int)
_CHUNK = 256 * 1024

routes = web.RouteTableDef()


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data``: a ``gateway.http.wire`` type (or a protocol dataclass, or plain JSON data)."""
    return web.Response(body=wire.dumps(data), status=status, content_type="application/json")


async def read_json(request: web.Request) -> Any:
    body = await request.read()  # bounded by the app's client_max_size (413 beyond)
    if not body:
        raise BadRequest("request body must be JSON", code="bad_json")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}", code="bad_json") from exc


def sandbox_view(rec: SandboxRecord) -> wire.Sandbox:
    return wire.Sandbox(
        id=rec.id, state=rec.state, template=rec.template,
        metadata=rec.metadata, idle_timeout=rec.idle_timeout,
        created_at=rec.created_at, updated_at=rec.updated_at,
        last_activity=rec.last_activity, suspend_count=rec.suspend_count,
        restore_count=rec.restore_count, last_suspend_ms=rec.last_suspend_ms,
        last_restore_ms=rec.last_restore_ms, failure=rec.failure,
        egress=egress_view(rec.egress),
        vcpus=rec.vcpus or None, memory_mib=rec.memory_mib or None,
        disk_mib=rec.disk_mib or None, **expiry.view(rec))


def _with_egress(request: web.Request, rec: SandboxRecord) -> wire.Sandbox:
    """``sandbox_view`` with the host default spelled out when the sandbox follows it."""
    return dataclasses.replace(sandbox_view(rec), egress=egress_view(
        rec.egress, _service(request).backend.config.network))


def owner_view(request: web.Request, rec: SandboxRecord) -> wire.Sandbox:
    """What the sandbox's owner sees (get, update): its preview access too."""
    preview = preview_view(request, rec.id)
    return dataclasses.replace(_with_egress(request, rec), preview_token=preview.preview_token,
                               public_ports=preview.public_ports,
                               preview_url_template=preview.preview_url_template)


def _service(request: web.Request) -> SandboxService:
    return request.app[SERVICE_KEY]


def _tenant(request: web.Request) -> str:
    """Whose sandboxes a list/get/delete is about: the key's own, or for an admin key
    any key's with ``?tenant=KEY_ID`` (e.g. to clean up after revoking a key)."""
    key = current_key(request)
    tenant = request.query.get("tenant")
    if tenant is None or tenant == key.id:
        return key.id
    if not key.admin:
        raise Forbidden("only an admin key can act on another key's sandboxes (?tenant=)")
    return tenant


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    svc = _service(request)
    return json_response(wire.Health(status="ok", vmm=svc.backend.driver_name,
                                     accel=svc.backend.accel.value,
                                     accel_reason=svc.backend.reason,
                                     templates=sorted(svc.goldens)))


# /v1/templates and /snapshot, /fork: gateway/http/template_routes.py


@routes.post("/v1/sandboxes")
async def create_sandbox(request: web.Request) -> web.Response:
    req = wire.parse(wire.CreateSandboxRequest, await read_json(request))
    svc = _service(request)
    template = req.template if req.template is not None else req.environment
    shape = resources.ShapeRequest(req.vcpus, req.memory_mib, req.disk_mib)
    rec = await svc.create(current_key(request).id, template,
                           parse_metadata(req.metadata) or {}, req.idle_timeout,
                           expiry.Lifetimes(req.ttl, req.auto_delete_after),
                           _egress(svc, req.egress), shape)
    return json_response(_with_egress(request, rec), status=201)


def _egress(svc: SandboxService, value: Any) -> dict[str, Any] | None:
    """A request's egress (a preset or ``wire.EgressRules``) normalised as stored."""
    return None if value is None else parse_egress(wire.encode(value),
                                                   svc.backend.config.network)


@routes.get("/v1/sandboxes")
async def list_sandboxes(request: web.Request) -> web.Response:
    query = listing.parse_query(request.query)
    page, cursor = listing.select(_service(request).list(_tenant(request)), query)
    return json_response(wire.SandboxList(sandboxes=[sandbox_view(r) for r in page],
                                          next_cursor=cursor))


@routes.get("/v1/sandboxes/{id}")
async def get_sandbox(request: web.Request) -> web.Response:
    rec = _service(request).get(_tenant(request), request.match_info["id"])
    return json_response(owner_view(request, rec))


@routes.delete("/v1/sandboxes/{id}")
async def delete_sandbox(request: web.Request) -> web.Response:
    await _service(request).destroy(_tenant(request), request.match_info["id"])
    return web.Response(status=204)


@routes.patch("/v1/sandboxes/{id}")
async def update_sandbox(request: web.Request) -> web.Response:
    req = wire.parse(wire.UpdateSandboxRequest, await read_json(request))
    ports = validate_public_ports(req.public_ports) if req.public_ports is not None else None
    svc = _service(request)
    egress = _egress(svc, req.egress)
    rec = svc.update(current_key(request).id, request.match_info["id"], req.idle_timeout,
                     parse_metadata(req.metadata),
                     expiry.Lifetimes(req.ttl, req.auto_delete_after))
    if egress is not None:
        rec = await svc.set_egress(current_key(request).id, rec.id, egress)
    if ports is not None:
        request.config_dict[ACCESS_KEY].set_public_ports(rec.id, ports)
    return json_response(owner_view(request, rec))


@routes.post("/v1/sandboxes/{id}/suspend")
async def suspend_sandbox(request: web.Request) -> web.Response:
    rec = await _service(request).suspend(current_key(request).id, request.match_info["id"])
    return json_response(sandbox_view(rec))


@routes.post("/v1/sandboxes/{id}/resume")
async def resume_sandbox(request: web.Request) -> web.Response:
    rec = await _service(request).resume(current_key(request).id, request.match_info["id"])
    return json_response(sandbox_view(rec))


@routes.post("/v1/sandboxes/{id}/execute")
async def execute(request: web.Request) -> web.Response:
    body = await read_json(request)
    if isinstance(body, dict) and "code" in body and "language" not in body:
        body = {**body, "language": "python"}
    exec_req = ExecRequest.from_dict(body)
    async with _service(request).use(current_key(request).id, request.match_info["id"]) as m:
        result = await m.require_agent().execute(exec_req)
    return json_response(dataclasses.asdict(result))


@routes.post("/v1/sandboxes/{id}/files")
@routes.put("/v1/sandboxes/{id}/files")
async def upload_file(request: web.Request) -> web.Response:
    path = validate_path(request.query.get("path"))
    limit = request.app[MAX_UPLOAD_KEY]
    size = request.content_length
    if size is not None and size > limit:
        raise PayloadTooLarge(f"upload of {size} bytes exceeds the limit of {limit} bytes")
    body = _LimitedBody(request, limit)
    async with _service(request).use(current_key(request).id, request.match_info["id"]) as m:
        try:
            info = await m.require_agent().write_file(path, body.chunks(), size)
        except Exception as exc:
            # The client library may wrap an exception raised while sending the body.
            if body.exceeded:
                raise PayloadTooLarge(f"upload exceeds the limit of {limit} bytes") from exc
            raise
    return json_response(info.to_dict(), status=201)


@routes.get("/v1/sandboxes/{id}/files/{path:.*}")
async def download_file(request: web.Request) -> web.StreamResponse:
    path = validate_path("/" + request.match_info["path"])
    async with _service(request).use(current_key(request).id, request.match_info["id"]) as m:
        upstream = await m.require_agent().open_file(path)
        try:
            resp = web.StreamResponse(status=200)
            resp.content_type = upstream.content_type
            if upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            async for chunk in upstream.content.iter_chunked(_CHUNK):
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            upstream.release()


@routes.get("/v1/sandboxes/{id}/stat/{path:.*}")
async def stat_file(request: web.Request) -> web.Response:
    path = validate_path("/" + request.match_info["path"])
    async with _service(request).use(current_key(request).id, request.match_info["id"]) as m:
        info = await m.require_agent().stat(path)
    return json_response(info.to_dict())


@routes.delete("/v1/sandboxes/{id}/files/{path:.*}")
async def delete_file(request: web.Request) -> web.Response:
    path = validate_path("/" + request.match_info["path"])
    async with _service(request).use(current_key(request).id, request.match_info["id"]) as m:
        await m.require_agent().remove(path)
    return web.Response(status=204)


class _LimitedBody:
    """Streams a request body upstream, stopping once it passes ``limit`` bytes."""

    def __init__(self, request: web.Request, limit: int) -> None:
        self.request, self.limit, self.exceeded = request, limit, False

    async def chunks(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.request.content.iter_chunked(_CHUNK):
            seen += len(chunk)
            if seen > self.limit:
                self.exceeded = True
                raise PayloadTooLarge(f"upload exceeds the limit of {self.limit} bytes")
            yield chunk


async def not_found(request: web.Request) -> web.Response:
    raise NotFound(f"no route for {request.method} {request.path}")
