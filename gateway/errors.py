"""API errors: each class carries its HTTP status and a stable machine-readable
``code``. ``gateway.middleware`` turns them (and vmctl's errors, which carry the
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


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found")


class TemplateNotFound(NotFound):
    code = "template_not_found"


class QuotaExceeded(Conflict):
    """A key's quota (gateway.quotas): the tenant can delete or suspend, then retry."""

    code = "quota_exceeded"


class RateLimited(ApiError):
    """A token bucket is empty (gateway.ratelimit); carries Retry-After."""

    status = 429
    code = "rate_limited"
