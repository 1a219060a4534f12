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
- RUNNING, PAUSED, CREATING, SUSPENDING, RESTORING or FAILED with a shipped snapshot
  (its memory died with the host; the snapshot is its disk as of its last suspend):
  **moved FAILED** to a live host holding that base, with the reason; that host
  registers it FAILED with only that disk, so the next request cold-boots it there
  (files as of the last suspend, processes gone).
- the same without a shipped snapshot (or no live host holds its base), or SUSPENDED
  never shipped (the upload had not finished): **moved FAILED with nothing**, the reason
  saying everything was lost; that host registers it so its owner sees why and can
  DELETE it (a request is answered ``sandbox_lost``).
- DESTROYED: nothing to do.

No live host can take a suspended one (none holds its base, or none has room): **wait**
(the next pass tries again). A FAILED one goes even to a full host (it holds nothing
until a request boots it); it waits only while no host is live.

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

import cachetools

from gateway.cluster.errors import ClusterError, NoCapacity, OwnershipConflict
from gateway.cluster.ownership import Ownership
from gateway.cluster.placement import Request, choose, cost
from gateway.cluster.records import MAX_REASON, HostRecord, SandboxRecord
from gateway.sandbox.states import State

if TYPE_CHECKING:
    from gateway.cluster.election import Election
    from gateway.cluster.routes import RouteTable

log = logging.getLogger(__name__)
AWAKE = frozenset({State.CREATING, State.RUNNING, State.PAUSED, State.SUSPENDING,
                   State.RESTORING})


@dataclass(frozen=True)
class Move:
    """Give the sandbox to ``to_host`` (gen + 1) as ``state``. SUSPENDED: it adopts
    ``snapshot`` and a request wakes it. FAILED: it registers the sandbox FAILED with
    ``reason``, with only the disk of ``snapshot`` (a request cold-boots it) or, if
    ``snapshot`` is "", with nothing (a request is answered ``sandbox_lost``; DELETE works)."""

    sandbox_id: str
    to_host: str
    snapshot: str
    state: State = State.SUSPENDED
    reason: str = ""


@dataclass(frozen=True)
class Wait:
    """Nothing can be done now (no host can take it); try on the next pass."""

    sandbox_id: str
    reason: str


Action = Move | Wait


DEFAULT_REQUEST = Request(memory_mib=256, vcpus=1)  # a record without its shape (older)


def request_of(record: SandboxRecord) -> Request:
    """What placing ``record`` (asleep: SUSPENDED or FAILED) takes: its memory as the
    shipper named it, for it wakes with that much. Not its vCPUs: a host's free vCPUs are
    its cores less its awake sandboxes', and a sandbox placed asleep holds none until it
    wakes (that host's own admission judges the wake). Counting them held a 2-core host to
    one moved sandbox per pass (bench/failover.py)."""
    return Request(record.memory_mib or DEFAULT_REQUEST.memory_mib, 0)


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


def when(at: float) -> str:
    """(No I/O.) A snapshot's time as a reason names it."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at)) if at > 0 else "unknown time"


def failed_reason(dead: str, record: SandboxRecord, disk: bool) -> str:
    """(No I/O.) What a FAILED sandbox moved off the dead host has left, in plain words."""
    if record.state is State.FAILED:
        was = f"it had failed ({record.reason or 'no reason recorded'})"
    elif record.state is State.SUSPENDED:
        was = "it was suspended but its snapshot was not uploaded yet"
    else:
        was = f"it was {record.state.value}: its memory is lost"
    if disk:
        kept = (f"its disk is as of its last suspend at {when(record.snapshot_at)} "
                "(files written since are lost); the next request boots that disk")
    elif record.snapshot:
        kept = (f"its last upload (at {when(record.snapshot_at)}) stands on base "
                f"{record.base[:16]}, which no live host holds: nothing to restore here "
                "(the upload stays in the object store)")
    else:
        kept = "nothing of it was uploaded: everything is lost; delete it"
    return f"host {dead} died; {was}; {kept}"[:MAX_REASON]


def decide(dead: str, records: Iterable[SandboxRecord], live: Iterable[HostRecord], *,
           request_for: Callable[[SandboxRecord], Request] = request_of, k: int = 2,
           rng: random.Random | None = None) -> list[Action]:
    """The actions for every record still naming the dead host ``dead``."""
    hosts = [h for h in live if h.name != dead]
    actions: list[Action] = []
    for record in sorted(records, key=lambda r: r.id):
        if record.host != dead or record.state is State.DESTROYED:
            continue
        request = request_for(record)
        able = holders(hosts, record.base) if record.snapshot else []
        if record.state is State.SUSPENDED and record.snapshot:
            try:
                to = choose_holder(hosts, record, request_for=request_for, k=k, rng=rng)
            except NoCapacity as exc:
                actions.append(Wait(record.id, str(exc)))
                continue
            actions.append(Move(record.id, to.name, record.snapshot))
        else:
            # FAILED: its memory is gone (or it never had a shipped snapshot). It goes to a
            # live host all the same, so its owner sees why and can delete it: with the
            # disk of its last upload to a host holding that base, else with nothing.
            disk = bool(able)
            if not (able or hosts):
                actions.append(Wait(record.id, "no live host"))
                continue
            to = _pick(able or hosts, request, k, rng)
            actions.append(Move(record.id, to.name, record.snapshot if disk else "",
                                State.FAILED, failed_reason(dead, record, disk)))
        hosts = [after_placing(h, request) if h.name == to.name else h for h in hosts]
    return actions


def _pick(hosts: list[HostRecord], request: Request, k: int,
          rng: random.Random | None) -> HostRecord:
    """Placement for a FAILED sandbox: it holds nothing until a request boots it (and
    that host's own admission then decides), so a full fleet still takes it: the least
    loaded host when none has room."""
    try:
        return choose(hosts, request, k=k, rng=rng)
    except NoCapacity:
        return min(hosts, key=lambda h: cost(h, request))


def after_placing(host: HostRecord, request: Request) -> HostRecord:
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
    came back, another pass moved it) is skipped: the next pass reads it again. The
    actions that landed (and the waits) are returned."""
    _, records = await ownership.list()
    by_id = {sid: v for sid, v in records.items() if v.record.host == dead}
    done: list[Action] = []
    for action in decide(dead, [v.record for v in by_id.values()], live,
                         request_for=request_for, k=k):
        current = by_id[action.sandbox_id]
        try:
            if isinstance(action, Move):
                await ownership.move(current, action.to_host, action.state, (guard,),
                                     snapshot=action.snapshot, reason=action.reason)
        except OwnershipConflict as exc:
            log.info("reaper: %s changed since read (%s); next pass", action.sandbox_id, exc)
            continue
        if not isinstance(action, Wait):
            log.warning("reaper: %s: %s", action.sandbox_id, action)
        elif _waits_said.get(action.sandbox_id) != action.reason:  # once per reason
            _waits_said[action.sandbox_id] = action.reason
            log.warning("reaper: %s of dead host %s waits: %s", action.sandbox_id, dead,
                        action.reason)
        done.append(action)
    return done


# What each waiting sandbox was last said to wait for (a pass runs every 3 s: say it once).
_waits_said: cachetools.LRUCache[str, str] = cachetools.LRUCache(4096)


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
                 k: int = 2, campaign_for: float = 30.0) -> None:
        self.election, self.ownership, self.table = election, ownership, table
        self.host, self.lease, self.grace, self.every, self.k = host, lease, grace, every, k
        # A campaign is a long poll with no deadline: sent to a member that was then cut
        # off it never answers (found by tests/cluster/test_moved_then_deleted.py: the
        # survivor's reaper never led). So a campaign is given up when this host's lease
        # changes (it was fenced and rejoined) or after ``campaign_for`` s, and made again.
        self.campaign_for = campaign_for
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
                leader = await self._campaign(lease)
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

    async def _campaign(self, lease: int, poll: float = 0.25) -> Any:
        """The election's campaign on ``lease``, given up (ClusterError) when the lease
        changes or it has run ``campaign_for`` seconds (cancelling withdraws it)."""
        task = asyncio.ensure_future(self.election.campaign(lease, self.host))
        begin = time.monotonic()
        try:
            while not task.done():
                if self.lease() != lease:
                    raise ClusterError(f"lease {lease:x} replaced: campaigning again")
                if time.monotonic() - begin > self.campaign_for:
                    raise ClusterError(f"no answer in {self.campaign_for:.0f} s")
                await asyncio.wait({task}, timeout=poll)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClusterError):
                    await task

    async def one_pass(self, guard: dict[str, Any]) -> list[Action]:
        table = self.table
        named = {r.host for r in table.sandboxes.values() if r.state is not State.DESTROYED}
        out: list[Action] = []
        for dead in due(named, table.hosts, self.absent_since, time.monotonic(), self.grace):
            actions = await reap(self.ownership, dead, list(table.hosts.values()), guard=guard,
                                 k=self.k)
            self.done.extend(a for a in actions if not isinstance(a, Wait))
            out.extend(actions)
        return out
