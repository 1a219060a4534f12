"""Where a new sandbox goes: the least-loaded live host, chosen best-of-K (no I/O).

Input is what hosts publish on their leases (``HostRecord``: free RAM, free vCPUs, awake
sandboxes), so "live" is simply "has a record". A host is eligible when it has room for the
request; among eligible hosts we sample K at random and take the best by:

1. most free RAM left after placing, as a fraction of the host's RAM (RAM is what runs out
   first for long-lived sandboxes; a fraction so big and small hosts fill evenly),
2. then fewest awake sandboxes (each costs CPU and a slice of the shared page cache),
3. then most free vCPUs, then name (deterministic ties).

Why sample K rather than take the global best: every host places from a view that is a
little stale (loads are republished, not locked), so "everyone picks the emptiest host"
sends a burst of creates to one host; two random choices keep nearly all of the balance
without the herd (Mitzenmacher's power of two choices). K >= the number of eligible hosts
is the plain least-loaded pick.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.cluster.errors import NoCapacity
from gateway.cluster.records import HostRecord


@dataclass(frozen=True)
class Request:
    memory_mib: int
    vcpus: int

    def __post_init__(self) -> None:
        # vcpus 0: a sandbox placed asleep (a move of a suspended or failed one) holds none
        if self.memory_mib < 1 or self.vcpus < 0:
            raise ValueError("a placement request needs memory_mib >= 1 and vcpus >= 0")


def why_not(host: HostRecord, request: Request) -> str | None:
    """None when ``host`` can take ``request``, else the reason it cannot."""
    if host.free_mib < request.memory_mib:
        return f"{host.free_mib} MiB free < {request.memory_mib} MiB asked"
    if host.free_vcpus < request.vcpus:
        return f"{host.free_vcpus} vCPUs free < {request.vcpus} asked"
    return None


def cost(host: HostRecord, request: Request) -> tuple[float, int, int, str]:
    """Smaller is better (``min`` picks it): the order of the module docstring."""
    ram_left = (host.free_mib - request.memory_mib) / max(host.total_mib, host.free_mib, 1)
    return (-ram_left, host.awake, -(host.free_vcpus - request.vcpus), host.name)


def choose(hosts: Iterable[HostRecord], request: Request, *, k: int = 2,
           rng: random.Random | None = None, exclude: Iterable[str] = ()) -> HostRecord:
    """The host for ``request``; NoCapacity (with each host's reason) if none can take it."""
    if k < 1:
        raise ValueError("k must be >= 1")
    skip = set(exclude)
    reasons: dict[str, str] = {}
    eligible = []
    for host in sorted(hosts, key=lambda h: h.name):
        reason = "excluded" if host.name in skip else why_not(host, request)
        if reason is None:
            eligible.append(host)
        else:
            reasons[host.name] = reason
    if not eligible:
        detail = "; ".join(f"{n}: {r}" for n, r in reasons.items()) or "no live hosts"
        raise NoCapacity(f"no host can take {request.memory_mib} MiB / {request.vcpus} vCPUs "
                         f"({detail})", reasons)
    if k < len(eligible):
        eligible = (rng or random.Random()).sample(eligible, k)
    return min(eligible, key=lambda h: cost(h, request))
