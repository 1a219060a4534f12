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
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterable
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


def plan(me: str, state: State, current: SandboxRecord | None, published: bool) -> Step:
    """(No I/O.) What a local ``state`` does to the record etcd holds (``current``, read
    fresh), given whether this host has seen its record in etcd before (``published``)."""
    if current is not None and current.host != me:
        return Step.LEAVE
    if state is State.DESTROYED:
        return Step.NOTHING if current is None else Step.DELETE
    if current is None:
        return Step.DISCARD if published else Step.CREATE
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
        self.landed: Callable[[str], None] | None = None
        self.was_published: Callable[[str], bool] = lambda sandbox_id: False
        self.discard: Callable[[str], None] = lambda sandbox_id: None
        self._marked: set[str] = set()
        self.discarded: list[str] = []

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
        current = self._known.get(sandbox_id) or await self.ownership.get(sandbox_id)
        step = plan(self.host, state, current and current.record,
                    state is not State.DESTROYED and self._published(sandbox_id))
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
            elif step is Step.CREATE:
                record = SandboxRecord(sandbox_id, self.host, state, **self._described(sandbox_id))
                self._known[sandbox_id] = await self.ownership.create(record, self.lease())
                self.held(sandbox_id)
            elif step is Step.UPDATE:
                assert current is not None
                changes: dict[str, object] = {"state": state}
                if state in _SUSPENDING and current.record.state not in _SUSPENDING:
                    changes["snapshot"] = ""  # the shipped one is older than this suspend
                if current.record.reason and state is not State.FAILED:
                    changes["reason"] = ""  # why it failed once: no longer true
                if not current.record.tenant:  # a record from before tenants were named
                    changes |= self._described(sandbox_id)
                self._known[sandbox_id] = await self.ownership.update(
                    current, self.lease(), **changes)
                self.held(sandbox_id)
            else:
                assert current is not None
                self._known[sandbox_id] = current
                self.held(sandbox_id)
        except OwnershipConflict:
            self._known.pop(sandbox_id, None)  # read again on the retry
            raise

    def _published(self, sandbox_id: str) -> bool:
        if sandbox_id in self._marked:
            return True
        try:
            return self.was_published(sandbox_id)
        except Exception:  # a registry that cannot answer: publish rather than destroy
            log.exception("cluster: was %s published?", sandbox_id)
            return False

    def held(self, sandbox_id: str) -> None:
        """etcd holds a record of it naming this host (our write succeeded, or the route
        cache saw one: a sandbox moved here by a drain or the reaper): remember that,
        durably, once."""
        if sandbox_id in self._marked or self.landed is None:
            return
        try:
            self.landed(sandbox_id)
        except Exception:
            log.exception("cluster: remembering that %s was published", sandbox_id)
            return
        self._marked.add(sandbox_id)

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
