"""The owner publishes its sandboxes: every local state change becomes its etcd record.

The registry calls ``changed(id, state)`` after each committed transition (and each
insert); that call only notes the newest state and wakes one writer task, so a local
create, suspend or destroy never waits on etcd and never fails because of it. The writer
sends each noted change through ``Ownership`` (compare-and-set, the owner's lease guard),
each write bounded by ``timeout``; a write that fails stays noted and is tried again
after a back-off, always with the newest state (intermediate states are skipped: only
the latest matters to a router). So after an etcd hiccup the record lags the truth until
etcd answers again; while it lags, other hosts route by the older record (it still names
this host, so requests still come here) or, for a sandbox created meanwhile, do not know
it yet (they answer 404 until the record lands).

A suspend clears the record's snapshot location (gateway.cluster.shipper names the new
one once it is uploaded). A record held by another host (moved away: its generation went
up) is never overwritten: the change is dropped and logged. DESTROYED deletes the record.

**A record we published that is gone.** Only an owner deletes its record, so a live local
sandbox whose record is absent either never had one (created while etcd did not answer:
it is created now) or had one that its new owner deleted after the sandbox was moved away
while this host was down or cut off (the tenant deleted it there). The host remembers,
durably (``landed``: the registry's ``published`` table), each sandbox whose record it has
seen in etcd naming it (a create or update that succeeded, or a read that found it); for
such a sandbox an absent record means the second case, and the local copy is destroyed
(``discard``), never published again. ``plan`` is that decision, with no I/O.

**An etcd that went back in time never destroys anything.** A wiped etcd (or one restored
from an older backup) also lacks records this host published. Each mark therefore carries
the fleet epoch (``{prefix}/epoch``, a random token written once, when etcd has none) and the
revision at which etcd showed the record. An absent record discards the copy only when
etcd, read at once with its epoch (``Ownership.look``), holds the mark's epoch and a
revision no lower than the mark's and than any this host has seen under that epoch.
Otherwise etcd lost data: the record is created again (``REPUBLISH``), an error is logged
once per epoch, and if etcd went back but kept its epoch (a restore), the epoch is renewed,
so every host's older marks stop counting, even after etcd's revision has grown past them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.cluster.errors import ClusterError, OwnershipConflict
from gateway.cluster.ownership import Ownership, Versioned
from gateway.cluster.records import SandboxRecord
from gateway.cluster import tasks
from gateway.sandbox.states import State
from gateway.store.feed import Transition

log = logging.getLogger(__name__)
# A record entering these loses its snapshot location: until the shipper names the new
# upload, the reaper must not restore an older snapshot of a newer suspend.
_SUSPENDING = frozenset({State.SUSPENDING, State.SUSPENDED})


class Step(enum.Enum):
    CREATE = "create"    # no record, never published: created (e.g. made during an outage)
    UPDATE = "update"    # our record, another state
    CONFIRM = "confirm"  # our record, as it should be: nothing to write
    DELETE = "delete"    # destroyed here, our record still there
    NOTHING = "nothing"  # destroyed here, no record
    LEAVE = "leave"      # another host holds it: never written (the adopter evicts our copy)
    DISCARD = "discard"  # published once, now absent: deleted by its new owner; destroy ours
    REPUBLISH = "republish"  # published once, absent because etcd lost data: create again


@dataclass(frozen=True)
class Mark:
    """This host saw its record in etcd under fleet ``epoch`` at ``revision``, when etcd's
    raft term was ``term`` (0: not known)."""

    epoch: str
    revision: int
    term: int = 0


@dataclass(frozen=True)
class Seen:
    """What etcd showed with the absent record, in one read: its fleet epoch (None: none,
    etcd was wiped), revision and raft term, and the highest revision and term this host
    has seen from etcd under the epoch it knows (``high_water``, ``high_term``)."""

    epoch: str | None
    revision: int
    high_water: int = 0
    term: int = 0
    high_term: int = 0


def went_back(mark: Mark, seen: Seen) -> bool:
    """(No I/O.) Is etcd older than what this host saw (wiped, replaced or restored)? A
    restore keeps the epoch key and may even bump the revision past all we saw
    (``etcdutl snapshot restore --bump-revision``), but starts a new raft log: its term
    starts low again."""
    return seen.epoch is None or seen.epoch != mark.epoch or not mark.epoch \
        or seen.revision < max(mark.revision, seen.high_water) \
        or 0 < seen.term < max(mark.term, seen.high_term)


def plan(me: str, state: State, current: SandboxRecord | None, mark: Mark | None,
         seen: Seen | None = None) -> Step:
    """(No I/O.) What a local ``state`` does to the record etcd holds (``current``, read
    fresh), given where this host saw its record before (``mark``: None, never) and, for a
    published one found absent, what etcd showed with it (``seen``: None, not looked yet,
    so never a discard)."""
    if current is not None and current.host != me:
        return Step.LEAVE
    if state is State.DESTROYED:
        return Step.NOTHING if current is None else Step.DELETE
    if current is None:
        if mark is None:
            return Step.CREATE
        return Step.REPUBLISH if seen is None or went_back(mark, seen) else Step.DISCARD
    return Step.CONFIRM if current.state is state else Step.UPDATE


class Publisher:
    def __init__(self, ownership: Ownership, host: str, lease: Callable[[], int], *,
                 timeout: float = 5.0, backoff: float = 1.0) -> None:
        self.ownership, self.host, self.lease = ownership, host, lease
        self.timeout, self.backoff = timeout, backoff
        self._pending: dict[str, State] = {}
        self._known: dict[str, Versioned] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failures = 0
        # Whose a sandbox is and its shape (the app wires the registry's row): named in
        # the record when it is created, so a host the reaper gives it to can register it
        # even if nothing of it was shipped (gateway.cluster.reaper).
        self.describe: Callable[[str], dict[str, Any]] = lambda sandbox_id: {}
        # The durable memory of which sandboxes' records etcd has held naming this host
        # (the app wires the registry's ``published`` table; until then nothing is
        # remembered), and what destroys a local copy whose record its new owner deleted
        # (the node wires the adopter's ``discard``). ``discard`` must not block.
        # A mark is (fleet epoch, revision) (``Mark``); ``was_published`` answers one or None.
        self.landed: Callable[[str, Mark], None] | None = None
        self.was_published: Callable[[str], tuple[Any, ...] | None] = lambda sandbox_id: None
        self.discard: Callable[[str], None] = lambda sandbox_id: None
        self._marked: dict[str, Mark] = {}
        self.discarded: list[str] = []
        # The fleet epoch this host knows (read or written before its first write) and the
        # highest store revision etcd has answered it under that epoch.
        self.epoch: str | None = None
        self.high_water = self.high_term = 0
        self.republished: list[str] = []
        # Every local sandbox and its state (the node wires its ``local``): noted again when
        # the epoch changes, so each one is marked anew under it.
        self.relist: Callable[[], Iterable[tuple[str, State]]] = list
        self._lost_logged: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"cluster-publisher:{self.host}")

    def changed(self, sandbox_id: str, state: State) -> None:
        """Note a local change (never blocks, never raises for etcd's sake)."""
        self._pending.pop(sandbox_id, None)
        self._pending[sandbox_id] = state  # re-inserted: written after older notes
        self._wake.set()

    def heard(self, transition: Transition) -> None:
        """A registry listener: note the state a committed transition left."""
        self.changed(transition.sandbox_id, State(transition.to_state))

    def sync(self, sandboxes: Iterable[tuple[str, State]]) -> None:
        """Note every local sandbox (start-up, rejoin): the records then match the host."""
        for sandbox_id, state in sandboxes:
            self.changed(sandbox_id, state)
        self._known.clear()  # re-read: our lease (and maybe the records) changed

    @property
    def pending(self) -> int:
        return len(self._pending)

    def settled(self, sandbox_id: str) -> bool:
        """No local change of ``sandbox_id`` waits to be written: its record says its state."""
        return sandbox_id not in self._pending

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            failed = False
            for sandbox_id in list(self._pending):
                state = self._pending.get(sandbox_id)
                if state is None:
                    continue
                try:
                    await asyncio.wait_for(self._write(sandbox_id, state), self.timeout)
                except (ClusterError, TimeoutError) as exc:
                    self.failures += 1
                    failed = True
                    self._known.pop(sandbox_id, None)
                    log.warning("cluster: publishing %s (%s) failed, will retry: %s",
                                sandbox_id, state.value, exc or "timed out")
                    continue
                if self._pending.get(sandbox_id) is state:
                    del self._pending[sandbox_id]
            if failed:
                await asyncio.sleep(self.backoff)
                self._wake.set()

    async def _write(self, sandbox_id: str, state: State) -> None:
        if self.epoch is None:
            self._epoch_is(*await self.ownership.epoch())
        current = self._known.get(sandbox_id) or await self.ownership.get(sandbox_id)
        mark = None if state is State.DESTROYED else self._mark(sandbox_id)
        seen = None
        if current is None and mark is not None:  # gone: moved and deleted, or etcd lost it?
            look = await self.ownership.look(sandbox_id)
            current = look.current
            same = look.epoch == self.epoch
            seen = Seen(look.epoch, look.revision, self.high_water if same else 0,
                        look.term, self.high_term if same else 0)
            if same:
                await self._saw(look.revision, look.term)
        step = plan(self.host, state, None if current is None else current.record, mark, seen)
        try:
            if step is Step.LEAVE:
                assert current is not None
                log.warning("cluster: %s is held by %s (gen %d): not publishing our %s",
                            sandbox_id, current.record.host, current.record.gen, state.value)
                self._known.pop(sandbox_id, None)
            elif step is Step.DISCARD:
                log.warning("cluster: %s was published by this host and its record is gone "
                            "(deleted by the host it moved to): destroying the local copy, "
                            "not publishing it again", sandbox_id)
                self._known.pop(sandbox_id, None)
                self.discarded.append(sandbox_id)
                self.discard(sandbox_id)
            elif step is Step.NOTHING:
                self._known.pop(sandbox_id, None)
            elif step is Step.DELETE:
                assert current is not None
                await self.ownership.delete(current, self.lease())
                self._known.pop(sandbox_id, None)
            elif step in (Step.CREATE, Step.REPUBLISH):
                if step is Step.REPUBLISH:
                    assert mark is not None
                    await self._lost(sandbox_id, mark, seen)
                record = SandboxRecord(sandbox_id, self.host, state, **self._described(sandbox_id))
                created = await self.ownership.create(record, self.lease())
                self._known[sandbox_id] = created
                await self._saw(created.mod_revision)
                self.held(sandbox_id, created.mod_revision)
                if step is Step.REPUBLISH:
                    self.republished.append(sandbox_id)
            elif step is Step.UPDATE:
                assert current is not None
                changes: dict[str, object] = {"state": state}
                if state in _SUSPENDING and current.record.state not in _SUSPENDING:
                    changes["snapshot"] = ""  # the shipped one is older than this suspend
                if current.record.reason and state is not State.FAILED:
                    changes["reason"] = ""  # why it failed once: no longer true
                if not current.record.tenant:  # a record from before tenants were named
                    changes |= self._described(sandbox_id)
                updated = await self.ownership.update(current, self.lease(), **changes)
                self._known[sandbox_id] = updated
                await self._saw(updated.mod_revision)
                self.held(sandbox_id, updated.mod_revision)
            else:
                assert current is not None
                self._known[sandbox_id] = current
                self.held(sandbox_id, current.mod_revision)
        except OwnershipConflict:
            self._known.pop(sandbox_id, None)  # read again on the retry
            raise

    def _mark(self, sandbox_id: str) -> Mark | None:
        if sandbox_id in self._marked:
            return self._marked[sandbox_id]
        try:
            found = self.was_published(sandbox_id)
            return None if found is None else Mark(str(found[0]), *map(int, found[1:3]))
        except Exception:  # a registry that cannot answer: publish rather than destroy
            log.exception("cluster: was %s published?", sandbox_id)
            return None

    def _epoch_is(self, epoch: str, revision: int, term: int = 0) -> None:
        if epoch != self.epoch:
            old, self.epoch, self.high_water, self.high_term = self.epoch, epoch, revision, term
            if old is not None:  # marks under the old epoch no longer count: mark all anew
                try:
                    self.sync(self.relist())
                except Exception:
                    log.exception("cluster: listing the local sandboxes to mark them anew")
        self.high_water = max(self.high_water, revision)
        self.high_term = max(self.high_term, term)

    async def _saw(self, revision: int, term: int = 0) -> None:
        """etcd answered at store ``revision`` and raft ``term`` (0: not known) under the
        epoch we know: lower than before means it went back (restored from an older backup,
        same epoch): renew the epoch at once, before its revision can grow past ours."""
        if revision < self.high_water:
            why = f"its revision went back from {self.high_water} to {revision}"
        elif 0 < term < self.high_term:
            why = f"its raft term went back from {self.high_term} to {term}"
        else:
            self.high_water, self.high_term = revision, max(self.high_term, term)
            return
        self._epoch_is(*await self.ownership.epoch(replace=self.epoch))
        self._log_lost(why)

    async def _lost(self, sandbox_id: str, mark: Mark, seen: Seen | None) -> None:
        """``sandbox_id``'s record is gone because etcd lost data: learn (or write) the
        epoch of the etcd we now talk to; say so once per epoch."""
        if seen is None:
            return
        if seen.epoch is None:  # wiped: write a first epoch (or read the one a peer wrote)
            self._epoch_is(*await self.ownership.epoch())
            why = "it holds no fleet epoch (wiped or replaced)"
        elif seen.epoch == mark.epoch:  # same epoch, older revision: restored from a backup
            self._epoch_is(*await self.ownership.epoch(replace=seen.epoch))
            why = f"revision {seen.revision}, raft term {seen.term}: older than this host saw"
        else:  # another host renewed it already, or the mark predates epochs
            self._epoch_is(seen.epoch, seen.revision, seen.term)
            why = "its fleet epoch changed" if mark.epoch else "marked before fleet epochs"
        log.warning("cluster: %s was published by this host and its record is missing "
                    "because etcd lost data (%s): publishing it again", sandbox_id, why)
        if mark.epoch:
            self._log_lost(why)

    def _log_lost(self, why: str) -> None:
        if self.epoch in self._lost_logged:
            return
        self._lost_logged.add(self.epoch or "")
        log.error("cluster: etcd lost data (%s): it was wiped, replaced or restored from an "
                  "older backup. This host destroys none of its sandboxes for it: each one "
                  "whose record is missing is published again (fleet epoch now %s)",
                  why, self.epoch)

    def held(self, sandbox_id: str, revision: int = 0) -> None:
        """etcd holds a record of it naming this host (our write succeeded, or the route
        cache saw one: a sandbox moved here by a drain or the reaper) at ``revision`` (0:
        unknown, the highest seen): remember that, durably, once per fleet epoch."""
        if self.landed is None or self.epoch is None:
            return  # the publisher marks it when it writes it (after learning the epoch)
        known = self._mark(sandbox_id)  # ours, or the registry's (from an earlier run)
        if known is not None and known.epoch == self.epoch:
            self._marked[sandbox_id] = known
            return
        mark = Mark(self.epoch, revision or self.high_water, self.high_term)
        try:
            self.landed(sandbox_id, mark)
        except Exception:
            log.exception("cluster: remembering that %s was published", sandbox_id)
            return
        self._marked[sandbox_id] = mark

    def _described(self, sandbox_id: str) -> dict[str, Any]:
        """The record's tenant, template and shape, from ``describe`` (never raises)."""
        try:
            found = self.describe(sandbox_id)
        except Exception:
            log.exception("cluster: describing %s", sandbox_id)
            return {}
        out: dict[str, Any] = {}
        for name, kind in (("tenant", str), ("template", str), ("vcpus", int),
                           ("memory_mib", int), ("disk_mib", int)):
            value = found.get(name)
            if isinstance(value, kind) and not isinstance(value, bool) and \
                    (len(value) <= 128 if isinstance(value, str) else value >= 0):
                out[name] = value
        return out

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await tasks.stop(task)
