"""Every error the SDK raises, in one module, in families by cause.

The server answers errors as ``{"error": {"code", "message"}}`` with a
meaningful status. :func:`from_response` turns such an answer into the most
specific class here: first by ``code`` (stable, machine-readable), then by
status. Failures below HTTP (connection refused, read timeouts) are mapped at
the transport edge into :class:`APIConnectionError` / :class:`TimeoutError`,
always chained (``raise ... from exc``), so callers never need to catch
``httpx`` exceptions.

``TimeoutError`` here also subclasses the built-in one, so ``except
TimeoutError`` works whichever of the two a caller imported.
"""

from __future__ import annotations

import builtins
from typing import Any


class AgentBoxError(Exception):
    """Base class of every AgentBox SDK error.

    ``status`` is the HTTP status (0 when no response was received), ``code``
    the server's stable error code, ``retry_after`` the server's hint in seconds.
    """

    status: int = 0
    code: str = "error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]" if self.status else self.message


# -- client side -----------------------------------------------------------------------------

class ConfigurationError(AgentBoxError):
    """The SDK is missing something it needs locally (e.g. no API key)."""

    code = "configuration"


class APIConnectionError(AgentBoxError):
    """The server could not be reached, or the connection broke."""

    code = "connection_error"


class StreamInterruptedError(APIConnectionError):
    """A streamed response ended before its final line (the connection broke)."""

    code = "stream_interrupted"


class ProtocolError(AgentBoxError):
    """The server answered something this SDK does not understand."""

    code = "protocol_error"


# -- answered by the server ------------------------------------------------------------------

class InvalidArgumentError(AgentBoxError):
    """400: the request was malformed or a value was out of range."""

    status = 400
    code = "bad_request"


class AuthenticationError(AgentBoxError):
    """401: the API key is missing or invalid."""

    status = 401
    code = "unauthorized"


class PermissionDeniedError(AgentBoxError):
    """403: the API key may not do this (e.g. minting keys needs an admin key)."""

    status = 403
    code = "forbidden"


class NotFoundError(AgentBoxError):
    """404: the object does not exist (or belongs to another tenant)."""

    status = 404
    code = "not_found"


class SandboxNotFoundError(NotFoundError):
    code = "sandbox_not_found"


class TemplateNotFoundError(NotFoundError):
    code = "template_not_found"


class ContextNotFoundError(NotFoundError):
    code = "context_not_found"


class ProcessNotFoundError(NotFoundError):
    code = "process_not_found"


class SessionNotFoundError(NotFoundError):
    code = "session_not_found"


class EndpointNotFoundError(NotFoundError):
    """404 for the route itself: this server does not offer the endpoint (an older
    version, or a feature not enabled)."""

    code = "no_route"


class ConflictError(AgentBoxError):
    """409: the object is in the wrong state for this (e.g. sandbox not running)."""

    status = 409
    code = "conflict"


class QuotaExceededError(ConflictError):
    """409 ``quota_exceeded``: the API key is at one of its limits (sandboxes, awake
    sandboxes, disk); delete or suspend a sandbox, then retry."""

    code = "quota_exceeded"


class PayloadTooLargeError(AgentBoxError):
    """413: an upload or request body is over the server's limit."""

    status = 413
    code = "payload_too_large"


class RateLimitError(AgentBoxError):
    """429: too many of something at once (contexts, processes), or too many requests
    (``rate_limited``: retry after ``retry_after`` seconds)."""

    status = 429
    code = "too_many_requests"


class ServerError(AgentBoxError):
    """500: the server failed unexpectedly (the message carries a request id)."""

    status = 500
    code = "internal"


class SandboxError(AgentBoxError):
    """502: the sandbox's VM or guest agent failed (crashed, unreachable, bad snapshot)."""

    status = 502
    code = "vm_error"


class UnavailableError(AgentBoxError):
    """503: the host is at capacity or busy; retry after ``retry_after`` seconds."""

    status = 503
    code = "unavailable"


class TimeoutError(AgentBoxError, builtins.TimeoutError):
    """504 from the server, or the SDK's own HTTP timeout expired."""

    status = 504
    code = "timeout"


class StorageFullError(SandboxError):
    """507: the sandbox's disk is full."""

    status = 507
    code = "no_space"


class TemplateBuildError(AgentBoxError):
    """A template build from a Dockerfile ended ``failed``; ``build`` is the TemplateBuild
    (``build.error`` names the step and its exit code)."""

    code = "build_failed"

    def __init__(self, build: Any) -> None:
        super().__init__(f"template build {build.id} ({build.name}) failed: {build.error}")
        self.build = build


SandboxTimeoutError = TimeoutError
RateLimitedError = RateLimitError

_BY_CODE: dict[str, type[AgentBoxError]] = {
    "sandbox_not_found": SandboxNotFoundError,
    "template_not_found": TemplateNotFoundError,
    "context_not_found": ContextNotFoundError,
    "process_not_found": ProcessNotFoundError,
    "session_not_found": SessionNotFoundError,
    "no_route": EndpointNotFoundError,
    "method_not_allowed": EndpointNotFoundError,
    "missing_api_key": AuthenticationError,
    "invalid_api_key": AuthenticationError,
    "no_space": StorageFullError,
    "vm_timeout": TimeoutError,
    "quota_exceeded": QuotaExceededError,
    "rate_limited": RateLimitError,
}

# The server's other codes (gateway.errors.ERROR_CODES), deliberately mapped by their HTTP
# status (``_BY_STATUS``): the code stays on the exception (``exc.code``). Every server code is
# in exactly one of the two tables and no other code is (tests/unit/test_error_codes.py).
_BY_STATUS_CODES = frozenset({
    "bad_request", "bad_json", "invalid_type", "invalid_path", "invalid_cwd", "invalid_egress",
    "not_a_directory",
    "is_a_directory", "bad_session_name", "bad_template_name", "bad_dockerfile",
    "bad_context", "build_not_found", "build_running", "template_building",
    "template_build_failed", "builds_unavailable", "websocket_required", "http_error",
    "unauthorized",
    "forbidden", "cross_origin_refused", "port_reserved", "not_found", "key_not_found",
    "invalid_resources", "resource_limit",
    "conflict", "not_running", "stdin_closed", "context_exists", "session_name_taken",
    "session_not_ready", "suspend_cancelled", "payload_too_large", "too_large",
    "too_many_requests", "too_many_contexts", "too_many_processes", "client_closed", "internal",
    "vm_error", "vm_start_failed", "vm_gone", "vmm_protocol_error", "agent_unreachable",
    "agent_error", "agent_protocol_error", "agent_reply_too_large", "agent_timeout",
    "snapshot_invalid", "restore_failed", "wake_timeout", "sandbox_crashed",
    "image_error", "disk_error", "network_error", "context_start_failed", "forward_failed",
    "port_not_listening", "port_closed", "bad_gateway", "upstream_timeout", "hold_queue_full",
    "sandbox_limit", "unavailable", "template_exists", "template_builtin",
    "host_fenced", "owner_unavailable", "forward_loop", "sandbox_lost",
})

_BY_STATUS: dict[int, type[AgentBoxError]] = {
    400: InvalidArgumentError, 401: AuthenticationError, 403: PermissionDeniedError,
    404: NotFoundError, 405: EndpointNotFoundError, 409: ConflictError, 410: SandboxError,
    413: PayloadTooLargeError, 429: RateLimitError, 500: ServerError, 502: SandboxError,
    503: UnavailableError, 504: TimeoutError, 507: StorageFullError, 508: UnavailableError,
}

# aiohttp's own 404 for an unmatched route, as the gateway's error middleware words it.
_NO_ROUTE_MESSAGES = ("Not Found",)


def error_class(status: int, code: str, message: str = "") -> type[AgentBoxError]:
    """The exception class for an error answer (by code, then by status family)."""
    if code == "not_found" and (message in _NO_ROUTE_MESSAGES or message.startswith("no route")):
        return EndpointNotFoundError
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if 400 <= status < 500:
        return InvalidArgumentError
    return ServerError if status < 502 else SandboxError


def from_response(status: int, body: Any, headers: Any = None) -> AgentBoxError:
    """Build the exception for an HTTP error answer; ``body`` is its parsed JSON (or
    anything else when the answer was not our JSON error shape)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        code, message = err["code"], str(err.get("message", ""))
    else:
        code, message = _BY_STATUS.get(status, ServerError).code, f"HTTP {status}"
        if isinstance(body, str) and body.strip():
            message = f"HTTP {status}: {body.strip()[:300]}"
    retry_after = _retry_after(headers)
    cls = error_class(status, code, message)
    return cls(message, status=status, code=code, retry_after=retry_after)


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


__all__ = [
    "APIConnectionError", "AgentBoxError", "AuthenticationError", "ConfigurationError",
    "ConflictError", "ContextNotFoundError", "EndpointNotFoundError", "InvalidArgumentError",
    "NotFoundError", "PayloadTooLargeError", "PermissionDeniedError", "ProcessNotFoundError",
    "ProtocolError", "QuotaExceededError", "RateLimitError", "RateLimitedError", "SandboxError",
    "SandboxNotFoundError", "SandboxTimeoutError", "ServerError", "SessionNotFoundError",
    "StorageFullError", "StreamInterruptedError", "TemplateNotFoundError", "TimeoutError",
    "UnavailableError", "error_class", "from_response",
]
