"""What the reaper does with a dead host's sandboxes: the decision, without I/O.

A host is dead when its record (on its lease) is gone; it fenced itself before that
(gateway.cluster.membership), so nothing it held is still being served. For each record
still naming it:

- SUSPENDED with a shipped snapshot: **move** it (compare-and-set, gen + 1) to a live
  host that holds its base (the golden its disk and memory stand on: the record's
  ``base``, the hosts' published ``bases``), chosen among those by placement for its
  shape (the record's, named with the snapshot); that host adopts it
  (gateway.cluster.adopter): fetches the snapshot and registers the sandbox as
  SUSPENDED, and the next request wakes it there as any local suspended sandbox.
- SUSPENDED never shipped (the upload had not finished): **lost**, its files are on
  the dead host's disk only.
- RUNNING, PAUSED, CREATING, SUSPENDING, RESTORING: its memory died with the host.
  **FAILED** in its record, noting the last shipped snapshot (its disk as of the last
  suspend) if there is one, else that it is lost.
- FAILED or DESTROYED: nothing to do.

No live host can take a suspended one (none holds its base, or none has room): **wait**
(the next pass tries again).

``decide`` is the decision (no I/O); ``reap`` is one pass against etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gateway.cluster.errors import ClusterError, NoCapacity, OwnershipConflict
from gateway.cluster.ownership import Ownership
from gateway.cluster.placement import Request, choose
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.sandbox.states import State

if TYPE_CHECKING:
    from gateway.cluster.election import Election
    from gateway.cluster.routes import RouteTable

log = logging.getLogger(__name__)
AWAKE = frozenset({State.CREATING, State.RUNNING, State.PAUSED, State.SUSPENDING,
                   State.RESTORING})


@dataclass(frozen=True)
class Move:
    """Give the sandbox to ``to_host`` (SUSPENDED, gen + 1); it fetches ``snapshot``."""

    sandbox_id: str
    to_host: str
    snapshot: str


@dataclass(frozen=True)
class Fail:
    """Mark the sandbox FAILED; ``reason`` says what of it is left."""

    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class Wait:
    """Nothing can be done now (no host can take it); try on the next pass."""

    sandbox_id: str
    reason: str


Action = Move | Fail | Wait


DEFAULT_REQUEST = Request(memory_mib=256, vcpus=1)  # a record without its shape (older)


def request_of(record: SandboxRecord) -> Request:
    """What placing ``record`` takes: its shape as the shipper named it."""
    return Request(record.memory_mib or DEFAULT_REQUEST.memory_mib,
                   record.vcpus or DEFAULT_REQUEST.vcpus)


def holders(hosts: Iterable[HostRecord], base: str) -> list[HostRecord]:
    """The hosts that can adopt a snapshot over ``base`` ("" = unknown, an older record:
    any host; its fetch then checks the base)."""
    return [h for h in hosts if not base or base in h.bases]


def choose_holder(hosts: Iterable[HostRecord], record: SandboxRecord, *,
                  request_for: Callable[[SandboxRecord], Request] = request_of, k: int = 2,
                  rng: random.Random | None = None) -> HostRecord:
    """Where a shipped suspended sandbox goes (the reaper's and the drain's choice): a host
    holding its base, chosen by placement for its shape. Raises ``NoCapacity``."""
    able = holders(hosts, record.base)
    if not able:
        raise NoCapacity(f"no live host holds its base {record.base[:16]}")
    return choose(able, request_for(record), k=k, rng=rng)


def decide(dead: str, records: Iterable[SandboxRecord], live: Iterable[HostRecord], *,
           request_for: Callable[[SandboxRecord], Request] = request_of, k: int = 2,
           rng: random.Random | None = None) -> list[Action]:
    """The actions for every record still naming the dead host ``dead``."""
    hosts = [h for h in live if h.name != dead]
    actions: list[Action] = []
    for record in sorted(records, key=lambda r: r.id):
        if record.host != dead or record.state in (State.FAILED, State.DESTROYED):
            continue
        if record.state is State.SUSPENDED and record.snapshot:
            try:
                to = choose_holder(hosts, record, request_for=request_for, k=k, rng=rng)
            except NoCapacity as exc:
                actions.append(Wait(record.id, str(exc)))
                continue
            hosts = [_taken(h, request_for(record)) if h.name == to.name else h
                     for h in hosts]
            actions.append(Move(record.id, to.name, record.snapshot))
        elif record.state is State.SUSPENDED:
            actions.append(Fail(record.id, f"host {dead} died before its snapshot was "
                                           "uploaded: lost"))
        elif record.state in AWAKE:
            kept = (f"its disk as of its last suspend is at {record.snapshot}"
                    if record.snapshot else "nothing was uploaded: lost")
            actions.append(Fail(record.id, f"host {dead} died while it was "
                                           f"{record.state.value}: its memory is lost; {kept}"))
    return actions


def _taken(host: HostRecord, request: Request) -> HostRecord:
    """The host as placement should see it after this pass gave it ``request``: several
    sandboxes of one dead host must not all land on the host that looked emptiest."""
    return replace(host, free_mib=max(0, host.free_mib - request.memory_mib),
                   free_vcpus=max(0, host.free_vcpus - request.vcpus))


async def reap(ownership: Ownership, dead: str, live: list[HostRecord], *,
               guard: dict[str, Any],
               request_for: Callable[[SandboxRecord], Request] = request_of,
               k: int = 2) -> list[Action]:
    """One pass for the dead host ``dead``: read every record, decide, apply each action
    as a compare-and-set guarded by the reaper's leadership (``LeaderKey.guard()``), so a
    deposed reaper changes nothing. A record that changed since it was read (its owner
    came back, another pass moved it) is skipped: the next pass reads it again. FAILED
    stays on the dead host's name with gen + 1 (routing answers owner_unavailable).
    The actions that landed (and the waits) are returned."""
    _, records = await ownership.list()
    by_id = {sid: v for sid, v in records.items() if v.record.host == dead}
    done: list[Action] = []
    for action in decide(dead, [v.record for v in by_id.values()], live,
                         request_for=request_for, k=k):
        current = by_id[action.sandbox_id]
        try:
            if isinstance(action, Move):
                await ownership.move(current, action.to_host, State.SUSPENDED, (guard,))
            elif isinstance(action, Fail):
                await ownership.move(current, dead, State.FAILED, (guard,),
                                     reason=action.reason)
        except OwnershipConflict as exc:
            log.info("reaper: %s changed since read (%s); next pass", action.sandbox_id, exc)
            continue
        if not isinstance(action, Wait):
            log.warning("reaper: %s: %s", action.sandbox_id, action)
        done.append(action)
    return done


def due(named: Iterable[str], live: Collection[str], absent_since: dict[str, float],
        now: float, grace: float) -> list[str]:
    """(No I/O.) The hosts to reap now: named by a record that still needs the reaper,
    without a host record, for at least ``grace`` seconds (as this reaper has seen it:
    ``absent_since`` is updated in place; a host that came back is dropped from it)."""
    dead = set(named) - set(live)
    for host in list(absent_since):
        if host not in dead:
            del absent_since[host]
    for host in dead:
        absent_since.setdefault(host, now)
    return sorted(h for h in dead if now - absent_since[h] >= grace)


class ReaperLoop:
    """The daemon's reaper: campaigns with this host's lease; while it leads, reaps every
    host dead for ``grace`` seconds, on every host-record delete (``poke``) and every
    ``every`` seconds. Another host's reaper takes over within a TTL if this one dies;
    a deposed one's writes are refused (``LeaderKey.guard()``)."""

    def __init__(self, election: Election, ownership: Ownership, table: RouteTable,
                 host: str, lease: Callable[[], int], *, grace: float, every: float = 3.0,
                 k: int = 2) -> None:
        self.election, self.ownership, self.table = election, ownership, table
        self.host, self.lease, self.grace, self.every, self.k = host, lease, grace, every, k
        self.leading = False
        self.absent_since: dict[str, float] = {}
        self.done: list[Action] = []
        self._poked = asyncio.Event()

    def poke(self) -> None:
        self._poked.set()

    async def run(self) -> None:
        while True:
            lease = self.lease()
            try:
                if not lease:
                    raise ClusterError("no lease yet")
                leader = await self.election.campaign(lease, self.host)
            except ClusterError as exc:
                log.info("reaper: campaign of %s: %s; again in 1 s", self.host, exc)
                await asyncio.sleep(1.0)
                continue
            log.warning("reaper: %s leads", self.host)
            self.leading, self.absent_since = True, {}
            try:
                while self.lease() == leader.lease:
                    try:
                        await self.one_pass(leader.guard())
                    except ClusterError as exc:
                        log.warning("reaper: pass failed: %s", exc)
                    self._poked.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._poked.wait(), self.every)
            finally:
                self.leading = False

    async def one_pass(self, guard: dict[str, Any]) -> list[Action]:
        table = self.table
        named = {r.host for r in table.sandboxes.values()
                 if r.state not in (State.FAILED, State.DESTROYED)}
        out: list[Action] = []
        for dead in due(named, table.hosts, self.absent_since, time.monotonic(), self.grace):
            actions = await reap(self.ownership, dead, list(table.hosts.values()), guard=guard,
                                 k=self.k)
            self.done.extend(a for a in actions if not isinstance(a, Wait))
            out.extend(actions)
        return out
