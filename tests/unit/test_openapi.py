"""The OpenAPI document matches the routes the real app registers, both ways, and is valid."""

from __future__ import annotations

import pytest
from aiohttp import web

from gateway.http import openapi
from gateway.http.app import build_app
from gateway.config import load


def registered_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the daemon's app (no VM backend is started:
    building the app only registers routes; HEAD twins of GETs are aiohttp's)."""
    app = build_app(load(None))
    if not any(r.resource is not None and r.resource.canonical == "/v1/openapi.json"
               for r in app.router.routes()):
        pytest.fail("gateway.http.app.build_app does not register gateway.http.openapi.routes: "
                    "add `app.add_routes(openapi.routes)`")
    found = {(r.method, r.resource.canonical) for r in app.router.routes()
             if r.method != "HEAD" and r.resource is not None}
    return found - openapi.NOT_API_ROUTES


def test_every_registered_route_is_documented():
    missing = registered_routes() - openapi.documented_routes()
    assert not missing, f"routes missing from gateway/http/openapi.py OPS: {sorted(missing)}"


def test_every_documented_route_is_registered():
    extra = openapi.documented_routes() - registered_routes()
    assert not extra, f"documented in gateway/http/openapi.py but not registered: {sorted(extra)}"


def test_document_is_valid_openapi_3_1():
    validator = pytest.importorskip("openapi_spec_validator")
    doc = openapi.build_document()
    validator.validate(doc)
    assert doc["openapi"] == "3.1.0"
    # every operation id is unique (SDK generators need that)
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))


def test_schemas_follow_the_protocol_dataclasses():
    schemas = openapi.build_document()["components"]["schemas"]
    exec_req = schemas["ExecRequest"]
    assert set(exec_req["properties"]) == {"command", "code", "language", "timeout", "env", "cwd"}
    assert exec_req["properties"]["command"]["type"] == ["string", "null"]
    assert exec_req["properties"]["env"] == {"type": "object",
                                             "additionalProperties": {"type": "string"}}
    assert schemas["ExecResult"]["required"] == ["stdout", "stderr", "exit_code", "duration_ms"]
    assert schemas["Execution"]["properties"]["error"] == {
        "anyOf": [{"$ref": "#/components/schemas/ExecutionError"}, {"type": "null"}]}
    assert "running" in schemas["Sandbox"]["properties"]["state"]["enum"]


def test_auth_is_bearer_except_public_paths():
    doc = openapi.build_document()
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    create = doc["paths"]["/v1/sandboxes"]["post"]
    assert "security" not in create and "401" in create["responses"]
    err = doc["components"]["responses"]["NotFound"]["content"]["application/json"]["schema"]
    assert err == {"$ref": "#/components/schemas/Error"}


def test_type_schema_rejects_unknown_types():
    with pytest.raises(TypeError):
        openapi.type_schema(complex)


async def test_served_document_names_the_server(aiohttp_client):
    app = web.Application()
    app.add_routes(openapi.routes)
    client = await aiohttp_client(app)
    resp = await client.get("/v1/openapi.json")
    assert resp.status == 200
    doc = await resp.json()
    assert doc["servers"] == [{"url": f"http://{client.host}:{client.port}"}]
    assert "/v1/sandboxes/{id}/run_code" in doc["paths"]
