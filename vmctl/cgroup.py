"""One cgroup per VMM, with memory, CPU and pids limits, on cgroup v2 or v1.

Hosts differ: a pure cgroup v2 host has one hierarchy at /sys/fs/cgroup with the
memory, cpu and pids controllers; older hosts (and this project's CI machine)
mount each controller as its own v1 hierarchy, with perhaps an empty v2
hierarchy beside them. ``Hierarchy.detect`` picks v2 when it offers all three
controllers and v1 otherwise, once.

A VMM joins its cgroup *before* QEMU runs: the spawn is wrapped in ``sh -c
'echo $$ > .../cgroup.procs; exec "$@"'`` (``wrap``), so nothing QEMU allocates
is charged elsewhere. Every cgroup lives under ``agentbox/<daemon>`` where
<daemon> names the data dir, so daemons sharing a host sweep only their own
leftovers. The owner (the driver) removes a VMM's cgroup when the VMM is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from vmctl.confine import Limits

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    root: Path = CGROUP_ROOT

    @classmethod
    def detect(cls, root: Path = CGROUP_ROOT) -> Hierarchy | None:
        controllers = root / "cgroup.controllers"
        if controllers.exists() and set(CONTROLLERS) <= set(controllers.read_text().split()):
            return cls(2, root)
        if all((root / c / "cgroup.procs").exists() for c in CONTROLLERS):
            return cls(1, root)
        return None

    def dirs(self, name: str) -> list[Path]:
        """The cgroup directories for ``name`` (one per v1 controller, one on v2)."""
        if self.version == 2:
            return [self.root / name]
        return [self.root / c / name for c in CONTROLLERS]

    def limit_files(self, name: str, limits: Limits) -> dict[Path, str]:
        if self.version == 2:
            d = self.root / name
            return {d / "memory.max": str(limits.memory_bytes),
                    d / "memory.swap.max": "0",
                    d / "cpu.max": f"{limits.cpu_quota_us} {Limits.PERIOD_US}",
                    d / "pids.max": str(limits.pids_max)}
        r = self.root
        return {r / "memory" / name / "memory.limit_in_bytes": str(limits.memory_bytes),
                r / "cpu" / name / "cpu.cfs_period_us": str(Limits.PERIOD_US),
                r / "cpu" / name / "cpu.cfs_quota_us": str(limits.cpu_quota_us),
                r / "pids" / name / "pids.max": str(limits.pids_max)}


def daemon_parent(data_dir: Path) -> str:
    """The parent cgroup of one daemon's VMMs."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:10]
    return f"agentbox/{digest}"


class CgroupManager:
    """Creates, fills and removes the cgroups of one daemon's VMMs."""

    def __init__(self, hierarchy: Hierarchy, parent: str) -> None:
        self.hierarchy = hierarchy
        self.parent = parent
        if hierarchy.version == 2:
            self._enable_v2_controllers()

    def create(self, name: str, limits: Limits) -> list[Path]:
        """Make the cgroup (recreating a stale one) and set its limits; returns the
        ``cgroup.procs`` files a VMM must join."""
        full = f"{self.parent}/{name}"
        self.remove(name)
        for d in self.hierarchy.dirs(full):
            d.mkdir(parents=True, exist_ok=True)
        for path, value in self.hierarchy.limit_files(full, limits).items():
            if path.exists():  # memory.swap.max is absent without swap accounting
                path.write_text(value)
        return [d / "cgroup.procs" for d in self.hierarchy.dirs(full)]

    def remove(self, name: str, timeout: float = 2.0) -> None:
        """Remove the cgroup once its processes are gone (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        for d in self.hierarchy.dirs(f"{self.parent}/{name}"):
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s still has processes; left in place", d)
                        break
                    time.sleep(0.02)

    def remove_parent(self) -> bool:
        """Remove this daemon's parent cgroup (and ``agentbox/`` if that is empty too) when
        no VMM cgroup is left under it; VMMs that outlive the daemon keep it."""
        removed = True
        for d in self.hierarchy.dirs(self.parent):
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # a VMM's cgroup is still under it
                removed = False
                continue
            with contextlib.suppress(OSError):  # other daemons' cgroups may be there
                d.parent.rmdir()
        return removed

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove this daemon's empty cgroups not in ``keep`` (left by a crash)."""
        removed = []
        for d in self.hierarchy.dirs(self.parent):
            if not d.is_dir():
                continue
            for child in d.iterdir():
                if child.is_dir() and child.name not in keep:
                    with contextlib.suppress(OSError):  # busy: a live VMM is in it
                        child.rmdir()
                        removed.append(child.name)
        return sorted(set(removed))

    def _enable_v2_controllers(self) -> None:
        # Controllers must be enabled in every ancestor's subtree_control.
        path = self.hierarchy.root
        for part in ["", *self.parent.split("/")]:
            path = path / part if part else path
            path.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (path / "cgroup.subtree_control").write_text(
                    " ".join(f"+{c}" for c in CONTROLLERS))


def wrap(argv: list[str], procs: list[Path]) -> list[str]:
    """``argv`` run by a shell that first moves itself into the cgroup (then execs, so
    the pid the caller sees is the VMM's)."""
    if not procs:
        return argv
    joins = " && ".join(f"echo $$ > {p}" for p in procs)
    return ["sh", "-c", f'{joins} && exec "$@"', "agentbox-vmm", *argv]


def usage(hierarchy: Hierarchy, parent: str, name: str) -> dict[str, int]:
    """Current memory use, CPU time and task count of one VMM's cgroup (for tests/metrics)."""
    full = f"{parent}/{name}"
    r = hierarchy.root
    def read(path: Path) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().split()[0])
        return -1
    if hierarchy.version == 2:
        return {"memory_bytes": read(r / full / "memory.current"),
                "pids": read(r / full / "pids.current")}
    return {"memory_bytes": read(r / "memory" / full / "memory.usage_in_bytes"),
            "pids": read(r / "pids" / full / "pids.current")}


__all__ = ["CgroupManager", "Hierarchy", "daemon_parent", "usage", "wrap"]
