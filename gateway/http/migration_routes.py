"""``/v1/internal/migrations``: the host-to-host side of a drain (docs/cluster.md, "Drain").

Another fleet host, moving a running sandbox here, calls these with an admin key (keys are
fleet-wide): ``POST /v1/internal/migrations`` prepares the arrival and answers where its
streams go and the one-time token they must carry (``vmctl.migrate.Offer``);
``.../{id}/commit`` starts the guest here once the streams are in; ``.../{id}/abort``
tears an arrival down (answers ``{"aborted": false}`` when its guest already runs).
Not part of the public API (not in the OpenAPI document); 404 unless ``[cluster]`` is on.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.errors import ApiError, BadRequest, Forbidden, NotFound
from gateway.http.middleware import current_key
from gateway.http.sandbox_routes import json_response, read_json
from gateway.sandbox.migration import ArrivalFailed, Arrivals

ARRIVALS_KEY = web.AppKey("migration_arrivals", Arrivals)
PATHS = ("/v1/internal/migrations", "/v1/internal/migrations/{id}/commit",
         "/v1/internal/migrations/{id}/abort")

routes = web.RouteTableDef()


class ArrivalError(ApiError):
    status = 502
    code = "vm_error"


def _arrivals(request: web.Request) -> Arrivals:
    if not current_key(request).admin:
        raise Forbidden("only an admin key (another fleet host) can move sandboxes")
    arrivals = request.config_dict.get(ARRIVALS_KEY)
    if arrivals is None:
        raise NotFound("this host takes no migrations ([cluster] is off)")
    return arrivals


@routes.post(PATHS[0])
async def prepare(request: web.Request) -> web.Response:
    arrivals = _arrivals(request)
    body: Any = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("disk_bytes"), int):
        raise BadRequest("expected {moved: {...}, disk_bytes: N}")
    offer = await arrivals.prepare(body.get("moved"), body["disk_bytes"])
    return json_response(offer, status=201)


@routes.post(PATHS[1])
async def commit(request: web.Request) -> web.Response:
    arrivals = _arrivals(request)
    try:
        await arrivals.commit(request.match_info["id"])
    except ArrivalFailed as exc:
        raise ArrivalError(str(exc)) from exc
    return json_response({"running": True})


@routes.post(PATHS[2])
async def abort(request: web.Request) -> web.Response:
    arrivals = _arrivals(request)
    return json_response({"aborted": await arrivals.abort(request.match_info["id"])})
