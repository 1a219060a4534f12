"""``GET /v1/usage``, ``GET /v1/sandboxes/{id}/metrics`` and ``GET /v1/sandboxes/{id}/logs``.

All three read the host only (the registry, /proc, the VMM's cgroup, files in the sandbox's
directory): none of them wakes a sleeping sandbox or asks its guest anything. The
accounting is ``gateway.tenancy.usage``; this module measures and shapes JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.tenancy import usage
from gateway.http import wire
from gateway.http.sandbox_routes import SERVICE_KEY, _tenant, json_response
from gateway.errors import BadRequest, Forbidden
from gateway.sandbox.states import State
from gateway.http.middleware import current_key
from gateway.store.registry import SandboxRecord
from gateway.sandbox.disk_usage import tree_bytes
from gateway.sandbox.service import SandboxService

routes = web.RouteTableDef()

MAX_TAIL = 10_000  # lines of console log
MAX_TAIL_BYTES = 1 << 20  # read at most this much from the end of the console log
DEFAULT_TAIL = 200
MAX_EVENTS = 1000
CONSOLE = ("vm/console.log.1", "vm/console.log")  # oldest first (vmctl.console rotates once)


# -- usage ------------------------------------------------------------------------------------

def shape_of(service: SandboxService, recs: dict[str, SandboxRecord]) -> Any:
    """A sandbox's vCPUs, memory and last snapshot size, for ``usage.account``."""
    by_golden: dict[str, tuple[int, int]] = {}

    def shape(sandbox_id: str) -> usage.Shape:
        rec = recs[sandbox_id]
        vcpus, mem = rec.vcpus, rec.memory_mib
        if not (vcpus and mem):  # a row from before per-sandbox shapes: its golden's shape
            if rec.golden not in by_golden:
                try:
                    g = service.golden_for(rec)
                except Exception:  # its golden build was removed: the template's current one
                    g = service.goldens.get(rec.template)
                by_golden[rec.golden] = (g.vcpus, g.mem_mib) if g else (1, 0)
            vcpus, mem = vcpus or by_golden[rec.golden][0], mem or by_golden[rec.golden][1]
        return usage.Shape(int(vcpus), int(mem), rec.snapshot_bytes)
    return shape


def usage_report(service: SandboxService, key: str | None, lo: float, hi: float,
                 now: float) -> dict[str, tuple[usage.SandboxUsage, list[usage.SandboxUsage]]]:
    recs = {r.id: r for r in service.registry.list(key, include_destroyed=True)}
    rows = [r for r in service.registry.tenant_transitions(key) if r["sandbox_id"] in recs]
    return usage.by_key(rows, shape_of(service, recs), lo, hi, now,
                        service.registry.downtimes())


def _time(value: str | None, default: float, name: str) -> float:
    if value is None or value == "":
        return default
    try:
        out = float(value)
    except ValueError as exc:
        raise BadRequest(f"'{name}' must be a Unix time in seconds") from exc
    if not 0 <= out < 1e11:
        raise BadRequest(f"'{name}' must be a Unix time in seconds")
    return out


def _usage_key(request: web.Request) -> str | None:
    """Whose usage: the key's own; an admin may ask for ``?key=ID`` or ``?key=*`` (all)."""
    me = current_key(request)
    asked = request.query.get("key")
    if asked is None or asked == me.id:
        return me.id
    if not me.admin:
        raise Forbidden("only an admin key can read another key's usage (?key=)")
    return None if asked == "*" else asked


@routes.get("/v1/usage")
async def get_usage(request: web.Request) -> web.Response:
    now = time.time()
    lo = _time(request.query.get("from"), 0.0, "from")
    hi = _time(request.query.get("to"), now, "to")
    if hi < lo:
        raise BadRequest("'to' must not be before 'from'")
    key = _usage_key(request)
    report = usage_report(request.app[SERVICE_KEY], key, lo, hi, now)
    if key is not None and key not in report:
        report[key] = (usage.SandboxUsage("", key), [])
    keys = []
    for _, (total, items) in sorted(report.items(), key=lambda kv: kv[0]):
        body = total.to_dict()
        del body["sandbox_id"]
        keys.append(wire.KeyUsage(**body, sandboxes=[wire.SandboxUsage(**u.to_dict())
                                                     for u in items]))
    return json_response(wire.Usage(from_=lo, to=hi, keys=keys))


def prometheus_lines(service: SandboxService) -> list[str]:
    """``agentbox_usage_*_total{key}`` for ``GET /metrics`` (gateway.http.metrics)."""
    report = usage_report(service, None, 0.0, time.time(), time.time())
    return usage.prometheus({k: total for k, (total, _) in report.items()})


# -- per-sandbox metrics ----------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def proc_figures(pid: int) -> dict[str, Any]:
    """CPU seconds (user + system) and resident memory of a process, from /proc."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        out["cpu_seconds"] = (int(fields[11]) + int(fields[12])) / _TICK
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_bytes"] = int(line.split()[1]) * 1024
    return out


def cgroup_figures(service: SandboxService, sandbox_id: str) -> dict[str, Any]:
    cg = service.backend.cgroups if hasattr(service.backend, "cgroups") else None
    if cg is None:
        return {}
    h, full = cg.hierarchy, f"{cg.parent}/{sandbox_id}"
    out: dict[str, Any] = {}
    base = h.root / full if h.version == 2 else h.root / "memory" / full
    name = "memory.current" if h.version == 2 else "memory.usage_in_bytes"
    with contextlib.suppress(OSError, ValueError):
        out["memory_bytes"] = int((base / name).read_text().split()[0])
    with contextlib.suppress(OSError, ValueError):
        if h.version == 2:
            for line in (h.root / full / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    out["cpu_seconds"] = int(line.split()[1]) / 1e6
        else:
            out["cpu_seconds"] = int((h.root / "cpuacct" / full / "cpuacct.usage")
                                     .read_text()) / 1e9
    return out


def vmm_pid(rec: SandboxRecord) -> int | None:
    pid = (rec.vmm or {}).get("pid")
    return pid if isinstance(pid, int) and pid > 0 else None


@routes.get("/v1/sandboxes/{id}/metrics")
async def sandbox_metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    rec = svc.get(_tenant(request), request.match_info["id"])
    pid = vmm_pid(rec) if rec.state is not State.SUSPENDED else None
    figures: dict[str, Any] = {"cpu_seconds": None, "memory_bytes": None, "rss_bytes": None}
    source = None
    if pid is not None:
        proc = proc_figures(pid)
        cgroup = cgroup_figures(svc, rec.id)
        figures |= proc | cgroup
        source = "cgroup" if cgroup else ("proc" if proc else None)
        if figures["memory_bytes"] is None:
            figures["memory_bytes"] = figures["rss_bytes"]
    disk = await asyncio.to_thread(tree_bytes, Path(rec.root))
    return json_response(wire.SandboxMetrics(
        sandbox_id=rec.id, state=rec.state.value, vmm_pid=pid, source=source, **figures,
        disk_bytes=disk, snapshot_bytes=rec.snapshot_bytes, at=time.time()))


# -- per-sandbox logs -------------------------------------------------------------------------

def _int(value: str | None, default: int, top: int, name: str) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 0 <= int(value) <= top:
        raise BadRequest(f"'{name}' must be an integer from 0 to {top}")
    return int(value)


def console_tail(root: Path, lines: int) -> tuple[list[str], bool]:
    """The last ``lines`` lines of the console log (both rotated files), reading at most
    ``MAX_TAIL_BYTES`` from the end; True if older output was left out."""
    data = b""
    for name in reversed(CONSOLE):  # newest first, until enough bytes
        with contextlib.suppress(OSError), open(root / name, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            take = min(size, MAX_TAIL_BYTES - len(data))
            f.seek(size - take)
            data = f.read(take) + data
        if len(data) >= MAX_TAIL_BYTES:
            break
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n")
    if text and text[-1] == "":
        text.pop()
    cut = len(text) > lines or len(data) >= MAX_TAIL_BYTES
    return (text[-lines:] if lines else []), cut


@routes.get("/v1/sandboxes/{id}/logs")
async def sandbox_logs(request: web.Request) -> web.Response:
    svc = request.app[SERVICE_KEY]
    rec = svc.get(_tenant(request), request.match_info["id"])
    tail = _int(request.query.get("tail"), DEFAULT_TAIL, MAX_TAIL, "tail")
    console, truncated = await asyncio.to_thread(console_tail, Path(rec.root), tail)
    events = [wire.SandboxEvent(at=t["at"], from_=t["from_state"], to=t["to_state"],
                                event=t["event"], cause=t["cause"])
              for t in svc.registry.transitions(rec.id)[-min(tail or 1, MAX_EVENTS):]]
    return json_response(wire.SandboxLogs(sandbox_id=rec.id, console=console,
                                          truncated=truncated, events=events))
