"""Records moved to this host become local sandboxes; local copies of moved ones go.

The route cache calls ``consider`` with every sandbox record that changed (and ``scan``
with all of them after a listing: start-up, rejoin, relist). ``decide`` (no I/O) says:

- **adopt**: the record names this host, SUSPENDED with a shipped snapshot, and the
  registry has no row for it (or only the DESTROYED row of an eviction): a reaper (or a
  drain) moved it here. The snapshot is fetched and registered by the sandbox layer
  (gateway.sandbox.adoption, through the ``local`` callables the app wires). The same
  for a record FAILED with a reason (the reaper moved it here off a dead host, its
  memory lost): registered FAILED with only its snapshot's disk (a request cold-boots
  it), or with nothing if it has no snapshot or the fetch fails (a request is answered
  ``sandbox_lost``), so its owner sees why and can delete it;
- **evict**: the record names another host while this host has a live local copy: it was
  moved while this host was cut off or down (its gen went up), so the local copy must not
  serve (or be republished): it is destroyed (VMM, namespace, files);
- nothing otherwise.

At most ``max_adoptions`` run at once, one per sandbox. An adoption that fails for a
reason a retry cannot fix (a corrupt or foreign snapshot, no golden of its base, no slot)
marks the record FAILED with the reason, by compare-and-set under this host's lease, and
registers it here FAILED with nothing; the shipped snapshot stays in the object store
(nothing deletes it). An object store that
does not answer is retried (``retries``, with back-off) before that. ``adopt(record)``
is the same work for a caller that moved a record itself (drain) and wants the outcome.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.cluster.errors import ClusterError
from gateway.cluster.objstore import ObjectStoreError
from gateway.cluster.ownership import Ownership
from gateway.cluster.records import MAX_REASON, SandboxRecord
from gateway.cluster.shipping import Store, fetch
from gateway.sandbox.states import State

log = logging.getLogger(__name__)


class Do(enum.Enum):
    ADOPT = "adopt"
    EVICT = "evict"


def decide(me: str, record: SandboxRecord, local: State | None, adoptable: bool) -> Do | None:
    """(No I/O.) ``local``: the state of this host's row for it (None: no live row);
    ``adoptable``: the registry would take it (gateway.sandbox.adoption.adoptable)."""
    if record.host == me:
        if local is not None or not adoptable:
            return None
        if record.state is State.SUSPENDED and record.snapshot:
            return Do.ADOPT
        if record.state is State.FAILED and record.reason:  # the reaper's, or an adoption's
            return Do.ADOPT
        return None
    if local is not None and local is not State.DESTROYED:
        return Do.EVICT
    return None


@dataclass
class Local:
    """What the adopter needs of this host's sandbox layer (the app wires it)."""

    state: Callable[[str], State | None]  # the live row's state, None: none
    adoptable: Callable[[str], bool]
    # adopt(sandbox_id, fetch, base, from_host): gateway.sandbox.adoption.adopt
    adopt: Callable[..., Awaitable[Any]]
    evict: Callable[[str, str], Awaitable[bool]]  # (sandbox_id, holder)
    bases: Callable[[], Collection[str]]  # the base identities this host holds
    # destroy a published copy whose record its new owner deleted (gateway.cluster.publisher)
    discard: Callable[[str], Awaitable[bool]] | None = None


class Adopter:
    def __init__(self, host: str, store: Store | None, ownership: Ownership,
                 lease: Callable[[], int], local: Local | None = None, *,
                 max_adoptions: int = 2, retries: int = 3, backoff: float = 1.0) -> None:
        self.host, self.store, self.ownership, self.lease = host, store, ownership, lease
        self.local = local
        self.retries, self.backoff = retries, backoff
        self._gate = asyncio.Semaphore(max_adoptions)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._adopting: set[str] = set()
        self.busy: set[str] = set()  # sandboxes another part moves (a drain): left alone
        self.adopted: list[str] = []
        self.evicted: list[str] = []
        self.failed: dict[str, str] = {}

    def scan(self, records: Iterable[SandboxRecord]) -> None:
        for record in list(records):
            self.consider(record)

    def consider(self, record: SandboxRecord) -> None:
        """A record changed (never blocks, never raises)."""
        local = self.local
        if local is None or record.id in self._tasks or record.id in self.busy:
            return
        try:
            state = local.state(record.id)
            what = decide(self.host, record, state,
                          state is None and record.host == self.host
                          and local.adoptable(record.id))
        except Exception:
            log.exception("cluster: considering %s", record.id)
            return
        if what is None:
            return
        work = self._adopt_or_fail(record) if what is Do.ADOPT else self._evict(record)
        task = asyncio.create_task(work, name=f"{what.value}:{record.id}")
        self._tasks[record.id] = task
        if what is Do.ADOPT:
            self._adopting.add(record.id)
        task.add_done_callback(lambda t, s=record.id: self._done(s, t))

    def discard(self, sandbox_id: str) -> None:
        """Destroy the local copy of ``sandbox_id``: this host had published it and its
        record is gone (deleted by the host it moved to). Never blocks; a sandbox a drain
        is moving, or one already being worked on, is left alone (the next sync asks again)."""
        local = self.local
        if local is None or local.discard is None or sandbox_id in self._tasks \
                or sandbox_id in self.busy:
            return
        task = asyncio.create_task(self._discard(local.discard, sandbox_id),
                                   name=f"discard:{sandbox_id}")
        self._tasks[sandbox_id] = task
        task.add_done_callback(lambda t, s=sandbox_id: self._done(s, t))

    async def _discard(self, discard: Callable[[str], Awaitable[bool]], sandbox_id: str) -> None:
        if await discard(sandbox_id):
            self.evicted.append(sandbox_id)

    def _done(self, sandbox_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(sandbox_id) is task:
            del self._tasks[sandbox_id]
            self._adopting.discard(sandbox_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("cluster: %s: %s", task.get_name(), task.exception())

    def adopting(self, sandbox_id: str) -> bool:
        """Is an adoption of ``sandbox_id`` under way (routing answers 503, not 404)?"""
        return sandbox_id in self._adopting

    @property
    def working(self) -> int:
        return len(self._tasks)

    async def adopt(self, record: SandboxRecord, failed: str | None = None) -> Any:
        """Fetch ``record``'s snapshot and register it here (raises what went wrong; an
        unreachable object store is retried first). Returns the registry row. ``failed``:
        registered FAILED with that reason and only the snapshot's disk."""
        assert self.local is not None, "the app wires the sandbox layer first"
        local = self.local

        store = self.store
        if store is None:
            raise ClusterError("this host has no object store configured to fetch it from")

        async def fetched(dest: Path) -> tuple[str, dict[str, Any]]:
            index = await fetch(store, record.snapshot, dest, base=local.bases())
            return index.base, index.meta

        async with self._gate:
            for attempt in range(self.retries + 1):
                try:
                    return await local.adopt(record.id, fetched, base=record.base,
                                             from_host=f"the object store ({record.snapshot})",
                                             failed=failed)
                except ObjectStoreError as exc:
                    if attempt == self.retries:
                        raise
                    log.warning("cluster: adopting %s: %s; retrying", record.id, exc)
                    await asyncio.sleep(self.backoff * 2 ** attempt)

    async def _adopt_or_fail(self, record: SandboxRecord) -> None:
        failed = record.reason if record.state is State.FAILED else None
        if record.snapshot:
            try:
                await self.adopt(record, failed)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = f"adoption by {self.host} failed: {exc}"
                if failed is not None:
                    reason = f"{failed}; but {reason}"
                reason = reason[:MAX_REASON]
                self.failed[record.id] = reason
                log.error("cluster: %s: %s (its snapshot stays at %s)", record.id, reason,
                          record.snapshot)
                if failed is None and not await self._mark_failed(record, reason):
                    return
                await self._register_lost(record, reason)
                return
            self.adopted.append(record.id)
            return
        await self._register_lost(record, record.reason)

    async def _register_lost(self, record: SandboxRecord, reason: str) -> None:
        """Register it FAILED with nothing (its owner sees ``reason`` and can delete it)."""
        assert self.local is not None
        meta = {"tenant": record.tenant, "template": record.template, "vcpus": record.vcpus,
                "memory_mib": record.memory_mib, "disk_mib": record.disk_mib}
        try:
            await self.local.adopt(record.id, None, base=record.base, failed=reason,
                                   meta=meta, from_host="the fleet (nothing to restore)")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("cluster: %s cannot be registered here even as lost: %s", record.id, exc)
            self.failed[record.id] = f"{reason}; not registered: {exc}"[:MAX_REASON]
            return
        self.adopted.append(record.id)

    async def _mark_failed(self, record: SandboxRecord, reason: str) -> bool:
        """FAILED with ``reason``, only if the record is still the one we were given."""
        try:
            current = await self.ownership.get(record.id)
            if current is None or (current.record.host, current.record.gen, current.record.state) \
                    != (self.host, record.gen, State.SUSPENDED):
                return False
            await self.ownership.update(current, self.lease(), state=State.FAILED, reason=reason)
        except ClusterError as exc:
            log.warning("cluster: marking %s FAILED: %s", record.id, exc)
            return False
        return True

    async def _evict(self, record: SandboxRecord) -> None:
        assert self.local is not None
        if await self.local.evict(record.id, record.host):
            self.evicted.append(record.id)

    async def aclose(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)
