"""API errors: each class carries its HTTP status and a stable machine-readable
``code``. ``gateway.http.middleware`` turns them (and vmctl's errors, which carry the
same two attributes) into ``{"error": {"code", "message"}}`` responses."""

from __future__ import annotations


class ApiError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.headers = headers or {}


class BadRequest(ApiError):
    status = 400
    code = "bad_request"


class Unauthorized(ApiError):
    status = 401
    code = "unauthorized"


class Forbidden(ApiError):
    status = 403
    code = "forbidden"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class PayloadTooLarge(ApiError):
    status = 413
    code = "payload_too_large"


class Unavailable(ApiError):
    status = 503
    code = "unavailable"


class HostFenced(Unavailable):
    """This host lost its cluster lease: it serves none of its sandboxes until it rejoins
    (gateway.cluster.routing)."""

    code = "host_fenced"


class OwnerUnavailable(Unavailable):
    """The sandbox's owner (another host) is not live or cannot be reached."""

    code = "owner_unavailable"


class SandboxMoved(OwnerUnavailable):
    """The sandbox was moved to another host (a drain) while this request waited for it:
    the routing middleware forwards the request to ``host``; a client only sees this (503,
    retry) where no forwarding is possible."""

    def __init__(self, sandbox_id: str, host: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} moved to host {host!r}; retry",
                         headers={"Retry-After": "1"})
        self.host = host


class ForwardLoop(ApiError):
    """A forwarded request would be forwarded again: the hosts' route caches disagree."""

    status = 508
    code = "forward_loop"


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found")


class TemplateNotFound(NotFound):
    code = "template_not_found"


class SandboxLost(ApiError):
    """The sandbox is FAILED with nothing left to boot (no disk: its host died before any
    of it was shipped, or its disk is gone). Only its deletion helps (docs/cluster.md)."""

    status = 410
    code = "sandbox_lost"


class QuotaExceeded(Conflict):
    """A key's quota (gateway.tenancy.quotas): the tenant can delete or suspend, then retry."""

    code = "quota_exceeded"


class RateLimited(ApiError):
    """A token bucket is empty (gateway.tenancy.ratelimit); carries Retry-After."""

    status = 429
    code = "rate_limited"


# Every ``code`` an error answer of this server can carry, with what it means. The codes are
# raised where their causes are (the classes above, ``vmctl.errors``, ``guest.errors``, which the
# gateway passes through, and the middlewares); this is their one list. The OpenAPI document
# exports it (``components.schemas.ErrorCode``), tests/unit/test_error_codes.py checks it
# against every code literal in gateway/, vmctl/ and guest/ both ways, and that the SDK
# (``agentbox.exceptions``) maps each and no other.
ERROR_CODES: dict[str, str] = {
    # 400: the request itself
    "bad_request": "a malformed or invalid request",
    "bad_json": "the body is not the JSON object expected",
    "invalid_type": "a field has the wrong JSON type",
    "invalid_path": "a file path is not absolute or not allowed",
    "invalid_cwd": "the working directory does not exist in the sandbox",
    "invalid_egress": "an egress policy is malformed or opens what this host does not allow",
    "not_a_directory": "a path that must be a directory is not one",
    "is_a_directory": "a path that must be a file is a directory",
    "bad_session_name": "a session name is not a DNS label",
    "websocket_required": "the endpoint is a WebSocket: send an Upgrade",
    "invalid_resources": "vcpus, memory_mib or disk_mib is not possible (see the message)",
    "bad_template_name": "a template name is not 1-63 characters of [a-z0-9._-]",
    "bad_dockerfile": "the Dockerfile is outside the supported subset (the message names the line)",
    "bad_context": "the build context is not a usable tar",
    "http_error": "any other HTTP error from the web framework",
    # 401/403: who is asking
    "unauthorized": "not authenticated",
    "missing_api_key": "no 'Authorization: Bearer KEY' header",
    "invalid_api_key": "the API key is unknown or revoked",
    "forbidden": "the key may not do this (admin only)",
    "cross_origin_refused": "a browser request from another origin",
    "port_reserved": "the preview port is reserved (the guest agent's own)",
    "resource_limit": "vcpus, memory_mib or disk_mib is over the template's or key's limit",
    # 404: what is asked for
    "not_found": "the object or file does not exist",
    "no_route": "no route matches the request's path",
    "sandbox_not_found": "no such sandbox (for this key)",
    "build_not_found": "no such template build (for this key)",
    "template_not_found": "no such template",
    "context_not_found": "no such interpreter context",
    "process_not_found": "no such background process",
    "session_not_found": "no such named session",
    "key_not_found": "no such API key",
    "method_not_allowed": "the route exists, not with this method (405)",
    # 410: what existed and is gone
    "sandbox_lost": "410: the sandbox failed with nothing left to boot (its host died "
                    "before its disk was shipped); see its failure, then delete it",
    # 409: the state
    "conflict": "the sandbox's state does not allow this",
    "build_running": "a build of that template name is already running for this key",
    "not_running": "the sandbox or process is not running",
    "stdin_closed": "the process's stdin was already closed",
    "context_exists": "an interpreter context of that name exists",
    "session_name_taken": "another key's session has that name",
    "template_exists": "the key has a template of that name, or it is a built-in's",
    "template_builtin": "built-in templates cannot be deleted",
    "session_not_ready": "the session's sandbox is not ready yet",
    "suspend_cancelled": "a request arrived while suspending; the sandbox stays up",
    "quota_exceeded": "a key's quota (max_sandboxes, max_awake, max_disk_mib)",
    # 413, 429: sizes and rates
    "payload_too_large": "the body is over the server's limit",
    "too_large": "the body is over the guest agent's limit",
    "rate_limited": "the key's request rate; see Retry-After",
    "too_many_requests": "the guest agent refused: too many at once",
    "too_many_contexts": "too many interpreter contexts in the sandbox",
    "too_many_processes": "too many background processes in the sandbox",
    # 499: the client went away (logged; a client never reads it)
    "client_closed": "the client closed the connection",
    # 500: the server
    "internal": "an unexpected server error (the message has a request id)",
    # 502/503/504/507: the sandbox's VM, guest agent, or the host
    "vm_error": "the VM failed",
    "vm_start_failed": "the VMM did not start",
    "vm_gone": "the VMM exited",
    "vmm_protocol_error": "the VMM's control socket answered nonsense",
    "vm_timeout": "the VM did not answer in time",
    "agent_unreachable": "the guest agent cannot be reached",
    "agent_error": "the guest agent failed without an error body",
    "agent_protocol_error": "the guest agent's reply broke the protocol (headers, not JSON)",
    "agent_reply_too_large": "the guest agent's reply was over its cap",
    "agent_timeout": "the guest agent did not finish its reply in time",
    "snapshot_invalid": "a snapshot failed verification",
    "restore_failed": "waking the sandbox failed",
    "wake_timeout": "waking the sandbox took too long",
    "sandbox_crashed": "the sandbox's VM crashed",
    "image_error": "the template's image is missing or broken",
    "disk_error": "the sandbox's disk could not be prepared",
    "network_error": "the sandbox's network could not be set up",
    "context_start_failed": "an interpreter context did not start",
    "forward_failed": "the guest could not forward to the port",
    "port_not_listening": "nothing listens on that port in the sandbox",
    "port_closed": "the sandbox's port closed the connection",
    "bad_gateway": "the sandbox's app answered nonsense",
    "upstream_timeout": "the sandbox's app did not answer in time",
    "hold_queue_full": "too many requests wait for this sandbox to wake",
    "sandbox_limit": "the host is at capacity",
    "template_building": "the template is still being built; see Retry-After",
    "template_build_failed": "the built-in template failed to build (see GET /v1/templates)",
    "builds_unavailable": "template builds are not available on this host",
    "unavailable": "the host is busy; see Retry-After",
    "no_space": "the sandbox's disk is full",
    # many hosts ([cluster], docs/cluster.md)
    "host_fenced": "this host lost its cluster lease; it serves no sandboxes until it rejoins",
    "owner_unavailable": "the sandbox's owner host is not live or cannot be reached; retry",
    "forward_loop": "508: a forwarded request would be forwarded again (route caches disagree)",
}
