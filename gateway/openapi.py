"""The OpenAPI 3.1 document of the REST API, generated, served at ``GET /v1/openapi.json``.

Request and response schemas that cross to the guest come from the dataclasses
in ``guest.protocol`` (one source of truth: a new field there appears here);
the gateway's own shapes are written out below. ``tests/unit/test_openapi.py``
checks that every registered route is documented and every documented route is
registered, and validates the document.

Register with ``app.add_routes(openapi.routes)``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from gateway.api import json_response
from gateway.errors import ERROR_CODES
from gateway.lifecycle import State
from gateway.middleware import PUBLIC_PATHS
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
    if dataclasses.is_dataclass(tp):
        return {"$ref": f"#/components/schemas/{tp.__name__}"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [type_schema(a) for a in args if a is not type(None)]
        if type(None) in args:
            options.append({"type": "null"})
        if all(set(o) == {"type"} for o in options):
            return {"type": [o["type"] for o in options]}
        return {"anyOf": options}
    if origin is list:
        return {"type": "array", "items": type_schema(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(args[1]) if args else {}}
    raise TypeError(f"no schema for {tp!r}")


def dataclass_schema(cls: type, doc: dict[str, str] | None = None) -> dict[str, Any]:
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


def _obj(props: dict[str, Any], required: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    out = {"type": "object", "properties": props, **extra}
    if required:
        out["required"] = list(required)
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _list_of(key: str, item: str) -> dict[str, Any]:
    return _obj({key: {"type": "array", "items": _ref(item)}}, (key,))


_STR, _NUM, _INT, _BOOL = ({"type": t} for t in ("string", "number", "integer", "boolean"))
_NSTR, _NNUM = {"type": ["string", "null"]}, {"type": ["number", "null"]}
_METADATA = {"type": "object", "description": "free-form JSON object (max 16 KiB)"}
_RULES = {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 253},
          "description": "CIDRs or addresses (IPv4/IPv6) and domain names (example.com, "
                         "*.example.com)"}
_EGRESS_RULES = _obj({"default": {"type": "string", "enum": ["deny", "allow"]},
                      "allow": _RULES, "deny": _RULES}, additionalProperties=False)
_EGRESS_IN = {"oneOf": [{"type": "string", "enum": ["deny_all", "allow_all"]}, _EGRESS_RULES],
              "description": "egress policy: deny wins over allow, default for the rest; "
                             "domain rules act at the sandbox's resolver (docs/security.md)"}
_EGRESS_OUT = _obj({"default": {"type": "string", "enum": ["deny", "allow"]},
                    "allow": _RULES, "deny": _RULES,
                    "source": {"type": "string", "enum": ["sandbox", "host"],
                               "description": "host: the sandbox follows the host default"}},
                   ("source",), additionalProperties=False)
_IDLE = {"type": "number", "minimum": 0,
         "description": "seconds without activity before the sandbox is suspended; 0 = never"}


# Per-sandbox resources (gateway.resources): 400 invalid_resources, 403 resource_limit.
_SHAPE_REQUEST = {
    "vcpus": {"type": "integer", "minimum": 1, "description": "virtual CPUs (default: the "
              "server's [vm] vcpus); a new (vcpus, memory_mib) waits for its golden snapshot"},
    "memory_mib": {"type": "integer", "minimum": 64,
                   "description": "guest RAM in MiB (default: the template's)"},
    "disk_mib": {"type": "integer", "minimum": 1, "description": "root disk size in MiB the "
                 "guest sees (default and minimum: the template's; sparse on the host)"}}
_TEMPLATE_SHAPE = {
    "vcpus": {"type": "integer", "description": "default vCPUs (mem_mib: default RAM)"},
    "disk_mib": {"type": "integer", "description": "default (and smallest) disk"},
    **{f"max_{name}": {"type": "integer", "description": f"largest {name} a create may ask "
                       "for (the key's limits apply too); 0 = no limit"}
       for name in ("vcpus", "memory_mib", "disk_mib")}}
_SHAPE_VIEW = {name: {"type": ["integer", "null"], "description": "null: made before shapes"}
               for name in _SHAPE_REQUEST}


def _gateway_schemas() -> dict[str, Any]:
    sandbox = _obj({
        "id": _STR, "state": {"type": "string", "enum": [s.value for s in State]},
        "template": _STR, "metadata": _METADATA, "idle_timeout": _NNUM,
        "created_at": _NUM, "updated_at": _NUM, "last_activity": _NUM,
        "suspend_count": _INT, "restore_count": _INT, "last_suspend_ms": _NNUM,
        "last_restore_ms": _NNUM, "failure": _NSTR, "egress": _EGRESS_OUT,
        # lifetimes (gateway.lifetimes)
        "expires_at": {"type": ["number", "null"], "description": "Unix time its ttl ends"},
        "auto_delete_after": _NUM,
        "delete_at": {"type": ["number", "null"],
                      "description": "suspended/failed: Unix time auto_delete_after ends"},
        **_SHAPE_VIEW,
        # the owner's view (create, get, update; not list): gateway.preview_auth.preview_view
        "preview_token": _STR, "public_ports": {"type": "array", "items": _INT},
        "preview_url_template": _STR},
        ("id", "state", "template", "metadata", "created_at"))
    output_event = _obj({
        "type": {"type": "string", "enum": ["start", "stdout", "stderr", "dropped", "exit"]},
        "pid": _INT, "data": _STR, "offset": _INT, "next_offset": _INT,
        "exit_code": {"type": ["integer", "null"]}, "timed_out": _BOOL}, ("type",),
        description="one NDJSON line of a command's output (reattach from next_offset)")
    run_event = _obj({
        "type": {"type": "string", "enum": ["stdout", "stderr", "result", "error", "end"]},
        "data": _STR, "result": _ref("Result"), "error": _ref("ExecutionError"),
        "execution_count": _INT, "duration_ms": _NUM,
        "files": {"type": "array", "items": _ref("OutputFile"), "description":
                  "on `end`: files the run created or changed under /output/"}}, ("type",),
        description="one NDJSON line of a streamed run_code")
    return {
        "Error": _obj({"error": _obj({"code": _ref("ErrorCode"), "message": _STR},
                                     ("code", "message"))}, ("error",)),
        "ErrorCode": {"type": "string", "enum": sorted(ERROR_CODES),
                      "description": "every code an error answer can carry (the server's "
                                     "registry, gateway.errors.ERROR_CODES); "
                                     "x-descriptions says what each means",
                      "x-descriptions": dict(sorted(ERROR_CODES.items()))},
        "Sandbox": sandbox,
        "SandboxList": {**_list_of("sandboxes", "Sandbox"), "properties": {
            **_list_of("sandboxes", "Sandbox")["properties"],
            "next_cursor": {"type": ["string", "null"],
                            "description": "pass as ?cursor= for the next page; null: last"}}},
        **_controls_schemas(),
        "CreateSandboxRequest": _obj({
            "template": {"type": "string", "description": "default: the server's default"},
            "environment": {"type": "string", "description": "alias of template"},
            "metadata": _METADATA, "idle_timeout": _IDLE, "egress": _EGRESS_IN, **_LIFETIMES,
            **_SHAPE_REQUEST},
            additionalProperties=False),
        "UpdateSandboxRequest": _obj({
            "metadata": _METADATA, "idle_timeout": _IDLE, **_LIFETIMES,
            "public_ports": {"type": "array", "items": _INT,
                             "description": "ports served without the preview token "
                                            "(replaces the list)"},
            "egress": _EGRESS_IN},
            additionalProperties=False),
        "Template": _obj({
            "name": _STR, "mem_mib": _INT, "default": _BOOL, **_TEMPLATE_SHAPE,
            "owner": {"type": "string", "enum": ["builtin", "tenant"]},
            "source": {"type": "string", "enum": ["builtin", "snapshot", "fork", "dockerfile"]},
            "state": {"type": "string", "enum": ["ready", "building", "failed", "deleting"]},
            "progress": _obj({"stage": _STR, "stage_index": _INT, "stages": _INT,
                              "elapsed_s": _NUM, "last": _STR},
                             description="a built-in template while it builds"),
            "error": _STR,
            "created_at": _NUM, "size_bytes": _INT, "from_sandbox": _STR,
            "paused_ms": {"type": "number", "description": "snapshot only: how long the "
                          "source sandbox was paused"}}, ("name",)),
        "Build": _obj({"id": _STR, "name": _STR,
                       "state": {"type": "string",
                                 "enum": ["queued", "running", "ready", "failed"]},
                       "created_at": _NUM, "finished_at": _NNUM, "step": _INT, "steps": _INT,
                       "cached_steps": _INT, "error": _NSTR,
                       "template": {"type": ["object", "null"]}},
                      ("id", "name", "state", "steps")),
        "BuildResponse": _obj({"build": _ref("Build")}, ("build",)),
        "BuildEvent": _obj({"type": {"type": "string", "enum": [
            "queued", "step", "output", "step_done", "error", "done"]}, "t": _NUM},
            ("type",), additionalProperties=True,
            description="step: n, of, text, cached; output: n, stream, text; step_done: n, "
                        "seconds; error: message, exit_code; done: state, template|error"),
        "TemplateList": _list_of("templates", "Template"),
        "SnapshotRequest": _obj({"template": {
            "type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,62}$",
            "description": "the new template's name (the key's own; not a built-in's)"}},
            ("template",), additionalProperties=False),
        "ForkRequest": _obj({"count": {"type": "integer", "minimum": 1, "maximum": 8,
                                       "default": 1}}, additionalProperties=False),

        "Health": _obj({"status": _STR, "vmm": _STR, "accel": _STR, "accel_reason": _STR,
                        "templates": {"type": "array", "items": _STR}}, ("status",)),
        "Info": _obj({"version": _STR, "preview_domain": _STR, "session_domain": _STR,
                      "preview_url_template": {"type": "string", "description":
                                               "URL of a sandbox port, with {port} and {id}"},
                      "session_url_template": {"type": "string",
                                               "description": "URL of a session, with {name}"}},
                     ("version", "preview_url_template"), additionalProperties=True),
        "Preview": _obj({"preview_token": _STR, "preview_url_template": _STR,
                         "public_ports": {"type": "array", "items": _INT,
                                          "description": "ports served without a token"}},
                        ("preview_token", "public_ports", "preview_url_template")),
        "UpdatePreviewRequest": _obj({"public_ports": {"type": "array", "items": _INT}},
                                     ("public_ports",), additionalProperties=False),
        "SessionSpec": _obj({
            "template": _STR, "port": {"type": "integer", "default": 8000, "minimum": 1,
                                       "maximum": 65535, "description": "the app's port"},
            "idle_timeout": _IDLE, "metadata": _METADATA,
            "start": {"type": "string", "description": "shell command started once, in the "
                                                       "background, when the sandbox is made"}},
            additionalProperties=False),
        "Session": _obj({
            "name": _STR, "sandbox_id": _NSTR, "state": _STR, "port": _INT, "start": _NSTR,
            "start_state": {"type": "string", "enum": ["none", "starting", "started",
                                                       "failed"]},
            "start_pid": {"type": ["integer", "null"]}, "start_error": _NSTR,
            "metadata": _METADATA, "created_at": _NUM, "url": _STR, "proxy_path": _STR,
            "preview_token": _NSTR}, ("name", "sandbox_id", "state", "port", "url")),
        "SessionList": _list_of("sessions", "Session"),
        **_key_schemas(),
        "Result": _obj({"is_main_result": _BOOL, "text/plain": _STR, "text/html": _STR,
                        "image/png": {"type": "string", "contentEncoding": "base64"},
                        "application/json": {}}, ("is_main_result",),
                       additionalProperties=True,
                       description="a MIME bundle; is_main_result marks the last expression"),
        "ContextList": _list_of("contexts", "ContextInfo"),
        "ProcessList": _list_of("commands", "ProcessInfo"),
        "OutputEvent": output_event,
        "RunEvent": run_event,
    }


_LIFETIMES = {
    "ttl": {"type": "number", "minimum": 0, "description": "destroy this many seconds after "
            "create (PATCH: from now); 0 = never; default: the server's [sandbox] ttl"},
    "auto_delete_after": {"type": "number", "minimum": 0, "description": "destroy after this "
                          "many seconds suspended or failed; 0 = never"}}


def _controls_schemas() -> dict[str, Any]:
    """Usage, per-sandbox metrics and logs (gateway.usage, gateway.api_controls)."""
    figures = {"awake_seconds": _NUM, "vcpu_seconds": _NUM, "gib_seconds": _NUM,
               "suspended_seconds": _NUM, "snapshot_gib_hours": _NUM, "restores": _INT,
               "created": _INT, "destroyed": _INT}
    return {
        "SandboxUsage": _obj({"sandbox_id": _STR, "key": _STR, **figures},
                             ("sandbox_id", "key", *figures)),
        "KeyUsage": _obj({"key": _STR, **figures, "sandboxes": {
            "type": "array", "items": _ref("SandboxUsage")}}, ("key", *figures, "sandboxes")),
        "Usage": _obj({"from": _NUM, "to": _NUM, "keys": {"type": "array",
                                                          "items": _ref("KeyUsage")}},
                      ("from", "to", "keys")),
        "SandboxMetrics": _obj({
            "sandbox_id": _STR, "state": _STR, "vmm_pid": {"type": ["integer", "null"]},
            "source": {"type": ["string", "null"], "enum": ["cgroup", "proc", None],
                       "description": "where cpu/memory come from; null: no VM running"},
            "cpu_seconds": _NNUM, "memory_bytes": {"type": ["integer", "null"]},
            "rss_bytes": {"type": ["integer", "null"]}, "disk_bytes": _INT,
            "snapshot_bytes": _INT, "at": _NUM},
            ("sandbox_id", "state", "disk_bytes", "at")),
        "SandboxEvent": _obj({"at": _NUM, "from": _NSTR, "to": _STR, "event": _STR,
                              "cause": _STR}, ("at", "to", "event")),
        "SandboxLogs": _obj({"sandbox_id": _STR, "console": {"type": "array", "items": _STR},
                             "truncated": _BOOL, "events": {"type": "array",
                                                            "items": _ref("SandboxEvent")}},
                            ("sandbox_id", "console", "events")),
    }


_LIMITS_DOC = {
    "max_sandboxes": "sandboxes the key may have (any state)",
    "max_awake": "of those holding a VM at once (creating, running, paused, restoring, suspending)",
    "max_disk_mib": "sum of the key's sandbox directories on disk, checked at create",
    "rate": "API requests per second (token bucket)", "burst": "bucket size",
    "max_vcpus": "vcpus one sandbox may ask for (also capped per template)",
    "max_memory_mib": "memory_mib one sandbox may ask for (also capped per template)",
    "max_sandbox_disk_mib": "disk_mib one sandbox may ask for (also capped per template)"}


def _key_schemas() -> dict[str, Any]:
    """Keys and their limits (gateway.api_keys, gateway.quotas); 0 = no limit."""
    def limits(nullable: bool) -> dict[str, Any]:
        props = {name: {"type": ["number" if name == "rate" else "integer"]
                        + (["null"] if nullable else []), "minimum": 1 if name == "burst"
                        else 0, "description": desc} for name, desc in _LIMITS_DOC.items()}
        return _obj(props, additionalProperties=False)
    key = {"id": _STR, "name": _STR, "admin": _BOOL, "created_at": _NUM, "revoked": _BOOL,
           "limits": _ref("KeyLimits"),
           "overrides": {**limits(False), "description": "this key's own values"}}
    required = ("id", "name", "admin", "limits")
    return {
        "KeyLimits": {**limits(False), "description": "effective limits; 0 = no limit"},
        "KeyLimitsUpdate": {**limits(True), "description": "null = back to the default"},
        "CreateKeyRequest": _obj({"name": _STR, "admin": _BOOL,
                                  "limits": _ref("KeyLimitsUpdate")}, ("name",),
                                 additionalProperties=False),
        "UpdateKeyRequest": _obj({"limits": _ref("KeyLimitsUpdate")},
                                 additionalProperties=False),
        "Key": _obj(key, required),
        "KeyList": _list_of("keys", "Key"),
        "CreatedKey": _obj({**key, "key": {"type": "string",
                                           "description": "the secret, shown only once"}},
                           (*required, "key")),
    }


_PROTOCOL = (p.ExecRequest, p.ExecResult, p.OutputFile, p.FileInfo, p.DirListing, p.RunCodeRequest,
             p.ExecutionError, p.CreateContextRequest, p.ContextInfo, p.CommandRequest,
             p.ProcessInfo, p.SignalRequest)


def _schemas() -> dict[str, Any]:
    schemas = {cls.__name__: dataclass_schema(cls) for cls in _PROTOCOL}
    execution = dataclass_schema(p.Execution)
    execution["properties"]["results"] = {"type": "array", "items": _ref("Result")}
    schemas["Execution"] = execution
    schemas.update(_gateway_schemas())
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
NOT_API_ROUTES = frozenset({("*", "/{tail}")})
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
                   "JSON text)."),
    Op("GET", "/v1/usage", "Usage metering of the key (admin: ?key=ID or ?key=* for all)",
       "usage", returns="Usage", errors=(400, 403), query=(
           ("from", "Unix time (default 0)", {"type": "number"}),
           ("to", "Unix time (default now)", {"type": "number"}),
           ("key", "admin key only: another key's id, or * for every key",
            {"type": "string"}))),
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
    # Every keyed request can meet its key's rate limit (gateway.ratelimit).
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
