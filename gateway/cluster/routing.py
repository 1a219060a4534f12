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

A session (its host ``{name}.{session_domain}`` or ``/v1/sessions/{name}/...``) is first
resolved by its fleet record (``decide_session``): to its sandbox when the cache knows the
sandbox (then the rules above), else to the host that holds the name (where the session's
row is: its sandbox is being made there, or is gone); unknown to the fleet: as rule 6.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.cluster import placement
from gateway.cluster.errors import NoCapacity
from gateway.cluster.records import HostRecord, SessionRecord
from gateway.cluster.routes import Route

HOP_HEADER = "X-AgentBox-Forwarded"  # value: the forwarding host's name
_SANDBOX_PATH = re.compile(r"/v1/sandboxes/([A-Za-z0-9_-]{1,128})(?:/.*)?")
_SESSION_PATH = re.compile(r"/v1/sessions/([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)(?:/.*)?")


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


def decide_session(name: str, record: SessionRecord | None, sandbox_route: Route | None,
                   address_of: Callable[[str], str | None], self_host: str, *,
                   forwarded_by: str | None, fenced: str | None, arriving: bool = False,
                   put: bool = False) -> Decision:
    """Where a request for session ``name`` is served: ``record`` is the fleet's record of
    the name, ``sandbox_route`` the cache's route of its sandbox (if it names one). ``put``:
    a ``PUT /v1/sessions/{name}``; forwarded here (placed here as a create) while the cache
    already names another holder, it is served here: its reservation in etcd says who holds
    the name and sends it there (gateway.preview.sessions.SessionElsewhere)."""
    if put and forwarded_by is not None:
        return decide(f"session:{name}", None, self_host, forwarded_by=forwarded_by,
                      fenced=fenced)
    if record is not None and record.sandbox_id and sandbox_route is not None:
        return decide(record.sandbox_id, sandbox_route, self_host, forwarded_by=forwarded_by,
                      fenced=fenced, arriving=arriving)
    if record is None or record.host == self_host:
        return decide(f"session:{name}", None, self_host, forwarded_by=forwarded_by,
                      fenced=fenced)
    if forwarded_by is not None:
        return Refuse("forward_loop", f"session {name}: {forwarded_by} forwarded this request "
                      f"to {self_host}, which routes it to {record.host}; the hosts' route "
                      "caches disagree: retry")
    address = address_of(record.host)
    if address is None:
        return Refuse("owner_unavailable", f"session {name} is held by {record.host}, which "
                      "is not live (no host record): retry later")
    return Forward(record.host, address, 0)


def session_in_path(path: str) -> str | None:
    """The session name of an API path under ``/v1/sessions/{name}`` (None for others)."""
    m = _SESSION_PATH.fullmatch(path)
    return m.group(1) if m else None


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
