"""Errors raised by the guest agent.

Each carries a stable ``code`` and the HTTP ``status`` it becomes; ``agent.py``
turns them into ``protocol.error_body`` responses in one place. OS errors are
mapped at the file-system edge by :func:`from_os_error`.
"""

from __future__ import annotations

import errno


class AgentError(Exception):
    code = "internal"
    status = 500


class BadRequest(AgentError):
    code = "bad_request"
    status = 400


class BadJson(BadRequest):
    code = "bad_json"


class InvalidPath(BadRequest):
    code = "invalid_path"


class InvalidCwd(BadRequest):
    """The exec's working directory does not exist or is not a directory."""

    code = "invalid_cwd"


class NotADirectory(BadRequest):
    code = "not_a_directory"


class IsADirectory(BadRequest):
    code = "is_a_directory"


class NotFound(AgentError):
    code = "not_found"
    status = 404


class NoSpace(AgentError):
    code = "no_space"
    status = 507


class ClientGone(AgentError):
    """The client closed the connection before the answer was ready (nobody reads this)."""

    code = "client_closed"
    status = 499


class ResponseStarted(Exception):
    """A failure after the response began: the connection is dropped, never answered twice."""


_BY_ERRNO: dict[int, type[AgentError]] = {
    errno.ENOENT: NotFound,
    errno.ENOTDIR: NotADirectory,
    errno.EISDIR: IsADirectory,
    errno.ENOSPC: NoSpace,
    errno.EDQUOT: NoSpace,
    errno.ENAMETOOLONG: InvalidPath,
    errno.ELOOP: InvalidPath,
}


def from_os_error(exc: OSError, path: str) -> AgentError:
    """Our error for an OSError met while working on ``path`` (500 ``internal`` if unknown)."""
    cls = _BY_ERRNO.get(exc.errno or 0, AgentError)
    return cls(f"{path}: {exc.strerror or exc}")
