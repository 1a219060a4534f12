"""Every JSON object the gateway's REST API answers or accepts, as typed dataclasses.

These classes are the wire contract: ``gateway.http.openapi`` generates the document's schemas
from them, the handlers answer instances of them (``api.json_response``) and parse request
bodies into them (``parse``). How fields map to JSON Schema (``prop``, ``omit``, required,
closed request types): ``gateway.http.wire_base``. Shapes that cross to the guest are the
dataclasses of ``guest.protocol``; the ones here may refer to them. One module on purpose
(longer than most): the whole REST contract reads in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.sandbox.states import State
from gateway.http.wire_base import dumps, encode, parse, prop, request, response
from guest import protocol as p
from vmctl.egress import MAX_RULES

__all__ = ["dumps", "encode", "parse"]

ERROR_CODE_REF = {"$ref": "#/components/schemas/ErrorCode"}
MAX_SECONDS = 10 * 365 * 86400.0  # bounds a tenant's seconds (a deadline stays a sane float)
_METADATA = {"type": "object", "description": "free-form JSON object (max 16 KiB)"}
_RULES = dict(maxItems=MAX_RULES, items={"maxLength": 253},
              description="CIDRs or addresses (IPv4/IPv6) and domain names (example.com, "
                          "*.example.com)")
_SHAPE_NULL = "null: made before shapes"


# -- errors ----------------------------------------------------------------------------------

@response
class ErrorDetail:
    code: str = prop(schema=ERROR_CODE_REF)
    message: str


@response
class Error:
    error: ErrorDetail


# -- sandboxes -------------------------------------------------------------------------------

@response(extra=False)
class Egress:
    default: Literal["deny", "allow"] | None = prop(omit=True)
    allow: list[str] | None = prop(omit=True, **_RULES)
    deny: list[str] | None = prop(omit=True, **_RULES)
    source: Literal["sandbox", "host"] = prop(description="host: the sandbox follows the "
                                                          "host default")


@response
class Sandbox:
    id: str
    state: State
    template: str
    metadata: dict[str, Any] = prop(schema=_METADATA)
    idle_timeout: float | None = None
    created_at: float
    updated_at: float = 0.0
    last_activity: float = 0.0
    suspend_count: int = 0
    restore_count: int = 0
    last_suspend_ms: float | None = None
    last_restore_ms: float | None = None
    failure: str | None = None
    egress: Egress = prop(factory=lambda: Egress(source="host"))
    # lifetimes (gateway.sandbox.expiry)
    expires_at: float | None = prop(None, description="Unix time its ttl ends")
    auto_delete_after: float = 0.0
    delete_at: float | None = prop(None, description="suspended/failed: Unix time "
                                                     "auto_delete_after ends")
    # shape (gateway.sandbox.resources)
    vcpus: int | None = prop(None, description=_SHAPE_NULL)
    memory_mib: int | None = prop(None, description=_SHAPE_NULL)
    disk_mib: int | None = prop(None, description=_SHAPE_NULL)
    # the owner's view (get, update; not list): gateway.preview.access.preview_view
    preview_token: str | None = prop(omit=True)
    public_ports: list[int] | None = prop(omit=True)
    preview_url_template: str | None = prop(omit=True)


@response
class SandboxList:
    sandboxes: list[Sandbox]
    next_cursor: str | None = prop(None, description="pass as ?cursor= for the next page; "
                                                     "null: last")
    partial: list[str] | None = prop(omit=True, description=(
        "[cluster] only, present when some hosts did not answer in time: their names; "
        "their sandboxes are missing from this page (docs/cluster.md)"))


@response
class Preview:
    preview_token: str
    preview_url_template: str
    public_ports: list[int] = prop(description="ports served without a token")


# -- usage, metrics, logs (gateway.tenancy.usage, gateway.http.control_routes) ---------------------

@response
class SandboxUsage:
    sandbox_id: str
    key: str
    awake_seconds: float
    vcpu_seconds: float
    gib_seconds: float
    suspended_seconds: float
    snapshot_gib_hours: float
    restores: int
    created: int
    destroyed: int


@response
class KeyUsage:
    key: str
    awake_seconds: float
    vcpu_seconds: float
    gib_seconds: float
    suspended_seconds: float
    snapshot_gib_hours: float
    restores: int
    created: int
    destroyed: int
    sandboxes: list[SandboxUsage]


@response
class Usage:
    from_: float = prop(name="from")
    to: float
    keys: list[KeyUsage]


@response
class SandboxMetrics:
    sandbox_id: str
    state: str
    vmm_pid: int | None = None
    source: Literal["cgroup", "proc"] | None = prop(
        None, description="where cpu/memory come from; null: no VM running")
    cpu_seconds: float | None = None
    memory_bytes: int | None = None
    rss_bytes: int | None = None
    disk_bytes: int
    snapshot_bytes: int = 0
    at: float


@response
class SandboxEvent:
    at: float
    from_: str | None = prop(None, name="from")
    to: str
    event: str
    cause: str = ""


@response(description="one line of GET /v1/events (a server-sent event's data)")
class TransitionEvent:
    seq: int = prop(description="the transition's number: increases across all sandboxes")
    sandbox_id: str
    tenant: str = prop(description="the id of the key that owns the sandbox")
    at: float
    from_: str | None = prop(None, name="from")
    to: str
    event: str
    cause: str = ""


@response
class SandboxLogs:
    sandbox_id: str
    console: list[str]
    truncated: bool = False
    events: list[SandboxEvent]


# -- templates and builds --------------------------------------------------------------------

@response(description="a built-in template while it builds")
class TemplateProgress:
    stage: str = ""
    stage_index: int = 0
    stages: int = 0
    elapsed_s: float = 0.0
    last: str = ""


_MAX_DOC = "for (the key's limits apply too); 0 = no limit"


@response
class Template:
    name: str
    mem_mib: int | None = prop(omit=True)
    default: bool | None = prop(omit=True)
    vcpus: int | None = prop(omit=True, description="default vCPUs (mem_mib: default RAM)")
    disk_mib: int | None = prop(omit=True, description="default (and smallest) disk")
    max_vcpus: int | None = prop(omit=True, description="largest vcpus a create may ask "
                                 + _MAX_DOC)
    max_memory_mib: int | None = prop(omit=True, description="largest memory_mib a create may "
                                      "ask " + _MAX_DOC)
    max_disk_mib: int | None = prop(omit=True, description="largest disk_mib a create may ask "
                                    + _MAX_DOC)
    owner: Literal["builtin", "tenant"] | None = prop(omit=True)
    source: Literal["builtin", "snapshot", "fork", "dockerfile"] | None = prop(omit=True)
    state: Literal["ready", "building", "failed", "deleting"] | None = prop(omit=True)
    progress: TemplateProgress | None = prop(omit=True)
    error: str | None = prop(omit=True)
    created_at: float | None = prop(omit=True)
    size_bytes: int | None = prop(omit=True)
    from_sandbox: str | None = prop(omit=True)
    paused_ms: float | None = prop(omit=True, description="snapshot only: how long the source "
                                                          "sandbox was paused")


@response
class TemplateList:
    templates: list[Template]


@response
class Build:
    id: str
    name: str
    state: Literal["queued", "running", "ready", "failed"]
    created_at: float = 0.0
    finished_at: float | None = None
    step: int = 0
    steps: int
    cached_steps: int = 0
    error: str | None = None
    template: dict[str, Any] | None = prop(None, schema={"type": ["object", "null"]})


@response
class BuildResponse:
    build: Build


@response(extra=True, description="step: n, of, text, cached; output: n, stream, text; "
                                  "step_done: n, seconds; error: message, exit_code; done: "
                                  "state, template|error")
class BuildEvent:
    type: Literal["queued", "step", "output", "step_done", "error", "done"]
    t: float = 0.0


# -- meta ------------------------------------------------------------------------------------

@response
class Health:
    status: str
    vmm: str = ""
    accel: str = ""
    accel_reason: str = ""
    templates: list[str] = prop(factory=list)


@response(description="who an API key is (its secret is never shown again)")
class KeyRef:
    id: str
    name: str
    admin: bool


@response(extra=True)
class Info:
    version: str
    preview_domain: str = ""
    session_domain: str = ""
    preview_url_template: str = prop(description="URL of a sandbox port, with {port} and {id}")
    session_url_template: str = prop("", description="URL of a session, with {name}")
    key: KeyRef | None = prop(omit=True, description="the key the request was made with")


# -- sessions --------------------------------------------------------------------------------

@response
class Session:
    name: str
    sandbox_id: str | None
    state: str
    port: int
    start: str | None = None
    start_state: Literal["none", "starting", "started", "failed"] = "none"
    start_pid: int | None = None
    start_error: str | None = None
    metadata: dict[str, Any] | None = prop(omit=True, schema=_METADATA)
    created_at: float = 0.0
    url: str
    proxy_path: str = ""
    preview_token: str | None = None


@response
class SessionList:
    sessions: list[Session]


# -- keys (gateway.http.key_routes, gateway.tenancy.quotas); 0 = no limit --------------------------

LIMITS_DOC = {
    "max_sandboxes": "sandboxes the key may have (any state)",
    "max_awake": "of those holding a VM at once (creating, running, paused, restoring, "
                 "suspending)",
    "max_disk_mib": "sum of the key's sandbox directories on disk, checked at create",
    "rate": "API requests per second (token bucket)", "burst": "bucket size",
    "max_vcpus": "vcpus one sandbox may ask for (also capped per template)",
    "max_memory_mib": "memory_mib one sandbox may ask for (also capped per template)",
    "max_sandbox_disk_mib": "disk_mib one sandbox may ask for (also capped per template)"}


def _limit(name: str, omit: bool) -> Any:
    minimum = 1 if name == "burst" else 0
    return prop(None, omit=omit, description=LIMITS_DOC[name], minimum=minimum)


@response(extra=False, description="effective limits (a key's overrides: only the ones it "
                                   "sets); 0 = no limit")
class KeyLimits:
    max_sandboxes: int | None = _limit("max_sandboxes", True)
    max_awake: int | None = _limit("max_awake", True)
    max_disk_mib: int | None = _limit("max_disk_mib", True)
    rate: float | None = _limit("rate", True)
    burst: int | None = _limit("burst", True)
    max_vcpus: int | None = _limit("max_vcpus", True)
    max_memory_mib: int | None = _limit("max_memory_mib", True)
    max_sandbox_disk_mib: int | None = _limit("max_sandbox_disk_mib", True)


@response
class Key:
    id: str
    name: str
    admin: bool
    created_at: float = 0.0
    revoked: bool = False
    limits: KeyLimits
    overrides: KeyLimits = prop(factory=KeyLimits, description="this key's own values")


@response
class CreatedKey(Key):
    key: str = prop(description="the secret, shown only once")


@response
class KeyList:
    keys: list[Key]


# -- interpreter and commands (the guest's answers, listed by the gateway) ------------------

@response(extra=True, description="a MIME bundle; is_main_result marks the last expression")
class Result:
    is_main_result: bool
    text_plain: str | None = prop(omit=True, name="text/plain")
    text_html: str | None = prop(omit=True, name="text/html")
    image_png: str | None = prop(omit=True, name="image/png", contentEncoding="base64")
    application_json: Any = prop(None, omit=True, name="application/json")


@response
class ContextList:
    contexts: list[p.ContextInfo]


@response
class PortList:
    ports: list[p.PortInfo]


@response
class ProcessList:
    commands: list[p.ProcessInfo]


@response(description="one NDJSON line of a command's output (reattach from next_offset)")
class OutputEvent:
    type: Literal["start", "stdout", "stderr", "dropped", "exit"]
    pid: int | None = prop(omit=True)
    data: str | None = prop(omit=True)
    offset: int | None = prop(omit=True)
    next_offset: int | None = prop(omit=True)
    exit_code: int | None = None
    timed_out: bool | None = prop(omit=True)


@response(description="one NDJSON line of a streamed run_code")
class RunEvent:
    type: Literal["stdout", "stderr", "result", "error", "end"]
    data: str | None = prop(omit=True)
    result: Result | None = prop(omit=True)
    error: p.ExecutionError | None = prop(omit=True)
    execution_count: int | None = prop(omit=True)
    duration_ms: float | None = prop(omit=True)
    files: list[p.OutputFile] | None = prop(omit=True, description="on `end`: files the run "
                                            "created or changed under /output/")


# -- request bodies --------------------------------------------------------------------------

_IDLE = dict(minimum=0, description="seconds without activity before the sandbox is "
                                    "suspended; 0 = never",
             message="a number of seconds >= 0 (0 = never)")
_TTL = dict(minimum=0, maximum=MAX_SECONDS, message=f"a number of seconds from 0 to "
            f"{MAX_SECONDS:g} (0 = never)", description="destroy this many seconds after "
            "create (PATCH: from now); 0 = never; default: the server's [sandbox] ttl")
_AUTO_DELETE = dict(_TTL, description="destroy after this many seconds suspended or failed; "
                                      "0 = never")
_EGRESS_DOC = ("egress policy: deny wins over allow, default for the rest; domain rules act at "
               "the sandbox's resolver (docs/security.md)")
_SHAPE = dict(code="invalid_type", message="an integer", range_code="invalid_resources")
_PORTS = dict(maxItems=64, items={"minimum": 1, "maximum": 65535},
              message="a list of up to 64 port numbers (1-65535)")


@request(code="invalid_egress")
class EgressRules:
    default: Literal["deny", "allow"] | None = prop(omit=True)
    allow: list[str] | None = prop(omit=True, **_RULES)
    deny: list[str] | None = prop(omit=True, **_RULES)


EgressIn = Literal["deny_all", "allow_all"] | EgressRules


@request
class CreateSandboxRequest:
    template: str | None = prop(None, description="default: the server's default",
                                minLength=1)
    environment: str | None = prop(None, description="alias of template", minLength=1)
    metadata: dict[str, Any] | None = prop(None, schema=_METADATA)
    idle_timeout: float | None = prop(None, **_IDLE)
    egress: EgressIn | None = prop(omit=True, description=_EGRESS_DOC, code="invalid_egress")
    ttl: float | None = prop(None, **_TTL)
    auto_delete_after: float | None = prop(None, **_AUTO_DELETE)
    vcpus: int | None = prop(None, minimum=1, **_SHAPE, description=(
        "virtual CPUs (default: the server's [vm] vcpus); a new (vcpus, memory_mib) waits for "
        "its golden snapshot"))
    memory_mib: int | None = prop(None, minimum=64, **_SHAPE,
                                  description="guest RAM in MiB (default: the template's)")
    disk_mib: int | None = prop(None, minimum=1, **_SHAPE, description=(
        "root disk size in MiB the guest sees (default and minimum: the template's; sparse on "
        "the host)"))


@request
class UpdateSandboxRequest:
    metadata: dict[str, Any] | None = prop(None, schema=_METADATA)
    idle_timeout: float | None = prop(None, **_IDLE)
    ttl: float | None = prop(None, **_TTL)
    auto_delete_after: float | None = prop(None, **_AUTO_DELETE)
    public_ports: list[int] | None = prop(omit=True, description="ports served without the "
                                          "preview token (replaces the list)", **_PORTS)
    egress: EgressIn | None = prop(omit=True, description=_EGRESS_DOC, code="invalid_egress")


@request
class UpdatePreviewRequest:
    public_ports: list[int] = prop(description="ports served without a token", **_PORTS)


@request
class SnapshotRequest:
    template: str = prop(pattern="^[a-z0-9][a-z0-9._-]{0,62}$", description=(
        "the new template's name (the key's own; not a built-in's)"), code="bad_template_name",
        message="1-63 characters of [a-z0-9._-], starting with a letter or digit")


@request
class ForkRequest:
    count: int = prop(1, minimum=1, maximum=8)


@request
class SessionSpec:
    template: str | None = prop(None, minLength=1, message="a non-empty string")
    port: int = prop(8000, minimum=1, maximum=65535, description="the app's port",
                     message="a port number (1-65535)")
    idle_timeout: float | None = prop(None, **_IDLE)
    metadata: dict[str, Any] | None = prop(None, schema=_METADATA)
    start: str | None = prop(None, description="shell command started once, in the "
                                                "background, when the sandbox is made",
                             pattern=r"\S", message="a non-empty shell command")


@request(description="null = back to the default")
class KeyLimitsUpdate:
    max_sandboxes: int | None = _limit("max_sandboxes", False)
    max_awake: int | None = _limit("max_awake", False)
    max_disk_mib: int | None = _limit("max_disk_mib", False)
    rate: float | None = _limit("rate", False)
    burst: int | None = _limit("burst", False)
    max_vcpus: int | None = _limit("max_vcpus", False)
    max_memory_mib: int | None = _limit("max_memory_mib", False)
    max_sandbox_disk_mib: int | None = _limit("max_sandbox_disk_mib", False)


@request
class CreateKeyRequest:
    name: str = prop(minLength=1, maxLength=200, pattern=r"\S", code="invalid_type",
                     required_code="bad_request",
                     message="a non-empty string of at most 200 characters")
    admin: bool = prop(False, code="invalid_type", message="a JSON boolean (true or false)")
    limits: KeyLimitsUpdate | None = prop(omit=True, code="invalid_type")


@request
class UpdateKeyRequest:
    limits: KeyLimitsUpdate | None = prop(omit=True, code="invalid_type")


# Every gateway schema of the document, in its order.
SCHEMAS: tuple[type, ...] = (
    Error, ErrorDetail, Sandbox, Egress, SandboxList, SandboxUsage, KeyUsage, Usage,
    SandboxMetrics, SandboxEvent, TransitionEvent, SandboxLogs, CreateSandboxRequest, EgressRules,
    UpdateSandboxRequest, Template, TemplateProgress, Build, BuildResponse, BuildEvent,
    TemplateList, SnapshotRequest, ForkRequest, Health, KeyRef, Info, Preview, UpdatePreviewRequest,
    SessionSpec, Session, SessionList, KeyLimits, KeyLimitsUpdate, CreateKeyRequest,
    UpdateKeyRequest, Key, KeyList, CreatedKey, Result, ContextList, PortList, ProcessList,
    OutputEvent, RunEvent)
