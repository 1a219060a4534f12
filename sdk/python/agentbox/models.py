"""The SDK's value types: what the API answers, parsed into frozen dataclasses.

Parsing is lenient about extra fields (a newer server may add some) and strict
about the ones we read: a missing one raises :class:`~agentbox.exceptions.ProtocolError`.
"""

from __future__ import annotations

import base64
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from agentbox.exceptions import ConfigurationError, NotFoundError, ProtocolError


def _get(data: Any, name: str, kind: str) -> Any:
    if not isinstance(data, dict) or name not in data:
        raise ProtocolError(f"{kind}: the server's answer has no {name!r} field")
    return data[name]


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the server last described it (``state``: creating, running, paused,
    suspending, suspended, restoring, failed, destroyed)."""

    id: str
    state: str
    template: str
    metadata: dict[str, Any] = field(default_factory=dict)
    idle_timeout: float | None = None
    created_at: float | None = None
    updated_at: float | None = None
    last_activity: float | None = None
    suspend_count: int = 0
    restore_count: int = 0
    last_suspend_ms: float | None = None
    last_restore_ms: float | None = None
    failure: str | None = None
    preview_token: str | None = None  # only from get/update (the owner's view), not list
    public_ports: list[int] = field(default_factory=list)
    preview_url_template: str | None = None
    expires_at: float | None = None  # Unix time its ttl ends (None: no ttl)
    auto_delete_after: float = 0.0  # seconds asleep before it is deleted (0 = never)
    delete_at: float | None = None  # asleep: when auto_delete_after ends
    # {"default": "deny"|"allow", "allow": [...], "deny": [...], "source": "sandbox"|"host"}
    egress: dict[str, Any] | None = None
    vcpus: int | None = None  # the shape (None: a sandbox made before shapes)
    memory_mib: int | None = None
    disk_mib: int | None = None

    @classmethod
    def from_dict(cls, data: Any) -> SandboxInfo:
        for name in ("id", "state", "template"):
            _get(data, name, "sandbox")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def sandbox_id(self) -> str:  # E2B's name for it
        return self.id


@dataclass(frozen=True)
class Template:
    """A template: ``owner`` "builtin" (every key's) or "tenant" (this key's own, made by
    ``sandbox.snapshot``, a fork or a Dockerfile build); ``state`` ready, building
    (``progress``: stage, elapsed_s, ...), failed (``error``) or deleting."""

    name: str
    mem_mib: int | None = None
    default: bool = False
    # Default shape and per-sandbox limits (0 = none); None from servers without shapes.
    vcpus: int | None = None
    disk_mib: int | None = None
    max_vcpus: int | None = None
    max_memory_mib: int | None = None
    max_disk_mib: int | None = None
    owner: str = "builtin"
    source: str = "builtin"
    state: str = "ready"
    progress: dict[str, Any] | None = None
    error: str | None = None
    created_at: float | None = None
    size_bytes: int = 0
    from_sandbox: str | None = None
    paused_ms: float | None = None  # from sandbox.snapshot(): how long the source was paused

    @classmethod
    def from_dict(cls, data: Any) -> Template:
        _get(data, "name", "template")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class OutputFile:
    """A file a run created or changed under ``/output/`` (download it with
    ``sandbox.download(path)``)."""

    path: str
    size: int

    @classmethod
    def from_dict(cls, data: Any) -> OutputFile:
        return cls(path=str(_get(data, "path", "output file")),
                   size=int(_get(data, "size", "output file")))

    @classmethod
    def list_from(cls, items: Any) -> list[OutputFile]:
        return [cls.from_dict(f) for f in items or []]


@dataclass(frozen=True)
class TemplateBuild:
    """A build from a Dockerfile: ``state`` queued, running, ready or failed; ``step`` of
    ``steps`` (``cached_steps`` of them from the cache); ``template`` once ready."""

    id: str
    name: str
    state: str
    steps: int = 0
    step: int = 0
    cached_steps: int = 0
    error: str | None = None
    created_at: float | None = None
    finished_at: float | None = None
    template: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> TemplateBuild:
        _get(data, "id", "build")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class ServerInfo:
    """``GET /v1/info``; ``preview_url_template`` holds ``{port}`` and ``{id}``,
    ``session_url_template`` holds ``{name}``."""

    version: str | None = None
    preview_url_template: str | None = None
    session_url_template: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> ServerInfo:
        data = data if isinstance(data, dict) else {}
        return cls(version=data.get("version"),
                   preview_url_template=data.get("preview_url_template"),
                   session_url_template=data.get("session_url_template"), raw=dict(data))


@dataclass(frozen=True)
class PreviewAccess:
    """Who may open a sandbox's preview URLs: its ``preview_token`` (``pv_...``) opens
    every port; ``public_ports`` need no token."""

    preview_token: str
    public_ports: list[int] = field(default_factory=list)
    preview_url_template: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> PreviewAccess:
        return cls(preview_token=str(_get(data, "preview_token", "preview")),
                   public_ports=[int(p) for p in data.get("public_ports") or []],
                   preview_url_template=data.get("preview_url_template"))


@dataclass(frozen=True)
class FileInfo:
    path: str
    name: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float

    @classmethod
    def from_dict(cls, data: Any) -> FileInfo:
        return cls(**{f.name: _get(data, f.name, "file info") for f in dataclasses.fields(cls)})

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"


@dataclass(frozen=True)
class ExecutionError:
    """An exception raised by the code that ran: ``name`` (its class), ``value``
    (``str(exc)``) and the formatted ``traceback``."""

    name: str
    value: str
    traceback: str

    @classmethod
    def from_dict(cls, data: Any) -> ExecutionError:
        return cls(name=str(_get(data, "name", "error")), value=str(data.get("value", "")),
                   traceback=str(data.get("traceback", "")))

    def __str__(self) -> str:
        return f"{self.name}: {self.value}" if self.value else self.name


@dataclass(frozen=True)
class Result:
    """One rich result of a run: a MIME bundle (``data``) in display order.

    Properties give each format: ``text`` (text/plain), ``html``, ``markdown``,
    ``svg``, ``png``/``jpeg`` (base64 strings, as E2B), ``json``, ``latex``.
    ``is_main_result`` is true for the value of the code's last expression.
    """

    data: dict[str, Any]
    is_main_result: bool = False

    @classmethod
    def from_dict(cls, data: Any) -> Result:
        if not isinstance(data, dict):
            raise ProtocolError("result: expected a MIME bundle object")
        bundle = {k: v for k, v in data.items() if k != "is_main_result"}
        return cls(data=bundle, is_main_result=bool(data.get("is_main_result", False)))

    def _fmt(self, mime: str) -> Any:
        return self.data.get(mime)

    text = property(lambda self: self._fmt("text/plain"))
    html = property(lambda self: self._fmt("text/html"))
    markdown = property(lambda self: self._fmt("text/markdown"))
    svg = property(lambda self: self._fmt("image/svg+xml"))
    png = property(lambda self: self._fmt("image/png"))
    jpeg = property(lambda self: self._fmt("image/jpeg"))
    json = property(lambda self: self._fmt("application/json"))
    latex = property(lambda self: self._fmt("text/latex"))

    def formats(self) -> list[str]:
        """The MIME types this result carries."""
        return list(self.data)

    def image_bytes(self) -> bytes | None:
        """The decoded PNG (or JPEG) image, if this result is one."""
        b64 = self.png or self.jpeg
        return base64.b64decode(b64) if b64 else None

    def __str__(self) -> str:
        return str(self.text if self.text is not None else next(iter(self.formats()), ""))


@dataclass(frozen=True)
class Execution:
    """The outcome of ``run_code``: output, rich results, the error if the code raised."""

    stdout: str = ""
    stderr: str = ""
    results: list[Result] = field(default_factory=list)
    error: ExecutionError | None = None
    execution_count: int | None = None
    duration_ms: float | None = None
    truncated: bool = False
    files: list[OutputFile] = field(default_factory=list)  # written under /output/

    @classmethod
    def from_dict(cls, data: Any) -> Execution:
        err = _get(data, "error", "execution")
        return cls(stdout=str(data.get("stdout", "")), stderr=str(data.get("stderr", "")),
                   results=[Result.from_dict(r) for r in data.get("results") or []],
                   error=None if err is None else ExecutionError.from_dict(err),
                   execution_count=data.get("execution_count"),
                   duration_ms=data.get("duration_ms"), truncated=bool(data.get("truncated")),
                   files=OutputFile.list_from(data.get("files")))

    @property
    def text(self) -> str | None:
        """text/plain of the main result (the value of the last expression), if any."""
        main = next((r for r in self.results if r.is_main_result), None)
        return None if main is None else main.text

    @property
    def logs(self) -> dict[str, str]:
        return {"stdout": self.stdout, "stderr": self.stderr}


# Python's last traceback line: "ZeroDivisionError: division by zero" (dotted names allowed).
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|"
                       r"StopIteration))(?::\s?(.*))?$")


@dataclass(frozen=True)
class ExecResult:
    """The outcome of ``execute``: a program or shell command run to completion.

    ``files``: what the run created or changed under ``/output/`` (as for a code
    run). ``results`` is empty here (``/execute`` runs a fresh process with no rich
    display); it exists so tools can treat both results alike. ``error`` is set when the
    process failed: for Python code, the exception parsed from the traceback on
    stderr; otherwise ``NonZeroExit`` or ``TimeoutError``.
    """

    stdout: str
    stderr: str
    exit_code: int
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False
    language: str | None = None
    results: list[Result] = field(default_factory=list)
    files: list[OutputFile] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any, language: str | None = None) -> ExecResult:
        return cls(stdout=str(_get(data, "stdout", "exec result")),
                   stderr=str(data.get("stderr", "")),
                   exit_code=int(_get(data, "exit_code", "exec result")),
                   duration_ms=float(data.get("duration_ms", 0.0)),
                   timed_out=bool(data.get("timed_out")), truncated=bool(data.get("truncated")),
                   language=language, files=OutputFile.list_from(data.get("files")))

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def error(self) -> ExecutionError | None:
        if self.ok:
            return None
        if self.timed_out:
            return ExecutionError("TimeoutError", "the run timed out and was killed", self.stderr)
        if self.language == "python":
            lines = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
            match = _EXC_LINE.match(lines[-1]) if lines else None
            if match:
                return ExecutionError(match.group(1), match.group(2) or "", self.stderr)
        return ExecutionError("NonZeroExit", f"exit code {self.exit_code}", self.stderr)


@dataclass(frozen=True)
class ProcessInfo:
    """A command started with ``commands.run`` (``exit_code`` is ``-N`` for signal N)."""

    pid: int
    command: str = ""
    cwd: str = ""
    background: bool = True
    stdin: bool = False
    running: bool = True
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    timed_out: bool = False
    output_bytes: int = 0

    @classmethod
    def from_dict(cls, data: Any) -> ProcessInfo:
        _get(data, "pid", "process")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class CommandResult:
    """A finished command: its whole output and exit code."""

    pid: int | None
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def error(self) -> str | None:  # E2B's CommandResult.error
        return None if self.ok else (self.stderr or f"exit code {self.exit_code}")


@dataclass(frozen=True)
class OutputChunk:
    """A piece of a command's output. ``next_offset`` is where to reattach after it."""

    stream: str  # "stdout" | "stderr"
    data: str
    offset: int
    next_offset: int


@dataclass(frozen=True)
class CodeContext:
    """A code-interpreter context: its own interpreter process, globals and cwd."""

    name: str
    language: str = "python"
    cwd: str = ""
    pid: int | None = None
    running: bool = False
    execution_count: int = 0
    created_at: float | None = None

    @classmethod
    def from_dict(cls, data: Any) -> CodeContext:
        _get(data, "name", "context")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def id(self) -> str:
        return self.name


@dataclass(frozen=True)
class Session:
    """A session: a named sandbox that lives until deleted (suspended when idle, woken by
    a request). ``state`` is its sandbox's ("creating" before it has one); ``start_state``
    is none/starting/started/failed for the ``start`` command, which runs once. ``url`` is
    the host form (``http://{name}.sessions.localhost:8080``, private: send
    ``preview_token``); ``proxy_path`` the API-key form. ``sandbox()`` connects to its
    sandbox (awaitable when the session came from an ``AsyncAgentBox``)."""

    name: str
    sandbox_id: str | None
    state: str
    port: int
    url: str | None = None
    proxy_path: str | None = None
    preview_token: str | None = None
    start: str | None = None
    start_state: str = "none"
    start_pid: int | None = None
    start_error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float | None = None

    @classmethod
    def from_dict(cls, data: Any, client: Any = None, url: str | None = None) -> Session:
        """Parse the server's view; ``url`` (from ``session_url_template``) replaces the
        server's; ``client`` is what ``sandbox()`` connects through."""
        for name in ("name", "sandbox_id", "state", "port"):
            _get(data, name, "session")
        known = {f.name for f in dataclasses.fields(cls)}
        session = cls(**{k: v for k, v in data.items() if k in known}
                      | ({"url": url} if url else {}))
        object.__setattr__(session, "_client", client)  # not a field: kept out of asdict()
        return session

    def sandbox(self) -> Any:
        """The session's sandbox, connected (a ``Sandbox``; with an async client, a
        coroutine giving an ``AsyncSandbox``). Leaving a ``with`` block does not kill it."""
        client = getattr(self, "_client", None)
        if client is None:
            raise ConfigurationError("this Session was not made by a client: use "
                                     "box.connect(session.sandbox_id)")
        if not self.sandbox_id:
            raise NotFoundError(f"session {self.name!r} has no sandbox yet", status=404,
                                code="session_not_ready")
        return client.connect(self.sandbox_id)


@dataclass(frozen=True)
class SandboxPage:
    """One page of ``GET /v1/sandboxes``; ``next_cursor`` is None on the last page.
    ``partial`` (a fleet of hosts only): the hosts that did not answer in time, whose
    sandboxes are missing from this page; empty when the listing is whole."""

    sandboxes: list[SandboxInfo]
    next_cursor: str | None = None
    partial: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> SandboxPage:
        items = _get(data, "sandboxes", "sandbox list")
        partial = data.get("partial")
        return cls([SandboxInfo.from_dict(s) for s in items], data.get("next_cursor"),
                   [str(h) for h in partial] if isinstance(partial, list) else [])


def _known(cls: Any, data: Any, kind: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ProtocolError(f"{kind}: the server's answer is not an object")
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class SandboxUsage:
    """Metered use of one sandbox (or, in :class:`KeyUsage`, of a key) in a time window:
    awake = time RUNNING; snapshot GiB-hours = time suspended x its snapshot's size."""

    sandbox_id: str
    key: str
    awake_seconds: float = 0.0
    vcpu_seconds: float = 0.0
    gib_seconds: float = 0.0
    suspended_seconds: float = 0.0
    snapshot_gib_hours: float = 0.0
    restores: int = 0
    created: int = 0
    destroyed: int = 0

    @classmethod
    def from_dict(cls, data: Any) -> SandboxUsage:
        _get(data, "sandbox_id", "usage")
        return cls(**_known(cls, data, "usage"))


@dataclass(frozen=True)
class KeyUsage:
    key: str
    awake_seconds: float = 0.0
    vcpu_seconds: float = 0.0
    gib_seconds: float = 0.0
    suspended_seconds: float = 0.0
    snapshot_gib_hours: float = 0.0
    restores: int = 0
    created: int = 0
    destroyed: int = 0
    sandboxes: list[SandboxUsage] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> KeyUsage:
        _get(data, "key", "usage")
        fields = _known(cls, data, "usage")
        fields["sandboxes"] = [SandboxUsage.from_dict(s) for s in fields.get("sandboxes") or []]
        return cls(**fields)


@dataclass(frozen=True)
class Usage:
    """``GET /v1/usage``: per key, its totals and its sandboxes, in [``from_``, ``to``)."""

    from_: float
    to: float
    keys: list[KeyUsage] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> Usage:
        return cls(float(_get(data, "from", "usage")), float(_get(data, "to", "usage")),
                   [KeyUsage.from_dict(k) for k in data.get("keys") or []])

    def for_key(self, key: str | None = None) -> KeyUsage | None:
        """One key's usage (the only one when ``key`` is None)."""
        if key is None:
            return self.keys[0] if len(self.keys) == 1 else None
        return next((k for k in self.keys if k.key == key), None)


@dataclass(frozen=True)
class SandboxMetrics:
    """A sandbox's resource use as the host sees it (its VMM's cgroup or /proc)."""

    sandbox_id: str
    state: str
    disk_bytes: int
    at: float
    vmm_pid: int | None = None
    source: str | None = None  # "cgroup", "proc", or None (no VM running)
    cpu_seconds: float | None = None
    memory_bytes: int | None = None
    rss_bytes: int | None = None
    snapshot_bytes: int = 0

    @classmethod
    def from_dict(cls, data: Any) -> SandboxMetrics:
        for name in ("sandbox_id", "state", "disk_bytes", "at"):
            _get(data, name, "metrics")
        return cls(**_known(cls, data, "metrics"))


@dataclass(frozen=True)
class SandboxEvent:
    at: float
    to: str
    event: str
    from_: str | None = None
    cause: str = ""

    @classmethod
    def from_dict(cls, data: Any) -> SandboxEvent:
        return cls(float(_get(data, "at", "event")), str(_get(data, "to", "event")),
                   str(_get(data, "event", "event")), data.get("from"), data.get("cause", ""))


@dataclass(frozen=True)
class SandboxLogs:
    """A sandbox's console log tail (``console``: lines) and its state transitions."""

    sandbox_id: str
    console: list[str] = field(default_factory=list)
    events: list[SandboxEvent] = field(default_factory=list)
    truncated: bool = False

    @classmethod
    def from_dict(cls, data: Any) -> SandboxLogs:
        return cls(str(_get(data, "sandbox_id", "logs")),
                   [str(line) for line in _get(data, "console", "logs")],
                   [SandboxEvent.from_dict(e) for e in _get(data, "events", "logs")],
                   bool(data.get("truncated", False)))
