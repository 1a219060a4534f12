"""Wire protocol between the host (vmctl/gateway) and the guest agent.

This module is the single source of truth for how the two ends talk. It is
imported by the agent inside the VM (Debian's python3, stdlib only: no orjson,
no third-party imports here) and by the host. Both ends' tests use it.

Transport: HTTP/1.1 over TCP. The agent listens on ``AGENT_PORT`` on every
guest address; the host reaches it through the sandbox's network namespace
(TAP ``TAP_NAME`` holds ``TAP_ADDR``, the guest is ``GUEST_ADDR``; the same
fixed addresses in every VM, so clones of one snapshot all work).

Endpoints (all JSON unless noted; errors are ``{"error": {"code", "message"}}``):

  GET    /health              -> Health
  POST   /exec    ExecRequest -> ExecResult          (blocking; timeout kills the tree)
  GET    /files?path=P        -> file bytes (streamed, application/octet-stream)
                                 or, for a directory, DirListing (application/json)
  PUT    /files?path=P        <- raw bytes, streamed -> FileInfo   (atomic: temp + rename)
  GET    /files/stat?path=P   -> FileInfo
  DELETE /files?path=P        -> 204                 (a directory is removed recursively)
  POST   /init    InitRequest -> 204                 (after restore: clock, entropy, env)
"""

from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1

AGENT_PORT = 49983
TAP_NAME = "tap0"
TAP_ADDR = "169.254.0.22"
GUEST_ADDR = "169.254.0.21"
PREFIX_LEN = 30
GUEST_MAC = "06:00:ac:10:00:02"
# The TAP keeps one MAC in every namespace, so a restored guest's ARP cache stays valid.
TAP_MAC = "06:00:ac:10:00:01"

# Output of one exec beyond this many bytes per stream is dropped (flagged truncated).
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
LANGUAGES = ("python", "bash", "sh")


class ProtocolError(ValueError):
    """A message does not follow this protocol (maps to 400 on either end)."""


def validate_path(path: object) -> str:
    """Return the normalised absolute guest path or raise ProtocolError.

    Guest paths are absolute POSIX paths without NUL bytes and without ``..``
    segments (they would make "the same file" ambiguous in logs and ACLs).
    """
    if not isinstance(path, str) or not path:
        raise ProtocolError("path is required")
    if "\x00" in path:
        raise ProtocolError("path must not contain NUL bytes")
    if not path.startswith("/"):
        raise ProtocolError(f"path must be absolute: {path!r}")
    if ".." in path.split("/"):
        raise ProtocolError(f"path must not contain '..' segments: {path!r}")
    norm = posixpath.normpath(path)
    return "/" + norm.lstrip("/") if norm.startswith("//") else norm


def _from_dict(cls: type, data: object) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__} must be a JSON object")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ProtocolError(f"unknown field(s) for {cls.__name__}: {', '.join(sorted(unknown))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ProtocolError(str(exc)) from exc


@dataclass(frozen=True)
class ExecRequest:
    """Run a shell command (``command``) or a program in ``language`` (``code``)."""

    command: str | None = None
    code: str | None = None
    language: str = "python"
    timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None

    def __post_init__(self) -> None:
        if (self.command is None) == (self.code is None):
            raise ProtocolError("exactly one of 'command' or 'code' is required")
        if self.command is not None and not isinstance(self.command, str):
            raise ProtocolError("'command' must be a string")
        if self.code is not None and not isinstance(self.code, str):
            raise ProtocolError("'code' must be a string")
        if self.language not in LANGUAGES:
            raise ProtocolError(f"unsupported language {self.language!r}; one of {LANGUAGES}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise ProtocolError("'timeout' must be a number of seconds")
        if not 0 < self.timeout <= 24 * 3600:
            raise ProtocolError("'timeout' must be > 0 and <= 86400 seconds")
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ProtocolError("'env' must map strings to strings")
        if self.cwd is not None:
            validate_path(self.cwd)

    @classmethod
    def from_dict(cls, data: object) -> ExecRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False

    @classmethod
    def from_dict(cls, data: object) -> ExecResult:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FileInfo:
    path: str
    name: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float

    @classmethod
    def from_dict(cls, data: object) -> FileInfo:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DirListing:
    path: str
    entries: list[FileInfo]

    @classmethod
    def from_dict(cls, data: object) -> DirListing:
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ProtocolError("DirListing must be an object with 'entries'")
        entries = [FileInfo.from_dict(e) for e in data["entries"]]
        return cls(path=data.get("path", ""), entries=entries)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "entries": [e.to_dict() for e in self.entries]}


@dataclass(frozen=True)
class Health:
    status: str  # "ok"
    version: int
    running: int = 0  # commands still running in the guest (activity for idle detection)
    veto: int = 0  # suspend-veto refcount held by guest programs (agentbox-keepawake)

    @classmethod
    def from_dict(cls, data: object) -> Health:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class InitRequest:
    """Sent after a restore: set the wall clock, reseed the RNG, optionally add env vars."""

    time_ns: int
    entropy_hex: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: object) -> InitRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}
