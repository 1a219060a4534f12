"""What each API operation sends, as data (no I/O): one function per endpoint.

The sync and async classes both build their requests here, so the two never
drift apart; they differ only in how they send them (``agentbox._transport``).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any
from urllib.parse import quote

from agentbox._transport import Call
from agentbox.exceptions import InvalidArgumentError

HOME = "/root"  # relative sandbox paths are taken from here (the guest's $HOME and exec cwd)
INPUT_DIR = "/input"  # ...except for sandbox.upload(), whose relative paths land here
OUTPUT_DIR = "/output"  # ...and sandbox.download(), which reads them from here (result.files)
SNAPSHOT_TIMEOUT = 600.0  # a snapshot or fork copies the VM's memory and disk
# Server-side limits get this much on top for the HTTP exchange itself.
MARGIN = 90.0
DEFAULT_EXEC_TIMEOUT = 60.0
DEFAULT_RUN_TIMEOUT = 300.0


def sandbox_path(path: str) -> str:
    """An absolute guest path (relative ones are relative to ``/root``)."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError("a sandbox path is required", code="invalid_path")
    return path if path.startswith("/") else posixpath.join(HOME, path)


def _sb(sandbox_id: str, rest: str = "") -> str:
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{rest}"


def _drop_none(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


# -- sandboxes ---------------------------------------------------------------------------------

def create_sandbox(template: str | None, idle_timeout: float | None,
                   metadata: dict[str, Any] | None, ttl: float | None = None,
                   auto_delete_after: float | None = None, egress: Any = None,
                   **shape: int | None) -> Call:
    """``shape``: vcpus, memory_mib, disk_mib (None: the template's)."""
    body = _drop_none(template=template, idle_timeout=idle_timeout, metadata=metadata, ttl=ttl,
                      auto_delete_after=auto_delete_after, egress=egress, **shape)
    return Call("POST", "/v1/sandboxes", json=body)


def list_sandboxes(state: str | list[str] | None = None, template: str | None = None,
                   metadata: dict[str, Any] | None = None, limit: int | None = None,
                   cursor: str | None = None) -> Call:
    """One page; ``metadata``: values every sandbox must have (``metadata.KEY=VALUE``)."""
    if isinstance(state, (list, tuple)):
        state = ",".join(state)
    params = _drop_none(state=state, template=template, cursor=cursor,
                        limit=None if limit is None else str(int(limit)))
    for key, value in (metadata or {}).items():
        params[f"metadata.{key}"] = value if isinstance(value, str) else _json_text(value)
    return Call("GET", "/v1/sandboxes", params=params or None)


def _json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def usage(start: float | None = None, end: float | None = None,
          key: str | None = None) -> Call:
    params = _drop_none(key=key, **{"from": None if start is None else str(start),
                                    "to": None if end is None else str(end)})
    return Call("GET", "/v1/usage", params=params or None)


def sandbox_metrics(sandbox_id: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/metrics"))


def sandbox_logs(sandbox_id: str, tail: int | None = None) -> Call:
    return Call("GET", _sb(sandbox_id, "/logs"),
                params=None if tail is None else {"tail": str(int(tail))})


def get_sandbox(sandbox_id: str) -> Call:
    return Call("GET", _sb(sandbox_id))


def delete_sandbox(sandbox_id: str) -> Call:
    return Call("DELETE", _sb(sandbox_id))


def suspend_sandbox(sandbox_id: str) -> Call:
    return Call("POST", _sb(sandbox_id, "/suspend"))


def resume_sandbox(sandbox_id: str) -> Call:
    return Call("POST", _sb(sandbox_id, "/resume"))


def update_sandbox(sandbox_id: str, idle_timeout: float | None = None,
                   metadata: dict[str, Any] | None = None,
                   public_ports: list[int] | None = None, ttl: float | None = None,
                   auto_delete_after: float | None = None, egress: Any = None) -> Call:
    body = _drop_none(idle_timeout=idle_timeout, metadata=metadata,
                      public_ports=None if public_ports is None else _ports(public_ports),
                      ttl=ttl, auto_delete_after=auto_delete_after, egress=egress)
    if not body:
        raise InvalidArgumentError("nothing to update: give idle_timeout, metadata, "
                                   "public_ports, ttl, auto_delete_after and/or egress")
    return Call("PATCH", _sb(sandbox_id), json=body)


def templates() -> Call:
    return Call("GET", "/v1/templates")


def get_template(name: str) -> Call:
    return Call("GET", f"/v1/templates/{quote(name, safe='')}")


def delete_template(name: str) -> Call:
    return Call("DELETE", f"/v1/templates/{quote(name, safe='')}")


def snapshot_sandbox(sandbox_id: str, template: str) -> Call:
    return Call("POST", _sb(sandbox_id, "/snapshot"), json={"template": template},
                timeout=SNAPSHOT_TIMEOUT)


def fork_sandbox(sandbox_id: str, count: int) -> Call:
    return Call("POST", _sb(sandbox_id, "/fork"), json={"count": count},
                timeout=SNAPSHOT_TIMEOUT)


def under(directory: str, path: str) -> str:
    """``path`` if absolute, else ``directory/path`` (sandbox.upload / download)."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError("a sandbox path is required", code="invalid_path")
    return path if path.startswith("/") else posixpath.join(directory, path)
def start_build(name: str, dockerfile: str, context_tar: bytes) -> Call:
    return Call("POST", "/v1/templates/builds", params={"name": name, "dockerfile": dockerfile},
                content=context_tar, headers={"Content-Type": "application/x-tar"})


def get_build(build_id: str) -> Call:
    return Call("GET", f"/v1/templates/builds/{quote(build_id, safe='')}")


def build_log(build_id: str) -> Call:
    return Call("GET", f"/v1/templates/builds/{quote(build_id, safe='')}/log", timeout=None)


def server_info() -> Call:
    return Call("GET", "/v1/info")


def terminal_path(sandbox_id: str) -> str:
    return _sb(sandbox_id, "/terminal")


# -- preview access and sessions -------------------------------------------------------------

def _ports(ports: Any) -> list[int]:
    if isinstance(ports, (str, bytes)) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in ports):
        raise InvalidArgumentError(f"public_ports must be a list of port numbers, not {ports!r}")
    return list(ports)


def get_preview(sandbox_id: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/preview"))


def set_public_ports(sandbox_id: str, ports: Any) -> Call:
    return Call("PATCH", _sb(sandbox_id, "/preview"), json={"public_ports": _ports(ports)})


def rotate_preview_token(sandbox_id: str) -> Call:
    return Call("POST", _sb(sandbox_id, "/preview-token"))


def _session(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("a session name is required", code="bad_session_name")
    return f"/v1/sessions/{quote(name, safe='')}"


def put_session(name: str, template: str | None, port: int | None, idle_timeout: float | None,
                start: str | None, metadata: dict[str, Any] | None) -> Call:
    body = _drop_none(template=template, port=port, idle_timeout=idle_timeout, start=start,
                      metadata=metadata)
    return Call("PUT", _session(name), json=body)


def get_session(name: str) -> Call:
    return Call("GET", _session(name))


def list_sessions() -> Call:
    return Call("GET", "/v1/sessions")


def delete_session(name: str) -> Call:
    return Call("DELETE", _session(name))


# -- execute and files ---------------------------------------------------------------------------

def execute(sandbox_id: str, code: str | None, command: str | None, language: str | None,
            timeout: float | None, env: dict[str, str] | None, cwd: str | None) -> Call:
    if (code is None) == (command is None):
        raise InvalidArgumentError("give exactly one of code or command")
    if code is not None:
        body: dict[str, Any] = {"code": code, "language": language or "python"}
    else:
        body = {"command": command}
    body.update(_drop_none(timeout=timeout, env=env, cwd=cwd))
    limit = (timeout or DEFAULT_EXEC_TIMEOUT) + MARGIN
    return Call("POST", _sb(sandbox_id, "/execute"), json=body, timeout=limit)


def write_file(sandbox_id: str, path: str, content: Any, size: int | None) -> Call:
    headers = {"Content-Type": "application/octet-stream"}
    if size is not None:
        headers["Content-Length"] = str(size)
    return Call("POST", _sb(sandbox_id, "/files"), params={"path": sandbox_path(path)},
                content=content, headers=headers, timeout=None)


def read_file(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/files" + quote(sandbox_path(path))), timeout=None)


def stat_file(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/stat" + quote(sandbox_path(path))))


def delete_file(sandbox_id: str, path: str) -> Call:
    return Call("DELETE", _sb(sandbox_id, "/files" + quote(sandbox_path(path))))


# -- code interpreter --------------------------------------------------------------------------

def run_code(sandbox_id: str, code: str, language: str, context: str | None,
             timeout: float | None, env: dict[str, str] | None, stream: bool) -> Call:
    body = {"code": code, "language": language, "stream": stream,
            **_drop_none(context=context, timeout=timeout, env=env)}
    limit = (timeout or DEFAULT_RUN_TIMEOUT) + MARGIN
    return Call("POST", _sb(sandbox_id, "/run_code"), json=body, timeout=limit)


def create_context(sandbox_id: str, name: str | None, cwd: str | None,
                   env: dict[str, str] | None) -> Call:
    return Call("POST", _sb(sandbox_id, "/contexts"), json=_drop_none(name=name, cwd=cwd, env=env))


def list_contexts(sandbox_id: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/contexts"))


def delete_context(sandbox_id: str, name: str) -> Call:
    return Call("DELETE", _sb(sandbox_id, f"/contexts/{quote(name, safe='')}"))


# -- commands ---------------------------------------------------------------------------------

def start_command(sandbox_id: str, command: str, background: bool, env: dict[str, str] | None,
                  cwd: str | None, stdin: bool, timeout: float | None) -> Call:
    body = {"command": command, "background": background, "stdin": stdin,
            **_drop_none(env=env, cwd=cwd, timeout=timeout)}
    limit = DEFAULT_EXEC_TIMEOUT if background else None  # a silent foreground run may be long
    return Call("POST", _sb(sandbox_id, "/commands"), json=body, timeout=limit)


def list_commands(sandbox_id: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/commands"))


def get_command(sandbox_id: str, pid: int) -> Call:
    return Call("GET", _sb(sandbox_id, f"/commands/{int(pid)}"))


def command_stdin(sandbox_id: str, pid: int, data: bytes, eof: bool) -> Call:
    return Call("POST", _sb(sandbox_id, f"/commands/{int(pid)}/stdin"), content=data,
                params={"eof": "1"} if eof else None,
                headers={"Content-Type": "application/octet-stream"})


def signal_command(sandbox_id: str, pid: int, signal: str | int) -> Call:
    return Call("POST", _sb(sandbox_id, f"/commands/{int(pid)}/signal"), json={"signal": signal})


def wait_command(sandbox_id: str, pid: int, timeout: float) -> Call:
    return Call("GET", _sb(sandbox_id, f"/commands/{int(pid)}/wait"),
                params={"timeout": f"{timeout:g}"}, timeout=timeout + MARGIN)


def command_output(sandbox_id: str, pid: int, offset: int, follow: bool) -> Call:
    params = {"offset": str(offset), **({"follow": "1"} if follow else {})}
    return Call("GET", _sb(sandbox_id, f"/commands/{int(pid)}/output"), params=params,
                timeout=None)


def to_bytes(data: str | bytes | bytearray | memoryview) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)
