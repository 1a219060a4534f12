"""Which paused sandbox to snapshot now, and why. No I/O: the service measures.

Theory of operation
-------------------
An idle sandbox is first PAUSED (``[sandbox] suspend_after_pause`` > 0): its vCPUs stop,
its VMM and the guest's RAM stay, and a request wakes it with a ``cont`` and the clock fix
in milliseconds instead of a restore from disk. Its own core snapshots it after
``suspend_after_pause`` seconds paused. Before that, the host takes the RAM back when it
needs it, longest-paused first, one at a time:

* ``MemAvailable`` (``/proc/meminfo``) below ``pause_min_available_mib``;
* more than ``max_paused`` sandboxes paused on the host;
* a tenant at its ``max_awake`` (a paused sandbox still holds a VMM, so it counts as
  awake) wants one more awake: its own longest-paused sandbox goes first.

Snapshotting a paused sandbox is invisible to its tenant except that its next wake is a
restore (hundreds of ms) rather than an unpause: it was idle either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PausedSandbox:
    id: str
    tenant: str
    paused_since: float  # monotonic


@dataclass(frozen=True)
class PressureLimits:
    max_paused: int  # 0: no limit
    min_available_mib: int  # 0: never by memory


def pressure_victim(paused: Iterable[PausedSandbox], available_mib: int | None,
                    limits: PressureLimits) -> tuple[str, str] | None:
    """The sandbox to snapshot now because of the host (id, cause), or None."""
    ordered = sorted(paused, key=lambda p: p.paused_since)
    if not ordered:
        return None
    if limits.min_available_mib and available_mib is not None \
            and available_mib < limits.min_available_mib:
        return ordered[0].id, f"host memory low ({available_mib} MiB available)"
    if limits.max_paused and len(ordered) > limits.max_paused:
        return ordered[0].id, f"more than {limits.max_paused} sandboxes paused on this host"
    return None


def room_victim(paused: Iterable[PausedSandbox], tenant: str) -> str | None:
    """The tenant's longest-paused sandbox, snapshotted to make room for one more awake."""
    own = sorted((p for p in paused if p.tenant == tenant), key=lambda p: p.paused_since)
    return own[0].id if own else None


def mem_available_mib(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
