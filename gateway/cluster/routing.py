"""Where a request for one sandbox is served: here, by its owner elsewhere, or refused.

No I/O: the daemon's middleware (gateway.http.cluster_forward) asks ``decide`` with what
the route cache says, this host's name, whether the request was already forwarded once
(the hop header) and whether this host is fenced, and does what the answer says.

The rules, in order:

1. a request that was already forwarded is never forwarded again: served here when the
   cache says we own the sandbox (or knows nothing of it), else a loop (508 ``forward_loop``:
   two hosts' caches disagree, one is behind; the client retries);
2. a fenced host serves nothing of its own (503 ``host_fenced``): its lease is gone, so
   another host may own the sandbox by now; it still forwards what the cache says another
   live host owns (that host checks its own fence);
3. the owner is another live host: forward to its advertised address;
4. the owner is another host with no record (dead, or cut off): 503 ``owner_unavailable``;
   serving a local copy here could answer for the same sandbox from two hosts;
5. ours but still arriving (moved here, its adoption under way: gateway.cluster.adopter):
   503 ``owner_unavailable`` asking to retry, rather than a 404 from a registry that does
   not have it yet;
6. otherwise (ours, or unknown to the fleet): served here.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.cluster import placement
from gateway.cluster.errors import NoCapacity
from gateway.cluster.records import HostRecord
from gateway.cluster.routes import Route

HOP_HEADER = "X-AgentBox-Forwarded"  # value: the forwarding host's name
_SANDBOX_PATH = re.compile(r"/v1/sandboxes/([A-Za-z0-9_-]{1,128})(?:/.*)?")


@dataclass(frozen=True)
class ServeHere:
    pass


@dataclass(frozen=True)
class Forward:
    host: str
    address: str  # HOST:PORT of the owner's gateway
    gen: int


@dataclass(frozen=True)
class Refuse:
    code: str  # host_fenced | forward_loop | owner_unavailable
    message: str


Decision = ServeHere | Forward | Refuse


def decide(sandbox_id: str, route: Route | None, self_host: str, *,
           forwarded_by: str | None, fenced: str | None, arriving: bool = False) -> Decision:
    ours = route is None or route.host == self_host
    if forwarded_by is not None and not ours:
        assert route is not None
        return Refuse("forward_loop", f"sandbox {sandbox_id}: {forwarded_by} forwarded this "
                      f"request to {self_host}, which routes it to {route.host} (gen "
                      f"{route.gen}); the hosts' route caches disagree: retry")
    if ours:
        if fenced is not None:
            return Refuse("host_fenced", f"host {self_host} is fenced ({fenced}): it serves "
                          "no sandboxes until it rejoins the fleet")
        if arriving and route is not None:
            return Refuse("owner_unavailable", f"sandbox {sandbox_id} is being moved to "
                          f"{self_host} (its snapshot is being fetched): retry shortly")
        return ServeHere()
    assert route is not None
    if route.address is None:
        return Refuse("owner_unavailable", f"sandbox {sandbox_id} is owned by {route.host}, "
                      "which is not live (no host record): retry later")
    return Forward(route.host, route.address, route.gen)


def place(hosts: Iterable[HostRecord], self_host: str, request: placement.Request, *,
          k: int, rng: random.Random) -> ServeHere | Forward:
    """Where a create that reached this host (not forwarded) is made: the host placement
    chooses among live hosts' published loads. Here when this host is chosen, or when no
    host looks able to take it (this host then answers with its own admission)."""
    try:
        chosen = placement.choose(hosts, request, k=k, rng=rng)
    except NoCapacity:
        return ServeHere()
    if chosen.name == self_host:
        return ServeHere()
    return Forward(chosen.name, chosen.address, 0)


def client_of(forwarded_by: str | None, remote: str | None, forwarded_for: str,
              fleet: set[str]) -> str | None:
    """The client's address of a request another fleet host forwarded (its last
    ``X-Forwarded-For`` entry, which the forwarder appended), so per-address rate limits
    count the client, not the forwarder. None unless the peer is a live host's address:
    anyone can send the headers, only the fleet is believed."""
    if forwarded_by is None or remote is None or remote not in fleet:
        return None
    last = forwarded_for.rsplit(",", 1)[-1].strip()
    return last or None


def sandbox_in_path(path: str) -> str | None:
    """The sandbox id of an API path under ``/v1/sandboxes/{id}`` (None for others)."""
    m = _SANDBOX_PATH.fullmatch(path)
    return m.group(1) if m else None
