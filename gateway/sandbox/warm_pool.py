"""The warm pool: per template, K sandboxes already restored and paused, so that a create
only claims one.

Theory of operation
-------------------
A pool member is an ordinary sandbox row owned by the daemon (tenant ``POOL_TENANT``, which
no API key can be): created from the golden snapshot like any sandbox (its own id, network
slot, disk layer and fresh entropy), then PAUSED with ``idle_timeout`` 0, so it uses no CPU
and is never snapshotted. The core's tables cover it like any sandbox: a daemon crash
re-adopts it (RECOVERY), and at start-up ``adopt`` keeps the members that came back RUNNING
or PAUSED from the current golden snapshot and destroys the others.

``POST /v1/sandboxes`` claims one: the tenant's quota is checked as for a create, the row
is given its tenant, metadata, idle timeout and creation time (one registry write: from
then on it is the tenant's sandbox), then woken like any paused sandbox, which sets the
guest clock and reseeds its CRNG with fresh bytes (``Machine.unpause``). Members never
count against a tenant.

Refill runs in the background, one create at a time, only while no other sandbox is being
created, restored or cold-booted (the foreground goes first), and only while the host has
room (``max_sandboxes``, ``pause_min_available_mib``). The daemon destroys its members when
it stops (bounded); members left by a crash are re-adopted at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.sandbox import core as c
from gateway.sandbox import pause_policy
from gateway.tenancy import quotas
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord

if TYPE_CHECKING:
    from gateway.sandbox.service import SandboxService

log = logging.getLogger(__name__)

POOL_TENANT = "@pool"  # not a key id (key_<hex>): no tenant sees or counts these rows
REFILL_POLL_S = 0.5
STOP_TIMEOUT_S = 20.0
FOREGROUND_OPS = (c.Op.CREATE, c.Op.RESTORE, c.Op.COLD_BOOT)  # refill waits while one runs
# Set while a create runs: whether it claimed a pooled sandbox (for a response header).
claimed: contextvars.ContextVar[bool] = contextvars.ContextVar("pool_claimed", default=False)


def auto_size(mem_total_mib: int | None, templates: int) -> int:
    """Members per template when ``[pool] size`` is -1: one per 8 GiB of host RAM shared
    out over the templates, at most 4, at least 1 on hosts with 8 GiB or more."""
    if not mem_total_mib or templates < 1:
        return 0
    return max(0, min(4, mem_total_mib // 8192 // templates)) or (1 if mem_total_mib >= 8192
                                                                   else 0)


def refill_choice(members: Mapping[str, int], target: int, foreground_busy: bool,
                  host_room: bool) -> str | None:
    """The template to add a member to now (the emptiest), or None (no I/O)."""
    if target <= 0 or foreground_busy or not host_room:
        return None
    short = [(n, t) for t, n in members.items() if n < target]
    return min(short)[1] if short else None


def mem_total_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class WarmPool:
    def __init__(self, service: SandboxService, size: int) -> None:
        self.service = service
        self.size = size
        self._members: dict[str, list[str]] = {t: [] for t in service.goldens}
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.claims = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"<WarmPool size={self.size} {self.counts()}>"

    def counts(self) -> dict[str, int]:
        return {t: len(ids) for t, ids in self._members.items()}

    def _prune(self) -> None:
        """Drop members whose VM was lost (a crashed VMM: FAILED) and destroy them."""
        for ids in self._members.values():
            for sid in list(ids):
                ctl = self.service.known(sid)
                if ctl is None or ctl.state not in (State.PAUSED, State.RUNNING):
                    ids.remove(sid)
                    if ctl is not None:
                        self.service.spawn(self._discard(ctl.record, "pool member lost"),
                                           f"pool-discard-{sid}")

    # -- start / stop ----------------------------------------------------------------------

    async def adopt(self) -> None:
        """After start-up recovery: keep the members that are usable, destroy the others."""
        svc = self.service
        for rec in svc.registry.list(POOL_TENANT):
            golden = svc.goldens.get(rec.template)
            usable = rec.state in (State.RUNNING, State.PAUSED) and golden is not None \
                and rec.golden == str(golden.dir) and self.size > 0
            if usable:
                self._members[rec.template].append(rec.id)
                ctl = svc.controller(rec)
                if ctl.state is State.RUNNING:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(ctl.start_pause("warm pool member"))
            else:
                await self._discard(rec, "pool member not reusable after a restart")

    def start(self) -> None:
        """Adopt (or discard) members left by a previous daemon, then refill."""
        self._task = self.service.spawn(self._refill_loop(), "pool-refill")

    async def aclose(self) -> None:
        """Stop refilling and destroy the members (bounded)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        ids = [sid for ids in self._members.values() for sid in ids]
        self._members = {t: [] for t in self._members}
        recs = [r for r in (self.service.registry.get(sid) for sid in ids) if r is not None]
        if recs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(
                    *(self._discard(r, "daemon stopping") for r in recs),
                    return_exceptions=True), STOP_TIMEOUT_S)

    # -- claim ----------------------------------------------------------------------------

    async def claim(self, tenant: str, template: str, metadata: dict[str, Any],
                    idle_timeout: float,
                    extra: dict[str, Any] | None = None) -> SandboxRecord | None:
        """A pooled sandbox made the tenant's, awake; None if the pool has none ready.
        ``extra``: more registry fields of a new sandbox (e.g. its lifetimes)."""
        svc = self.service
        ctl = self._take(template)
        if ctl is None:
            self.misses += 1
            return None
        try:
            limits = svc.limits(tenant)
            quotas.check_create(tenant, limits, svc.tenant_usage(tenant, measure_disk=bool(
                limits.max_disk_mib)))
        except BaseException:
            self._members[template].insert(0, ctl.id)  # still the pool's
            raise
        now = time.time()
        svc.registry.update(ctl.id, tenant=tenant, metadata=metadata, idle_timeout=idle_timeout,
                            created_at=now, last_activity=now, **(extra or {}))
        ctl.refresh_record()
        self.claims += 1
        claimed.set(True)
        try:
            async with ctl.request():  # wakes it: cont, guest clock, fresh entropy (reseed)
                pass
        finally:
            self._wake.set()  # refill after the claim, not during it
        return ctl.record

    def _take(self, template: str) -> Any:
        """The first ready member (PAUSED, no operation), removed from the pool."""
        self._prune()
        ids = self._members.get(template, [])
        for sid in ids:
            ctl = self.service.known(sid)
            if ctl is not None and ctl.is_idle_paused:
                ids.remove(sid)
                return ctl
        return None

    def ready(self) -> dict[str, int]:
        """Members that a create can claim now, per template."""
        known = self.service.known
        return {t: sum(1 for sid in ids if (ctl := known(sid)) is not None
                       and ctl.is_idle_paused)
                for t, ids in self._members.items()}

    # -- refill ----------------------------------------------------------------------------

    async def _refill_loop(self) -> None:
        await self.adopt()
        if self.size <= 0:
            return
        while True:
            try:
                self._prune()
                template = refill_choice(self.counts(), self.size, self._foreground_busy(),
                                         self._host_room())
                if template is not None:
                    await self._add(template)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("warm pool refill failed: %s", exc)
                await asyncio.sleep(5)  # e.g. the host at its limit: do not spin
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), REFILL_POLL_S)

    def _foreground_busy(self) -> bool:
        return any(ctl.busy_with(FOREGROUND_OPS) for ctl in self.service.controllers()
                   if ctl.record.tenant != POOL_TENANT)

    def _host_room(self) -> bool:
        svc = self.service
        if len(svc.registry.used_slots()) >= svc.config.sandbox.max_sandboxes - 1:
            return False  # leave the last slot to a tenant's create
        floor = svc.config.sandbox.pause_min_available_mib
        available = pause_policy.mem_available_mib()
        return not floor or available is None or available >= floor

    async def _add(self, template: str) -> None:
        svc = self.service
        rec = svc.reserve(POOL_TENANT, template, svc.goldens[template], {}, 0.0)
        ctl = svc.controller(rec)
        try:
            await ctl.create()
            await asyncio.shield(ctl.start_pause("warm pool member"))
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._discard(ctl.record, "pool member failed"))
            raise
        if ctl.state is State.PAUSED:
            self._members[template].append(rec.id)

    async def _discard(self, rec: SandboxRecord, cause: str) -> None:
        svc = self.service
        ctl = svc.controller(rec)
        if ctl.state is not State.DESTROYED:
            await ctl.destroy(cause)
        svc.forget(rec.id)
