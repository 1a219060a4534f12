"""Usage metering from the transition log (no I/O in the accounting itself).

Theory of operation
-------------------
The registry writes every state transition with its time, in the same transaction as the new
state (``gateway.store.registry``), so the log already *is* a record of awake and asleep intervals
that survives any crash. ``account`` replays one sandbox's transitions into intervals and
clips them to the asked window:

* **awake** = time in RUNNING, from the transition that made it running to the one that ended
  it (creating, restoring and snapshotting are the platform's time, not charged). vCPU-seconds
  = awake seconds x vCPUs; GiB-seconds = awake seconds x memory size in GiB.
* **suspended** = time in SUSPENDED; snapshot GiB-hours = suspended hours x the bytes of the
  sandbox's snapshot on disk (``SandboxRecord.snapshot_bytes``: measured after each suspend
  and every 30 s while asleep, so a compacted snapshot counts at its compacted size; the
  latest measure is applied to the sandbox's whole suspended time).
* **restores** = ``restored`` transitions; **created** / **destroyed** = its insert and
  ``destroy`` rows in the window.

An interval still open ends at ``min(now, to)``. A daemon restart does not close an interval:
a VMM that kept running is adopted and its sandbox stays RUNNING (it did run). A VMM found
dead at start-up is recorded ``crashed`` by recovery, during the daemon's start-up; an awake
interval that ends inside such a *downtime* (after a daemon run's last heartbeat, written once
a second, and before the next run started, ``Registry.downtimes``) ends at that last
heartbeat instead: when the daemon went down with its VMMs (a host crash) that is when they
stopped; a VMM that outlived the daemon and died later is not charged for the time nobody
could observe (documented in docs/api.md "Usage").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

GIB = float(1 << 30)


@dataclass(frozen=True)
class Shape:
    vcpus: int
    mem_mib: int
    snapshot_bytes: int = 0


@dataclass
class SandboxUsage:
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

    def add(self, other: SandboxUsage) -> None:
        for name in ("awake_seconds", "vcpu_seconds", "gib_seconds", "suspended_seconds",
                     "snapshot_gib_hours", "restores", "created", "destroyed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def _observed_end(since: float, at: float, downtimes: Iterable[tuple[float, float]]) -> float:
    """Where an awake interval that ended at ``at`` really ends: at the last heartbeat before
    a downtime that ``at`` falls in (recovery recorded it), else at ``at``."""
    for last_beat, restarted in downtimes:
        if last_beat < at <= restarted:
            return max(since, last_beat)
    return at


def account(rows: Iterable[dict[str, Any]], shape: Shape, lo: float, hi: float,
            now: float, downtimes: Iterable[tuple[float, float]] = ()) -> SandboxUsage | None:
    """One sandbox's usage in [lo, hi) from its transitions (in order)."""
    rows, downtimes = list(rows), list(downtimes)
    if not rows:
        return None
    out = SandboxUsage(rows[0]["sandbox_id"], rows[0]["tenant"])
    state, since = None, 0.0
    for row in [*rows, {"to_state": None, "at": min(now, hi), "event": ""}]:
        at = row["at"]
        if state == "running":
            end = _observed_end(since, at, downtimes) if row["to_state"] else at
            out.awake_seconds += _overlap(since, end, lo, hi)
        elif state == "suspended":
            out.suspended_seconds += _overlap(since, at, lo, hi)
        if lo <= at < hi:
            out.created += row.get("from_state", "x") is None
            out.destroyed += row["event"] == "destroy"
            out.restores += row["event"] == "restored"
        state, since = row["to_state"], at
    out.vcpu_seconds = out.awake_seconds * shape.vcpus
    out.gib_seconds = out.awake_seconds * shape.mem_mib / 1024
    out.snapshot_gib_hours = out.suspended_seconds / 3600 * shape.snapshot_bytes / GIB
    return out


def by_key(rows: Iterable[dict[str, Any]], shape_of: Callable[[str], Shape], lo: float,
           hi: float, now: float, downtimes: Iterable[tuple[float, float]] = ()
           ) -> dict[str, tuple[SandboxUsage, list[SandboxUsage]]]:
    """Every key's total and its sandboxes' usage (``rows`` ordered by sandbox, then seq)."""
    per: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        per.setdefault(row["sandbox_id"], []).append(row)
    out: dict[str, tuple[SandboxUsage, list[SandboxUsage]]] = {}
    downtimes = list(downtimes)
    for sid, sandbox_rows in per.items():
        usage = account(sandbox_rows, shape_of(sid), lo, hi, now, downtimes)
        if usage is None:
            continue
        total, items = out.setdefault(usage.key, (SandboxUsage("", usage.key), []))
        total.add(usage)
        items.append(usage)
    return out


PROMETHEUS = (("vcpu_seconds", "awake vCPU-seconds"), ("gib_seconds", "awake GiB-seconds"),
              ("snapshot_gib_hours", "suspended snapshot GiB-hours"),
              ("restores", "restores"), ("created", "sandboxes created"),
              ("destroyed", "sandboxes destroyed"))


def prometheus(totals: dict[str, SandboxUsage]) -> list[str]:
    """Counters per key since the registry began (``agentbox_usage_*_total{key}``)."""
    lines: list[str] = []
    for name, help_text in PROMETHEUS:
        metric = f"agentbox_usage_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        lines += [f'{metric}{{key="{k}"}} {getattr(u, name):g}' for k, u in sorted(totals.items())]
    return lines
