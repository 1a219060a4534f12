"""The contract, both ways, without VMs.

1. The server's answers validate against the OpenAPI document (strictly: an undocumented
   field fails, tests/contract.py), for every operation the real handlers answer here with
   fake controllers; the guest-backed operations are checked against a real daemon in
   tests/e2e/test_contract.py.
2. The SDK's models parse a maximal instance of every schema they model, with unknown fields
   at every level, and read every field the schema has (a field added to the spec without the
   SDK fails here)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agentbox import models
from gateway.http import (
    sandbox_routes,
    control_routes,
    key_routes,
    template_routes,
    info,
    openapi,
    wire,
    wire_base,
)
from gateway.config import Config, ServerConfig
from gateway.http.middleware import (REGISTRY_KEY, api_error_middleware, auth_middleware,
                                error_middleware)
from gateway.preview.access import ACCESS_KEY, AccessStore
from gateway.tenancy.quotas import TenancyConfig
from gateway.http.ratelimit import LIMITER_KEY, RateLimiter, key_rate_middleware
from gateway.store.registry import Registry
from tests.contract import check_answer
from tests.unit.test_tenancy_api import FakeService, fake_host


@pytest.fixture
async def app_client(tmp_path: Path, aiohttp_client):
    config = Config(server=ServerConfig(data_dir=tmp_path), tenancy=TenancyConfig(
        max_sandboxes=3, max_awake=2, max_disk_mib=0, rate=0, address_rate=0))
    registry = Registry(tmp_path / "r.sqlite")
    golden, backend = fake_host(tmp_path)
    service = FakeService(config, registry, backend, {"python": golden})  # type: ignore
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       auth_middleware, key_rate_middleware])
    app[REGISTRY_KEY] = registry
    app[sandbox_routes.SERVICE_KEY] = service
    app[key_routes.TENANCY_KEY] = config.tenancy
    app[LIMITER_KEY] = RateLimiter(config.tenancy)
    app[ACCESS_KEY] = AccessStore(registry)
    app[info.SERVER_KEY] = config.server
    for routes in (sandbox_routes.routes, template_routes.routes, key_routes.routes, info.routes,
                   openapi.routes, control_routes.routes):
        app.add_routes(routes)
    _, admin = registry.create_key("admin", admin=True)
    client = await aiohttp_client(app)
    client.session.headers["Authorization"] = f"Bearer {admin}"
    yield client
    registry.close()


async def call(client, method: str, spec_path: str, status: int, url: str | None = None,
               **kwargs: Any) -> Any:
    """``method url`` (default: the spec path) must answer ``status`` with what the spec says."""
    resp = await client.request(method, url or spec_path, **kwargs)
    body = await resp.json() if resp.content_type == "application/json" else await resp.read()
    assert resp.status == status, (method, url or spec_path, resp.status, body)
    check_answer(method, spec_path, status, body, resp.content_type)
    return body


async def test_gateway_operations_answer_what_the_spec_says(app_client):
    c = app_client
    await call(c, "GET", "/healthz", 200)
    await call(c, "GET", "/v1/info", 200)
    await call(c, "GET", "/v1/templates", 200)
    sb = await call(c, "POST", "/v1/sandboxes", 201, json={"metadata": {"a": "b"}})
    path = f"/v1/sandboxes/{sb['id']}"
    await call(c, "GET", "/v1/sandboxes", 200)
    await call(c, "GET", "/v1/sandboxes/{id}", 200, path)
    await call(c, "PATCH", "/v1/sandboxes/{id}", 200, path,
               json={"idle_timeout": 60, "public_ports": [8000], "ttl": 600,
                     "auto_delete_after": 60})
    await call(c, "POST", "/v1/sandboxes", 201, json={"ttl": 60, "metadata": {"a": "c"}})
    page = await call(c, "GET", "/v1/sandboxes", 200, "/v1/sandboxes?limit=1&metadata.a=b"
                      "&state=running,suspended&template=python")
    assert [s["id"] for s in page["sandboxes"]] == [sb["id"]] and page["next_cursor"] is None
    await call(c, "GET", "/v1/usage", 200, "/v1/usage?from=0&key=*")
    await call(c, "GET", "/v1/usage", 200)
    await call(c, "GET", "/v1/sandboxes/{id}/metrics", 200, path + "/metrics")
    await call(c, "GET", "/v1/sandboxes/{id}/logs", 200, path + "/logs?tail=5")
    key = await call(c, "POST", "/v1/keys", 201, json={"name": "t"})
    await call(c, "GET", "/v1/keys", 200)
    await call(c, "PATCH", "/v1/keys/{key_id}", 200, f"/v1/keys/{key['id']}",
               json={"limits": {"max_sandboxes": 2}})
    await call(c, "DELETE", "/v1/keys/{key_id}", 204, f"/v1/keys/{key['id']}")
    await call(c, "DELETE", "/v1/sandboxes/{id}", 204, path)


async def test_error_answers_carry_registered_codes(app_client):
    c = app_client
    await call(c, "GET", "/v1/sandboxes/{id}", 404, "/v1/sandboxes/nope")
    await call(c, "POST", "/v1/sandboxes", 400, data=b"{not json")
    await call(c, "POST", "/v1/sandboxes", 404, json={"template": "nope"})
    await call(c, "PATCH", "/v1/sandboxes/{id}", 404, "/v1/sandboxes/nope", json={})
    await call(c, "POST", "/v1/keys", 400, json={"name": 5})
    await call(c, "GET", "/v1/sandboxes", 401, headers={"Authorization": "Bearer wrong"})
    await call(c, "GET", "/v1/templates/{name}", 200, "/v1/templates/python")
    await call(c, "GET", "/v1/templates/{name}", 404, "/v1/templates/nope")
    await call(c, "DELETE", "/v1/templates/{name}", 409, "/v1/templates/python")
    await call(c, "DELETE", "/v1/templates/{name}", 404, "/v1/templates/nope")
    await call(c, "POST", "/v1/sandboxes/{id}/snapshot", 400, "/v1/sandboxes/x/snapshot",
               json={"template": "Bad!"})
    await call(c, "POST", "/v1/sandboxes/{id}/snapshot", 409, "/v1/sandboxes/x/snapshot",
               json={"template": "python"})
    await call(c, "POST", "/v1/sandboxes/{id}/fork", 400, "/v1/sandboxes/x/fork",
               json={"count": 99})
    await call(c, "GET", "/v1/sandboxes", 400, "/v1/sandboxes?cursor=nope")
    await call(c, "GET", "/v1/sandboxes", 400, "/v1/sandboxes?limit=100000")
    await call(c, "GET", "/v1/sandboxes", 400, "/v1/sandboxes?colour=red")
    await call(c, "GET", "/v1/usage", 400, "/v1/usage?from=yesterday")
    await call(c, "POST", "/v1/sandboxes", 400, json={"ttl": -1})
    await call(c, "GET", "/v1/sandboxes/{id}/logs", 404, "/v1/sandboxes/nope/logs")
    await call(c, "GET", "/v1/sandboxes/{id}/metrics", 404, "/v1/sandboxes/nope/metrics")


@wire_base.response
class _Colourful(wire.Sandbox):
    """A sandbox view with one more field, as a type the document does not list."""

    colour: str = "red"


async def test_an_undocumented_field_in_an_answer_fails(app_client, monkeypatch):
    """What the contract is for: a field added to a response without the spec is caught.
    A view is its gateway.http.wire type and the spec is generated from those types
    (tests/unit/test_wire.py), so the way to add one without the spec is a type the spec
    does not know."""
    original = sandbox_routes.sandbox_view
    monkeypatch.setattr(sandbox_routes, "sandbox_view",
                        lambda rec: _Colourful(**vars(original(rec))))
    with pytest.raises(AssertionError, match="colour"):
        await call(app_client, "POST", "/v1/sandboxes", 201, json={})


# -- the SDK side -----------------------------------------------------------------------------

# schema -> the SDK model that parses it
MODELS: dict[str, Any] = {
    "Sandbox": models.SandboxInfo, "Template": models.Template, "Info": models.ServerInfo,
    "Preview": models.PreviewAccess, "FileInfo": models.FileInfo,
    "ExecutionError": models.ExecutionError, "Result": models.Result,
    "Execution": models.Execution, "ExecResult": models.ExecResult,
    "ProcessInfo": models.ProcessInfo, "ContextInfo": models.CodeContext,
    "Session": models.Session, "Usage": models.Usage, "KeyUsage": models.KeyUsage,
    "SandboxUsage": models.SandboxUsage, "SandboxMetrics": models.SandboxMetrics,
    "SandboxLogs": models.SandboxLogs, "SandboxEvent": models.SandboxEvent,
    "SandboxList": models.SandboxPage,
}
# Fields of a schema the SDK deliberately does not keep as a field of the same name
# (ServerInfo keeps every field of Info in .raw; Result keeps the MIME bundle).
NOT_A_FIELD: dict[str, set[str]] = {
    "Info": {"preview_domain", "session_domain", "key"},
    "Result": {"text/plain", "text/html", "image/png", "application/json"},  # in .data
    "Usage": {"from"}, "SandboxEvent": {"from"},  # as from_ (a keyword in Python)
}


def _sample(schema: dict[str, Any], schemas: dict[str, Any]) -> Any:
    """A maximal instance: every property set, an unknown field in every object."""
    if "$ref" in schema:
        return _sample(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas)
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return _sample(schema[key][0], schemas)
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type", "object")
    kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        out = {name: _sample(sub, schemas) for name, sub in props.items()}
        return out | {"x_unknown_field": {"nested": [1]}} if props else out
    return {"string": "s", "integer": 1, "number": 1.5, "boolean": True, "null": None,
            "array": [_sample(schema.get("items", {}), schemas)] if "items" in schema else []
            }[kind]


def _parse(model: Any, data: dict[str, Any]) -> Any:
    if model is models.Session:
        return model.from_dict(data, url="http://s.localhost")
    return model.from_dict(data)


def sdk_drops(name: str, schemas: dict[str, Any]) -> set[str]:
    """The properties of schema ``name`` that its SDK model does not keep (after parsing a
    maximal instance of it, unknown fields included)."""
    parsed = _parse(MODELS[name], _sample(schemas[name], schemas))
    fields = {f.name for f in dataclasses.fields(parsed)}
    return set(schemas[name].get("properties", {})) - fields - NOT_A_FIELD.get(name, set())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sdk_model_parses_the_schema_with_unknown_fields(name):
    schemas = openapi.build_document()["components"]["schemas"]
    assert name in schemas, f"the spec has no {name} schema"
    missing = sdk_drops(name, schemas)
    assert not missing, f"{name}: the SDK's {MODELS[name].__name__} drops {sorted(missing)}"


def test_a_spec_field_the_sdk_lacks_fails():
    schemas = copy.deepcopy(openapi.build_document()["components"]["schemas"])
    schemas["Sandbox"]["properties"]["colour"] = {"type": "string"}
    assert sdk_drops("Sandbox", schemas) == {"colour"}


def test_sdk_models_need_only_the_required_fields():
    schemas = openapi.build_document()["components"]["schemas"]
    for name, model in MODELS.items():
        schema = schemas[name]
        full = _sample(schema, schemas)
        minimal = {k: v for k, v in full.items() if k in schema.get("required", [])}
        _parse(model, minimal)
