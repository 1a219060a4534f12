"""The OpenAPI 3.1 document of the REST API, generated, served at ``GET /v1/openapi.json``.

Request and response schemas that cross to the guest come from the dataclasses
in ``guest.protocol``, the gateway's own shapes from the types in ``gateway.http.wire``
(one source of truth: a new field there appears here; the handlers answer those
types, so an answer cannot carry a field its schema lacks). ``tests/unit/test_openapi.py``
checks that every registered route is documented and every documented route is
registered, and validates the document.

Register with ``app.add_routes(openapi.routes)``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from gateway.http import wire, wire_base
from gateway.http.sandbox_routes import json_response
from gateway.errors import ERROR_CODES
from gateway.http.middleware import PUBLIC_PATHS
from guest import protocol as p

routes = web.RouteTableDef()

JSON, NDJSON, BYTES = "application/json", "application/x-ndjson", "application/octet-stream"
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean"}


# -- schemas from dataclasses ------------------------------------------------------------------

def type_schema(tp: Any) -> dict[str, Any]:
    """JSON Schema (2020-12, as OpenAPI 3.1 uses) for a Python type annotation."""
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    if tp is Any or tp is object:
        return {}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if dataclasses.is_dataclass(tp):
        return {"$ref": f"#/components/schemas/{tp.__name__}"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return {"type": _SIMPLE[type(args[0])], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return _union_schema(args)
    if origin is list:
        return {"type": "array", "items": type_schema(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(args[1]) if args else {}}
    raise TypeError(f"no schema for {tp!r}")


def _union_schema(args: tuple[Any, ...]) -> dict[str, Any]:
    options = [type_schema(a) for a in args if a is not type(None)]
    nullable = type(None) in args
    if nullable and len(options) == 1 and set(options[0]) == {"type", "enum"}:
        return {"type": [options[0]["type"], "null"], "enum": [*options[0]["enum"], None]}
    if nullable:
        options.append({"type": "null"})
    if all(set(o) == {"type"} for o in options):
        return {"type": [o["type"] for o in options]}
    return {"anyOf": options}


def dataclass_schema(cls: type, doc: dict[str, str] | None = None) -> dict[str, Any]:
    if wire_base.is_wire(cls):
        return _wire_schema(cls)
    hints = typing.get_type_hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        schema = type_schema(hints[f.name])
        if f.default is not dataclasses.MISSING:
            schema["default"] = f.default
        elif f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        if doc and f.name in doc:
            schema["description"] = doc[f.name]
        props[f.name] = schema
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        out["description"] = " ".join(cls.__doc__.split())
    return out


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null."""
    kind = schema.get("type")
    if isinstance(kind, list):
        return schema if "null" in kind else {**schema, "type": [*kind, "null"]}
    if isinstance(kind, str):
        out = {**schema, "type": [kind, "null"]}
        if "enum" in schema:
            out["enum"] = [*schema["enum"], None]
        return out
    if set(schema) == {"anyOf"}:
        return {"anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {"anyOf": [schema, {"type": "null"}]}


def _wire_schema(cls: Any) -> dict[str, Any]:
    """A ``gateway.http.wire`` type's schema: its fields' types and metadata
    (gateway.http.wire_base)."""
    opts = cls.__wire__
    props, required = {}, []
    for f in wire_base.fields(cls):
        m = f.meta
        base = wire_base.without_none(f.hint)
        schema = dict(m["schema"]) if m["schema"] else type_schema(base)
        for name, value in m["bounds"].items():
            schema[name] = {**schema.get(name, {}), **value} if name == "items" else value
        if base is not f.hint and not f.omit:  # null allowed (omitted fields: left out)
            schema = _nullable(schema)
        if m["description"]:
            schema["description"] = m["description"]
        if f.required:
            required.append(f.wire)
        elif opts["kind"] == wire_base.REQUEST and f.default is not None \
                and not dataclasses.is_dataclass(f.default):
            schema["default"] = f.default
        props[f.wire] = schema
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if opts["extra"] is not None:
        out["additionalProperties"] = opts["extra"]
    if opts["description"]:
        out["description"] = opts["description"]
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_code() -> dict[str, Any]:
    return {"type": "string", "enum": sorted(ERROR_CODES),
            "description": "every code an error answer can carry (the server's registry, "
                           "gateway.errors.ERROR_CODES); x-descriptions says what each means",
            "x-descriptions": dict(sorted(ERROR_CODES.items()))}


_PROTOCOL = (p.ExecRequest, p.ExecResult, p.OutputFile, p.FileInfo, p.DirListing, p.RunCodeRequest,
             p.ExecutionError, p.CreateContextRequest, p.ContextInfo, p.CommandRequest,
             p.ProcessInfo, p.SignalRequest, p.PortInfo)


def _schemas() -> dict[str, Any]:
    schemas = {cls.__name__: dataclass_schema(cls) for cls in _PROTOCOL}
    execution = dataclass_schema(p.Execution)
    execution["properties"]["results"] = {"type": "array", "items": _ref("Result")}
    schemas["Execution"] = execution
    schemas["ErrorCode"] = _error_code()
    schemas.update({cls.__name__: dataclass_schema(cls) for cls in wire.SCHEMAS})
    return schemas


# -- operations --------------------------------------------------------------------------------

_ERRORS = {
    400: ("BadRequest", "malformed request (bad_request, bad_json, invalid_path, ...)"),
    401: ("Unauthorized", "missing_api_key or invalid_api_key"),
    403: ("Forbidden", "the key may not do this (forbidden)"),
    404: ("NotFound", "sandbox_not_found, template_not_found, not_found (file), "
                      "context_not_found, process_not_found, session_not_found, "
                      "session_not_ready"),
    409: ("Conflict", "wrong state: not_running, conflict, stdin_closed, context_exists, "
                      "session_name_taken; quota_exceeded (a key's max_sandboxes, "
                      "max_awake or max_disk_mib)"),
    413: ("PayloadTooLarge", "body over the server's limit (payload_too_large)"),
    429: ("TooMany", "rate_limited (see Retry-After), too_many_contexts, "
                     "too_many_processes"),
    502: ("SandboxFailed", "the VM or guest agent failed: vm_start_failed, vm_gone, "
                           "agent_unreachable, agent_protocol_error, agent_reply_too_large, "
                           "snapshot_invalid, vmm_protocol_error"),
    503: ("Unavailable", "at capacity (sandbox_limit) or busy; see Retry-After"),
    504: ("Timeout", "the sandbox did not answer in time (vm_timeout, agent_timeout)"),
    507: ("NoSpace", "the sandbox's disk is full (no_space)"),
}
_SANDBOX_ERRORS = (404, 409, 502, 503, 504)


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    summary: str
    tag: str
    ok: int = 200
    body: str | None = None  # schema name, or "bytes"
    returns: str | None = None  # schema name, "bytes", "ndjson:Schema", or None (no body)
    errors: tuple[int, ...] = ()
    query: tuple[tuple[str, str, dict[str, Any]], ...] = ()  # (name, description, schema)
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # another success answer: (status, returns), e.g. a streamed form with its own status
    also: tuple[int, str] | None = None


_SB, _PID = "/v1/sandboxes/{id}", "/v1/sandboxes/{id}/commands/{pid}"
_ANY_METHODS = ("GET", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS")
# Registered routes that are not API endpoints: the preview/session host proxy answers any
# path on ``{port}-{id}.<preview_domain>`` and ``{name}.<session_domain>`` hosts (a sub-app
# matched by Host, which OpenAPI cannot express).
NOT_API_ROUTES = frozenset({("*", "/{tail}"), ("GET", "/dashboard"), ("GET", "/dashboard/"),
                            ("GET", "/dashboard/{name}"),  # the dashboard's static files
                            # host-to-host, admin only (gateway/http/migration_routes.py)
                            ("POST", "/v1/internal/migrations"),
                            ("POST", "/v1/internal/migrations/{id}/commit"),
                            ("POST", "/v1/internal/migrations/{id}/abort")})
_TENANT = ("tenant", "admin key only: another key's id (e.g. a revoked key's sandboxes)",
           {"type": "string"})
_LIST_QUERY = (
    ("state", "one or more states, comma-separated", {"type": "string"}),
    ("template", "template name", {"type": "string"}),
    ("metadata.{KEY}", "a metadata value to match (metadata.user=alice)", {"type": "string"}),
    ("limit", "page size (default 100, max 1000)", {"type": "integer", "minimum": 1,
                                                     "maximum": 1000}),
    ("cursor", "next_cursor of the previous page", {"type": "string"}))
_NDJSON_NOTE = ("Streams NDJSON; a stream that ends without its final line was cut short.")

OPS: tuple[Op, ...] = (
    Op("GET", "/healthz", "Daemon health (no key needed)", "meta", returns="Health"),
    Op("GET", "/v1/info", "Server version and preview URL template", "meta", returns="Info"),
    Op("GET", "/v1/openapi.json", "This document", "meta", returns="object"),
    Op("GET", "/v1/templates", "List templates: built-in and the key's own", "templates",
       returns="TemplateList"),
    Op("POST", "/v1/templates/builds", "Build a template from a Dockerfile (body: the build "
       "context as a tar holding the Dockerfile)", "templates", 202, "bytes", "BuildResponse",
       (400, 404, 409, 413, 503), query=(
           ("name", "the template's name", {"type": "string"}),
           ("dockerfile", "the Dockerfile's path in the context (default Dockerfile)",
            {"type": "string"}))),
    Op("GET", "/v1/templates/builds/{build_id}", "Get a build", "templates",
       returns="BuildResponse", errors=(404,)),
    Op("GET", "/v1/templates/builds/{build_id}/log", "A build's log as NDJSON events (follows "
       "the build until it ends)", "templates", returns="ndjson:BuildEvent", errors=(404,)),
    Op("GET", "/v1/templates/{name}", "Get a template", "templates", returns="Template",
       errors=(404,)),
    Op("DELETE", "/v1/templates/{name}", "Delete one of the key's templates (its files stay "
       "until no sandbox made from it is left)", "templates", 204, errors=(404, 409)),
    Op("POST", _SB + "/snapshot", "Save a running (or sleeping: woken first) sandbox as a "
       "template of the key's", "templates", 201, "SnapshotRequest", "Template",
       (400,) + _SANDBOX_ERRORS),
    Op("POST", _SB + "/fork", "Make count new sandboxes in this one's state (files, "
       "processes, memory)", "sandboxes", 201, "ForkRequest", "SandboxList",
       (400,) + _SANDBOX_ERRORS),
    Op("POST", "/v1/keys", "Create an API key (admin key only)", "keys", 201,
       "CreateKeyRequest", "CreatedKey", (400, 403)),
    Op("GET", "/v1/keys", "List API keys (admin key only)", "keys", returns="KeyList",
       errors=(403,), query=(("revoked", "1: include revoked keys",
                              {"type": "string", "enum": ["0", "1"]}),)),
    Op("PATCH", "/v1/keys/{key_id}", "Change a key's limits (admin key only)", "keys",
       body="UpdateKeyRequest", returns="Key", errors=(400, 403, 404)),
    Op("DELETE", "/v1/keys/{key_id}", "Revoke a key (admin key only); its sandboxes stay",
       "keys", 204, errors=(400, 403, 404)),
    Op("POST", "/v1/sandboxes", "Create a sandbox", "sandboxes", 201, "CreateSandboxRequest",
       "Sandbox", (400, 403, 404, 409, 502, 503, 504)),
    Op("GET", "/v1/sandboxes", "List the key's sandboxes", "sandboxes", returns="SandboxList",
       errors=(400, 403), query=(_TENANT, *_LIST_QUERY),
       description="Filters combine (all must match); ordered by created_at, then id. Any "
                   "number of metadata.KEY=VALUE filters (a non-string value matches its "
                   "JSON text). With several hosts ([cluster]) any host lists the whole "
                   "fleet's; `partial` names hosts whose sandboxes are missing."),
    Op("GET", "/v1/usage", "Usage metering of the key (admin: ?key=ID or ?key=* for all)",
       "usage", returns="Usage", errors=(400, 403), query=(
           ("from", "Unix time (default 0)", {"type": "number"}),
           ("to", "Unix time (default now)", {"type": "number"}),
           ("key", "admin key only: another key's id, or * for every key",
            {"type": "string"}))),
    Op("GET", "/v1/events", "Sandbox state transitions, live (server-sent events)", "sandboxes",
       returns="sse:TransitionEvent", errors=(),
       description="text/event-stream: `event: ready` first, then one `event: transition` "
                   "(data: TransitionEvent, id: its seq) per state change of the key's "
                   "sandboxes (an admin key: all), comments as heartbeats; `event: dropped` "
                   "ends a stream that fell behind (reload, reconnect). At most 4 streams "
                   "per key (429)."),
    Op("GET", _SB + "/metrics", "A sandbox's CPU, memory (its VMM) and disk use", "sandboxes",
       returns="SandboxMetrics", errors=(403, 404), query=(_TENANT,),
       description="Read on the host; does not wake a suspended sandbox."),
    Op("GET", _SB + "/logs", "A sandbox's console log tail and its state transitions",
       "sandboxes", returns="SandboxLogs", errors=(400, 403, 404), query=(
           _TENANT, ("tail", "lines of console (default 200, max 10000); also bounds events",
                     {"type": "integer", "minimum": 0, "maximum": 10000})),
       description="Read on the host; does not wake a suspended sandbox."),
    Op("GET", _SB, "Get a sandbox", "sandboxes", returns="Sandbox", errors=(403, 404),
       query=(_TENANT,)),
    Op("PATCH", _SB, "Change a sandbox's idle timeout, metadata or lifetimes", "sandboxes",
       body="UpdateSandboxRequest", returns="Sandbox", errors=(400, 404)),
    Op("DELETE", _SB, "Delete a sandbox", "sandboxes", 204, errors=(403, 404),
       query=(_TENANT,)),
    Op("POST", _SB + "/suspend", "Suspend: snapshot to disk, stop the VM", "sandboxes",
       returns="Sandbox", errors=_SANDBOX_ERRORS),
    Op("POST", _SB + "/resume", "Resume a suspended sandbox (any request also wakes it)",
       "sandboxes", returns="Sandbox", errors=_SANDBOX_ERRORS),
    Op("GET", "/metrics", "Prometheus metrics (admin key)", "meta", returns="text",
       errors=(403,)),
    Op("GET", _SB + "/ports", "The TCP ports something listens on in the guest (wakes it)",
       "preview", returns="PortList", errors=_SANDBOX_ERRORS),
    Op("GET", _SB + "/preview", "A sandbox's preview access (token, public ports)", "preview",
       returns="Preview", errors=(404,)),
    Op("PATCH", _SB + "/preview", "Set the ports served without a preview token", "preview",
       body="UpdatePreviewRequest", returns="Preview", errors=(400, 404)),
    Op("POST", _SB + "/preview-token", "Rotate the preview token", "preview",
       returns="Preview", errors=(404,)),
    Op("PUT", "/v1/sessions/{name}", "Create or get a named long-lived session (idempotent)",
       "sessions", 201, "SessionSpec", "Session", (400,) + _SANDBOX_ERRORS,
       description="201 when created, 200 when it already existed."),
    Op("GET", "/v1/sessions", "List sessions", "sessions", returns="SessionList"),
    Op("GET", "/v1/sessions/{name}", "Get a session", "sessions", returns="Session",
       errors=(404,)),
    Op("DELETE", "/v1/sessions/{name}", "Delete a session and its sandbox", "sessions", 204,
       errors=(404,)),
    Op("*", "/v1/sessions/{name}/proxy", "The session's app (proxied; wakes it)", "sessions",
       returns="any", errors=(404,) + _SANDBOX_ERRORS),
    Op("*", "/v1/sessions/{name}/proxy/{path}", "The session's app at a path (proxied)",
       "sessions", returns="any", errors=(404,) + _SANDBOX_ERRORS),
    Op("GET", _SB + "/terminal", "Interactive terminal (WebSocket)", "sandboxes", 101,
       errors=(400,) + _SANDBOX_ERRORS, query=(
           ("cols", "initial width (default 80)", {"type": "integer", "minimum": 1}),
           ("rows", "initial height (default 24)", {"type": "integer", "minimum": 1}),
           ("cmd", "program to run instead of the login shell", {"type": "string"})),
       description=(
           "Upgrade to a WebSocket. Binary frames carry raw terminal bytes both ways. Text "
           "frames are JSON: {\"type\":\"resize\",\"cols\",\"rows\"} from the client, "
           "{\"type\":\"exit\",\"exit_code\"} from the server before it closes.")),
    Op("POST", _SB + "/execute", "Run code or a shell command to completion", "execute",
       body="ExecRequest", returns="ExecResult", errors=(400,) + _SANDBOX_ERRORS),
    Op("POST", _SB + "/files", "Upload a file (raw body; atomic)", "files", 201, "bytes",
       "FileInfo", (400, 413, 507) + _SANDBOX_ERRORS,
       (("path", "absolute path in the sandbox", {"type": "string"}),)),
    Op("PUT", _SB + "/files", "Upload a file (same as POST)", "files", 201, "bytes",
       "FileInfo", (400, 413, 507) + _SANDBOX_ERRORS,
       (("path", "absolute path in the sandbox", {"type": "string"}),)),
    Op("GET", _SB + "/files/{path}", "Download a file, or list a directory (JSON)", "files",
       returns="bytes|DirListing", errors=(400,) + _SANDBOX_ERRORS),
    Op("DELETE", _SB + "/files/{path}", "Delete a file or directory (recursively)", "files",
       204, errors=(400,) + _SANDBOX_ERRORS),
    Op("GET", _SB + "/stat/{path}", "Stat a file or directory (404 if missing)", "files",
       returns="FileInfo", errors=(400,) + _SANDBOX_ERRORS),
    Op("POST", _SB + "/run_code", "Run code in a stateful interpreter context", "interpreter",
       body="RunCodeRequest", returns="Execution|ndjson:RunEvent",
       errors=(400,) + _SANDBOX_ERRORS, description="With \"stream\": true: " + _NDJSON_NOTE),
    Op("POST", _SB + "/contexts", "Create an interpreter context", "interpreter", 201,
       "CreateContextRequest", "ContextInfo", (400, 429) + _SANDBOX_ERRORS),
    Op("GET", _SB + "/contexts", "List interpreter contexts", "interpreter",
       returns="ContextList", errors=_SANDBOX_ERRORS),
    Op("DELETE", _SB + "/contexts/{name}", "Delete an interpreter context", "interpreter",
       204, errors=(400,) + _SANDBOX_ERRORS),
    Op("POST", _SB + "/commands", "Start a command (background: answer at once)", "commands",
       201, "CommandRequest", "ProcessInfo", (400, 429) + _SANDBOX_ERRORS,
       also=(200, "ndjson:OutputEvent"),
       description="background=false streams its output (200 NDJSON, first line "
                   "{\"type\":\"start\",\"pid\"}); the command is killed if the client leaves."),
    Op("GET", _SB + "/commands", "List commands", "commands", returns="ProcessList",
       errors=_SANDBOX_ERRORS),
    Op("GET", _PID, "Get a command", "commands", returns="ProcessInfo", errors=_SANDBOX_ERRORS),
    Op("POST", _PID + "/stdin", "Write to a command's stdin (raw body)", "commands", 204,
       "bytes", None, (409,) + _SANDBOX_ERRORS,
       (("eof", "1: close stdin after writing", {"type": "string", "enum": ["0", "1"]}),)),
    Op("POST", _PID + "/signal", "Signal a command's process group", "commands", 204,
       "SignalRequest", None, (400,) + _SANDBOX_ERRORS),
    Op("GET", _PID + "/wait", "Wait for a command to finish", "commands", returns="ProcessInfo",
       errors=(400,) + _SANDBOX_ERRORS,
       query=(("timeout", "seconds to wait (default 30, max 3600)", {"type": "number"}),)),
    Op("GET", _PID + "/output", "A command's output from a byte offset", "commands",
       returns="ndjson:OutputEvent", errors=(400,) + _SANDBOX_ERRORS, query=(
           ("offset", "absolute byte offset to start from", {"type": "integer", "minimum": 0}),
           ("follow", "1: keep streaming until the command exits",
            {"type": "string", "enum": ["0", "1"]})),
       description=_NDJSON_NOTE + " Reattach with offset = the last next_offset seen."),
)


def _content(kind: str) -> dict[str, Any]:
    content: dict[str, Any] = {}
    for part in kind.split("|"):
        if part == "bytes":
            content[BYTES] = {"schema": {"type": "string", "contentMediaType": BYTES}}
        elif part == "object":
            content[JSON] = {"schema": {"type": "object"}}
        elif part == "text":
            content["text/plain"] = {"schema": {"type": "string"}}
        elif part == "any":
            content["*/*"] = {"schema": {}}
        elif part.startswith("sse:"):  # text/event-stream whose data lines are the schema
            content["text/event-stream"] = {"schema": _ref(part[len("sse:"):])}
        elif part.startswith("ndjson:"):
            content[NDJSON] = {"schema": _ref(part[len("ndjson:"):])}
        else:
            content[JSON] = {"schema": _ref(part)}
    return content


def _path_params(path: str) -> list[dict[str, Any]]:
    names = [seg[1:-1] for seg in path.split("/") if seg.startswith("{")]
    schema = {"pid": {"type": "integer"}}
    return [{"name": n, "in": "path", "required": True,
             "schema": schema.get(n, {"type": "string"})} for n in names]


def _operation(op: Op) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "Switching Protocols" if op.ok == 101 else "OK"}
    if op.returns:
        ok["content"] = _content(op.returns)
    # Every keyed request can meet its key's rate limit (gateway.http.ratelimit).
    errors = op.errors if op.path in PUBLIC_PATHS else (401, 429, *op.errors)
    responses = {str(op.ok): ok}
    if op.also:
        responses[str(op.also[0])] = {"description": "OK (streamed)",
                                      "content": _content(op.also[1])}
    responses.update({str(s): {"$ref": f"#/components/responses/{_ERRORS[s][0]}"}
                      for s in sorted(set(errors))})
    out: dict[str, Any] = {
        "summary": op.summary, "tags": [op.tag], "responses": responses,
        "operationId": _operation_id(op),
        "parameters": _path_params(op.path) + [
            {"name": n, "in": "query", "description": d, "schema": s} for n, d, s in op.query],
    }
    if op.body:
        out["requestBody"] = {"required": True, "content": _content(op.body)}
    if op.description:
        out["description"] = op.description
    if op.path in PUBLIC_PATHS:
        out["security"] = []
    return out


def _operation_id(op: Op) -> str:
    words = [w.strip("{}") for w in op.path.split("/") if w and w != "v1"]
    return "_".join([op.method.lower(), *words]).replace(".", "_").replace("-", "_")


@functools.cache
def build_document(version: str | None = None) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (cached; treat it as read-only)."""
    paths: dict[str, dict[str, Any]] = {}
    for op in OPS:
        for method in (_ANY_METHODS if op.method == "*" else (op.method,)):
            paths.setdefault(op.path, {})[method.lower()] = _operation(replace(op, method=method))
    responses = {name: {"description": desc, "content": {JSON: {"schema": _ref("Error")}}}
                 for name, desc in _ERRORS.values()}
    return {
        "openapi": "3.1.0",
        "info": {"title": "AgentBox API", "version": version or _version(),
                 "description": (
                     "Self-hosted microVM sandboxes for AI agents. Errors are "
                     "{\"error\": {\"code\", \"message\"}} with a stable code. Besides these "
                     "paths, the gateway proxies every request to a host "
                     "{port}-{id}.<preview_domain> to that port of the sandbox, and to "
                     "{name}.<session_domain> to a session's app (see GET /v1/info).")},
        "security": [{"bearerAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(), "responses": responses},
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentbox-server")  # the server distribution, not the SDK
    except PackageNotFoundError:
        return "0.0.0"


def documented_routes() -> set[tuple[str, str]]:
    """(method, path) as aiohttp registers them ("*" = any method)."""
    return {(op.method, op.path) for op in OPS}


@routes.get("/v1/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    doc = {**build_document(), "servers": [{"url": f"{request.scheme}://{request.host}"}]}
    return json_response(doc)
