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

Code interpreter (stateful Python contexts; ``guest/interpreter.py``):

  POST   /contexts            CreateContextRequest -> ContextInfo
  GET    /contexts            -> {"contexts": [ContextInfo]}
  DELETE /contexts/{name}     -> 204
  POST   /run_code            RunCodeRequest -> Execution, or with ``stream`` NDJSON lines:
                              {"type": "stdout"|"stderr", "data"}, {"type": "result", "result"},
                              {"type": "error", "error": ExecutionError}, then
                              {"type": "end", "execution_count", "duration_ms", "files"}

Commands (background processes with reattachable output; ``guest/processes.py``):

  POST   /commands            CommandRequest -> ProcessInfo (background), or NDJSON
                              {"type": "start", "pid"} + output lines (foreground)
  GET    /commands            -> {"commands": [ProcessInfo]}
  GET    /commands/{pid}      -> ProcessInfo
  POST   /commands/{pid}/stdin   <- raw bytes (``?eof=1`` closes stdin after them) -> 204
  POST   /commands/{pid}/signal  SignalRequest -> 204
  GET    /commands/{pid}/wait?timeout=S   -> ProcessInfo (``running`` is true if S passed)
  GET    /commands/{pid}/output?offset=N&follow=1  -> NDJSON output lines:
                              {"type": "stdout"|"stderr", "data", "offset", "next_offset"},
                              {"type": "dropped", "offset", "next_offset"} (ring overwritten),
                              {"type": "exit", "exit_code", "offset"} (once finished)

Terminals (``guest/terminal.py``):

  GET    /pty?cols=C&rows=R&cmd=CMD  -> WebSocket. Binary frames both ways are raw bytes
                              (keyboard in, terminal output out); client text frames are JSON
                              TerminalResize {"type": "resize", "cols", "rows"}. When the shell
                              exits: text frame {"type": "exit", "exit_code"}, then close 1000.
                              A client that closes hangs the shell up (SIGHUP, then SIGKILL).

Ports (``guest/ports.py``):

  GET    /ports               -> {"ports": [PortInfo]}   (listening TCP ports)
  POST   /ports/{port}/expose -> PortExposure   (forward GUEST_ADDR:port to a loopback-only
                              listener; 404 ``port_not_listening`` if nothing listens)
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
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


def query_number(query: Mapping[str, str], name: str, default: float, maximum: float) -> float:
    """A numeric query parameter in [0, maximum] (both ends parse ?timeout= / ?offset= alike)."""
    raw = query.get(name)
    try:
        value = default if raw is None else float(raw)
    except ValueError as exc:
        raise ProtocolError(f"'{name}' must be a number") from exc
    if not 0 <= value <= maximum:
        raise ProtocolError(f"'{name}' must be between 0 and {maximum:g}")
    return value


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
class OutputFile:
    """A file under /output/ that a run created or changed (guest/outputs.py)."""

    path: str
    size: int

    @classmethod
    def from_dict(cls, data: object) -> OutputFile:
        return _from_dict(cls, data)

    @classmethod
    def list_from(cls, data: object) -> list[OutputFile]:
        if not isinstance(data, list):
            raise ProtocolError("'files' must be a list")
        return [f if isinstance(f, OutputFile) else cls.from_dict(f) for f in data]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False
    # Files the run created or changed under /output/ (guest/outputs.py).
    files: list[OutputFile] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: object) -> ExecResult:
        if isinstance(data, dict) and "files" in data:
            data = {**data, "files": OutputFile.list_from(data["files"])}
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
    # Set on a sandbox's first start only: its own identity (a clone of a snapshot would
    # otherwise keep its source's). "" = leave as is.
    hostname: str = ""
    machine_id: str = ""

    @classmethod
    def from_dict(cls, data: object) -> InitRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        # Identity fields only when set: an older agent (a sandbox made from an older build)
        # refuses fields it does not know.
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v or k not in ("hostname", "machine_id")}


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


# -- code interpreter ---------------------------------------------------------------

DEFAULT_CONTEXT = "default"
INTERPRETER_LANGUAGES = ("python",)
MAX_CONTEXT_NAME = 64
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def validate_context_name(name: object) -> str:
    """Context names are 1-64 characters of ``[A-Za-z0-9_.-]`` (they appear in URLs)."""
    if not isinstance(name, str) or not name or len(name) > MAX_CONTEXT_NAME:
        raise ProtocolError(f"context name must be 1-{MAX_CONTEXT_NAME} characters")
    if not set(name) <= _NAME_CHARS or name in (".", ".."):
        raise ProtocolError(f"context name may hold only letters, digits, '_', '.', '-': {name!r}")
    return name


def _check_env(env: object) -> None:
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ProtocolError("'env' must map strings to strings")


def _check_timeout(timeout: object, optional: bool = False) -> None:
    if optional and timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ProtocolError("'timeout' must be a number of seconds")
    if not 0 < timeout <= 24 * 3600:
        raise ProtocolError("'timeout' must be > 0 and <= 86400 seconds")


@dataclass(frozen=True)
class CreateContextRequest:
    """A new interpreter context: its own python3 process, globals, cwd and env."""

    name: str | None = None  # None: the agent picks one ("ctx-<hex>")
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name is not None:
            validate_context_name(self.name)
        if self.cwd is not None:
            validate_path(self.cwd)
        _check_env(self.env)

    @classmethod
    def from_dict(cls, data: object) -> CreateContextRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ContextInfo:
    name: str
    language: str
    cwd: str
    pid: int | None  # None until the context's process is (re)started by its next run
    running: bool  # a run is executing in it now
    execution_count: int
    created_at: float  # wall clock, seconds

    @classmethod
    def from_dict(cls, data: object) -> ContextInfo:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunCodeRequest:
    """Run ``code`` in a context; ``env`` applies to this run only."""

    code: str
    context: str = DEFAULT_CONTEXT
    language: str = "python"
    timeout: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    stream: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.code, str):
            raise ProtocolError("'code' must be a string")
        validate_context_name(self.context)
        if self.language not in INTERPRETER_LANGUAGES:
            raise ProtocolError(
                f"unsupported language {self.language!r}; one of {INTERPRETER_LANGUAGES}"
            )
        _check_timeout(self.timeout)
        _check_env(self.env)
        if not isinstance(self.stream, bool):
            raise ProtocolError("'stream' must be a boolean")

    @classmethod
    def from_dict(cls, data: object) -> RunCodeRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ExecutionError:
    name: str  # the exception's class name, e.g. "ZeroDivisionError"
    value: str  # str(exception)
    traceback: str  # formatted, as Python prints it

    @classmethod
    def from_dict(cls, data: object) -> ExecutionError:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Execution:
    """The outcome of one run.

    ``results`` are MIME bundles in display order: each maps MIME types
    ("text/plain", "text/html", "image/png" (base64), "image/svg+xml",
    "application/json" (the value itself), ...) to data, plus ``is_main_result``
    (true for the value of the code's last expression).
    """

    stdout: str
    stderr: str
    results: list[dict[str, Any]]
    error: ExecutionError | None
    execution_count: int
    duration_ms: float
    truncated: bool = False  # stdout or stderr passed MAX_OUTPUT_BYTES
    files: list[OutputFile] = field(default_factory=list)  # as ExecResult.files

    @classmethod
    def from_dict(cls, data: object) -> Execution:
        if not isinstance(data, dict):
            raise ProtocolError("Execution must be a JSON object")
        err = data.get("error")
        data = {**data, "error": None if err is None else ExecutionError.from_dict(err)}
        if "files" in data:
            data["files"] = OutputFile.list_from(data["files"])
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- commands -------------------------------------------------------------------------

# Per process, this many bytes of output (stdout and stderr interleaved) are kept for reattach.
OUTPUT_RING_BYTES = 4 * 1024 * 1024
SIGNALS = ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
           "SIGSTOP", "SIGCONT", "SIGWINCH")


@dataclass(frozen=True)
class CommandRequest:
    """Start ``command`` under the shell. ``background``: answer at once with its
    ProcessInfo; otherwise stream its output and kill it if the client leaves.
    ``stdin``: keep a pipe open for ``POST /commands/{pid}/stdin`` (else /dev/null).
    ``timeout``: SIGKILL the process group after this many seconds (None: never)."""

    command: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    background: bool = True
    stdin: bool = False
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command:
            raise ProtocolError("'command' must be a non-empty string")
        _check_env(self.env)
        if self.cwd is not None:
            validate_path(self.cwd)
        if not isinstance(self.background, bool) or not isinstance(self.stdin, bool):
            raise ProtocolError("'background' and 'stdin' must be booleans")
        _check_timeout(self.timeout, optional=True)

    @classmethod
    def from_dict(cls, data: object) -> CommandRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    command: str
    cwd: str
    background: bool
    stdin: bool  # its stdin pipe is still open for writing
    running: bool
    exit_code: int | None  # -N when killed by signal N
    started_at: float  # wall clock, seconds
    finished_at: float | None
    timed_out: bool
    output_bytes: int  # absolute offset of the end of its output so far

    @classmethod
    def from_dict(cls, data: object) -> ProcessInfo:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SignalRequest:
    """Send ``signal`` (a name from SIGNALS, or its number) to the process's group
    (``group``, the default: the whole tree it started) or to the process alone."""

    signal: str | int = "SIGTERM"
    group: bool = True

    def __post_init__(self) -> None:
        sig = self.signal
        if isinstance(sig, bool) or not isinstance(sig, (str, int)):
            raise ProtocolError("'signal' must be a signal name or number")
        if isinstance(sig, str) and sig.upper() not in SIGNALS:
            raise ProtocolError(f"unsupported signal {sig!r}; one of {SIGNALS}")
        if isinstance(sig, int) and not 1 <= sig <= 64:
            raise ProtocolError("'signal' number must be 1-64")
        if not isinstance(self.group, bool):
            raise ProtocolError("'group' must be a boolean")

    @classmethod
    def from_dict(cls, data: object) -> SignalRequest:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- terminals and ports ------------------------------------------------------------------

DEFAULT_COLS = 80
DEFAULT_ROWS = 24
MAX_TERMINAL_SIZE = 10000  # columns or rows (the kernel's winsize holds 16 bits)


def validate_terminal_size(cols: object, rows: object) -> tuple[int, int]:
    """``(cols, rows)`` as ints, each 1-MAX_TERMINAL_SIZE, or ProtocolError."""
    for name, value in (("cols", cols), ("rows", rows)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"'{name}' must be an integer")
        if not 1 <= value <= MAX_TERMINAL_SIZE:
            raise ProtocolError(f"'{name}' must be between 1 and {MAX_TERMINAL_SIZE}")
    return cols, rows  # type: ignore[return-value]


@dataclass(frozen=True)
class TerminalResize:
    """A client's control message on a terminal WebSocket (a JSON text frame)."""

    cols: int
    rows: int
    type: str = "resize"

    def __post_init__(self) -> None:
        if self.type != "resize":
            raise ProtocolError(f"unknown terminal message type {self.type!r}")
        validate_terminal_size(self.cols, self.rows)

    @classmethod
    def from_dict(cls, data: object) -> TerminalResize:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def terminal_exit(exit_code: int) -> dict[str, Any]:
    """The last text frame on a terminal WebSocket (``exit_code`` is -N for signal N)."""
    return {"type": "exit", "exit_code": exit_code}


def validate_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ProtocolError("port must be an integer between 1 and 65535")
    return port


@dataclass(frozen=True)
class PortInfo:
    """A TCP port something listens on in the guest. ``addresses``: the user's sockets'
    bind addresses (``0.0.0.0``/``::`` for all); ``forwarded``: the agent forwards
    GUEST_ADDR:port to it (``POST /ports/{port}/expose``)."""

    port: int
    addresses: list[str]
    forwarded: bool = False

    @classmethod
    def from_dict(cls, data: object) -> PortInfo:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PortExposure:
    """The answer to an expose: ``listening`` (something accepts on the port) and
    ``forwarded`` (reachable through the agent's forwarder; false when the listener
    already accepts on GUEST_ADDR or every address)."""

    port: int
    forwarded: bool
    listening: bool

    @classmethod
    def from_dict(cls, data: object) -> PortExposure:
        return _from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
