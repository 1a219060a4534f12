"""``/v1/keys``: mint, list, limit and revoke API keys (admin keys only).

Request bodies are validated strictly at this boundary: a field has exactly its
JSON type (``"admin": "false"`` is a 400 ``invalid_type``, never an admin key).
A revoked key answers 401 from then on; its sandboxes stay until an admin
deletes them (``GET /v1/sandboxes?tenant=KEY_ID``, ``DELETE ...?tenant=KEY_ID``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.tenancy import quotas
from gateway.http import wire
from gateway.http.sandbox_routes import json_response, read_json
from gateway.errors import BadRequest, Forbidden, NotFound
from gateway.http.middleware import REGISTRY_KEY, current_key
from gateway.tenancy.quotas import TenancyConfig
from gateway.store.registry import ApiKey
from gateway.http.wire_base import given

TENANCY_KEY = web.AppKey("tenancy_config", TenancyConfig)

routes = web.RouteTableDef()


def key_view(key: ApiKey, tenancy: quotas.TenancyConfig) -> wire.Key:
    limits = tenancy.limits_for(key.admin, key.limits)
    return wire.Key(id=key.id, name=key.name, admin=key.admin, created_at=key.created_at,
                    revoked=key.revoked, limits=wire.KeyLimits(**limits.as_dict()),
                    overrides=wire.KeyLimits(**key.limits))


def _require_admin(request: web.Request) -> None:
    if not current_key(request).admin:
        raise Forbidden("only an admin key can manage keys")


def _defaults(request: web.Request) -> quotas.TenancyConfig:
    return request.app[TENANCY_KEY]


def validate_new_key(body: Any) -> tuple[str, bool, dict[str, Any]]:
    req = wire.parse(wire.CreateKeyRequest, body)
    return req.name.strip(), req.admin, quotas.apply_overrides({}, _overrides(req.limits))


def _overrides(limits: wire.KeyLimitsUpdate | None) -> dict[str, Any]:
    """The limits a request named (null: back to the default)."""
    if limits is None:
        return {}
    return quotas.parse_overrides({name: getattr(limits, name) for name in given(limits)})


@routes.post("/v1/keys")
async def create_key(request: web.Request) -> web.Response:
    _require_admin(request)
    name, admin, limits = validate_new_key(await read_json(request))
    key, secret = request.app[REGISTRY_KEY].create_key(name, admin=admin, limits=limits)
    view = key_view(key, _defaults(request))
    return json_response(wire.CreatedKey(**vars(view), key=secret), status=201)


@routes.get("/v1/keys")
async def list_keys(request: web.Request) -> web.Response:
    _require_admin(request)
    revoked = request.query.get("revoked", "0") == "1"
    keys = request.app[REGISTRY_KEY].list_keys(include_revoked=revoked)
    return json_response(wire.KeyList(keys=[key_view(k, _defaults(request)) for k in keys]))


@routes.patch("/v1/keys/{key_id}")
async def update_key(request: web.Request) -> web.Response:
    _require_admin(request)
    req = wire.parse(wire.UpdateKeyRequest, await read_json(request))
    registry = request.app[REGISTRY_KEY]
    key = _get(request)
    if req.limits is not None:
        overrides = quotas.apply_overrides(key.limits, _overrides(req.limits))
        registry.set_key_limits(key.id, overrides)
    return json_response(key_view(_get(request), _defaults(request)))


@routes.delete("/v1/keys/{key_id}")
async def revoke_key(request: web.Request) -> web.Response:
    _require_admin(request)
    key = _get(request)
    if key.id == current_key(request).id:
        # Locking oneself out is never what an admin meant; use another admin key.
        raise BadRequest("a key cannot revoke itself")
    request.app[REGISTRY_KEY].revoke_key(key.id)
    return web.Response(status=204)


def _get(request: web.Request) -> ApiKey:
    key = request.app[REGISTRY_KEY].get_key(request.match_info["key_id"])
    if key is None:
        raise NotFound(f"key {request.match_info['key_id']!r} not found", code="key_not_found")
    return key
