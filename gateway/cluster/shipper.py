"""Upload each local sandbox's snapshot when it reaches SUSPENDED, then name it in the record.

A registry listener (``heard``) like the publisher: a transition to SUSPENDED starts
one upload task for that sandbox, any other transition of it cancels its upload (it woke:
the snapshot is being consumed, a newer suspend will ship a newer one). So a newer suspend
always supersedes an older upload, and at most ``max_uploads`` sandboxes upload at once.

After every file and the index are in the store, the record gains the location by a
compare-and-set under this host's lease, once the record says SUSPENDED (the publisher's
write may lag) and never if another host holds it.
Failures are retried by shipping.upload per file; a snapshot that still cannot be shipped
is logged and stays local only (the reaper counts it lost if this host dies).

What is shipped is the caller's choice (``describe_local``, from the sandbox layer: the
snapshot's directory, its file names, the disk's base identity and the metadata).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cluster.errors import ClusterError
from gateway.cluster.ownership import Ownership
from gateway.cluster.shipping import Index, Store, describe, plan_upload, upload
from gateway.sandbox.states import State
from gateway.store.feed import Transition

if TYPE_CHECKING:
    from gateway.store.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalSnapshot:
    directory: Path
    names: list[str]
    base: str
    meta: dict[str, Any] = field(default_factory=dict)


class Shipper:
    def __init__(self, store: Store, ownership: Ownership, host: str,
                 lease: Callable[[], int],
                 describe_local: Callable[[str], Awaitable[LocalSnapshot | None]], *,
                 key_prefix: str, concurrency: int = 2, max_uploads: int = 2) -> None:
        self.store, self.ownership, self.host, self.lease = store, ownership, host, lease
        self.describe_local, self.key_prefix = describe_local, key_prefix
        self.concurrency = concurrency
        self.record_attempts, self.retry_every = 30, 1.0
        self._gate = asyncio.Semaphore(max_uploads)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.shipped: dict[str, str] = {}  # sandbox id -> location recorded
        self.failures = 0

    def heard(self, transition: Transition) -> None:
        """A registry listener: never blocks, never raises."""
        sandbox_id = transition.sandbox_id
        old = self._tasks.pop(sandbox_id, None)
        if old is not None:
            old.cancel()
        # An insert as SUSPENDED is an adoption (gateway.cluster.adopter): its snapshot is
        # already in the store, named in the record.
        if State(transition.to_state) is State.SUSPENDED and transition.from_state is not None:
            task = asyncio.create_task(self._ship(sandbox_id), name=f"ship:{sandbox_id}")
            self._tasks[sandbox_id] = task
            task.add_done_callback(lambda t, s=sandbox_id: self._done(s, t))

    def _done(self, sandbox_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(sandbox_id) is task:
            del self._tasks[sandbox_id]
        if not task.cancelled() and task.exception() is not None:
            self.failures += 1
            exc = task.exception()
            while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
                exc = exc.exceptions[0]  # the upload's TaskGroup: say what failed
            log.warning("cluster: shipping %s failed, it stays local only: %s",
                        sandbox_id, exc)

    async def _ship(self, sandbox_id: str) -> None:
        async with self._gate:
            local = await self.describe_local(sandbox_id)
            if local is None:
                return
            held: dict[str, bytes] = {}
            files = await describe(local.directory, local.names, held)
            plan = plan_upload(self.key_prefix,
                               Index(sandbox_id, local.base, files, local.meta))
            location = await upload(self.store, plan, local.directory,
                                    concurrency=self.concurrency, held=held)
        await self._record(sandbox_id, location, recorded(local))

    async def _record(self, sandbox_id: str, location: str,
                      extra: dict[str, Any] | None = None) -> None:
        """Name ``location`` in the record (with ``extra``: the base and shape the reaper
        places it by). This task still running means the sandbox is still SUSPENDED here
        (any other transition cancels it), so a record that says otherwise lags (the
        publisher's write is pending): wait for it, bounded."""
        for _ in range(self.record_attempts):
            current = await self.ownership.get(sandbox_id)
            if current is not None and current.record.host != self.host:
                log.info("cluster: %s is held by %s; its snapshot is not recorded",
                         sandbox_id, current.record.host)
                return
            if current is None or current.record.state is not State.SUSPENDED:
                await asyncio.sleep(self.retry_every)
                continue
            try:
                await self.ownership.update(current, self.lease(), snapshot=location,
                                            **(extra or {}))
            except ClusterError as exc:
                log.info("cluster: recording %s's snapshot: %s; reading again", sandbox_id, exc)
                await asyncio.sleep(self.retry_every)
                continue
            self.shipped[sandbox_id] = location
            return
        raise ClusterError(f"could not record {sandbox_id}'s snapshot")

    @property
    def uploading(self) -> int:
        return len(self._tasks)

    async def aclose(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)


def recorded(local: LocalSnapshot) -> dict[str, Any]:
    """What the sandbox's etcd record carries beside the location: the base identity and
    the shape (from the metadata), so the reaper needs no object-store read to place it,
    whose it is, and when the snapshot was made (the reaper's reason names it)."""
    out: dict[str, Any] = {"base": local.base if re.fullmatch(r"[0-9a-f]{64}", local.base)
                           else ""}
    for name in ("vcpus", "memory_mib", "disk_mib"):
        value = local.meta.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[name] = value
    for name in ("tenant", "template"):
        value = local.meta.get(name)
        if isinstance(value, str) and 0 < len(value) <= 128:
            out[name] = value
    at = local.meta.get("suspended_at")
    if isinstance(at, (int, float)) and not isinstance(at, bool) and 0 < at < 1e11:
        out["snapshot_at"] = float(at)
    return out


def from_registry(registry: Registry) -> Callable[[str], Awaitable[LocalSnapshot | None]]:
    """``describe_local`` for the daemon: the sandbox's row and its snapshot directory, as
    the sandbox layer lays them out (gateway.sandbox.shipped)."""
    from gateway.sandbox.shipped import describe_suspended

    async def describe_local(sandbox_id: str) -> LocalSnapshot | None:
        rec = registry.get(sandbox_id)
        found = await asyncio.to_thread(describe_suspended, rec) if rec else None
        return None if found is None else LocalSnapshot(found.directory, found.names,
                                                        found.base, found.meta)
    return describe_local
