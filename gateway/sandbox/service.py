"""Sandbox service: tenant-scoped operations on sandboxes.

Policy lives here, in ``gateway.sandbox.controller`` (one per sandbox: wake on request,
suspend when idle) and in ``gateway.sandbox.states`` (the transition table);
mechanism in ``vmctl.Machine``; transport in ``gateway.http.sandbox_routes``.

VMM processes are deliberately *not* stopped when the daemon stops: they are
re-adopted on the next start (``gateway.sandbox.recovery``), so restarting or
upgrading the daemon never loses a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from gateway.sandbox import expiry, pause_policy, warm_pool, resources
from gateway.tenancy import quotas
from gateway.config import Config
from gateway.sandbox.controller import HoldCounter, SandboxController, Wake, WakePolicy
from gateway.builds.builtin import BuiltinBuilds
from gateway.errors import BadRequest, Conflict, SandboxMoved, SandboxNotFound, Unavailable
from gateway.sandbox.states import State
from gateway.sandbox.metrics import Metrics
from gateway.store.registry import Registry, SandboxRecord
from gateway.sandbox.disk_usage import tree_bytes
from gateway.sandbox.egress_policy import policy_of
from gateway.sandbox.shape_goldens import ShapeGoldens
from gateway.sandbox.machine_port import MachinePort
from gateway.templates.catalog import TemplateCatalog
from images.templates import ALIASES
from vmctl import network
from vmctl.backend import Backend
from vmctl.golden import BUILD_SLOTS, Golden, load_golden_dir
from vmctl.machine import Machine, MachinePlan

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 16 * 1024
IDLE_SCAN_S = 1.0
MAX_MOVED_REMEMBERED = 10_000  # sandboxes moved away whose requests are still redirected
# Set while a request runs: how long it waited for its sandbox to wake (for a response header).
current_wake: contextvars.ContextVar[Wake | None] = contextvars.ContextVar("wake", default=None)


class SandboxService:
    def __init__(self, config: Config, registry: Registry, backend: Backend,
                 goldens: dict[str, Golden], policy: WakePolicy | None = None) -> None:
        self.config = config
        self.registry = registry
        self.backend = backend
        self.goldens = goldens
        self.builtin_builds: BuiltinBuilds | None = None  # gateway.builds.builtin (set by app)
        vm = config.vm  # what the backend was selected with
        self.policy = policy or WakePolicy(
            suspend_after_pause=config.sandbox.suspend_after_pause,
            # a restore may fail at its limit and hand over to a cold boot: wait for both
            cold_boot_deadline=vm.restore_timeout + vm.ready_timeout + 10.0)
        self.holds = HoldCounter()
        self.metrics = Metrics()
        self._controllers: dict[str, SandboxController] = {}
        self._moved: dict[str, str] = {}  # sandbox id -> the host a drain moved it to
        self._tasks: set[asyncio.Task] = set()
        self._golden_cache: dict[str, Golden] = {str(g.dir): g for g in goldens.values()}
        # Served names and their aliases are reserved: no tenant template may take one.
        self.templates = TemplateCatalog(registry, config.server.data_dir / "templates", goldens,
                                         [*config.sandbox.templates, *ALIASES])
        self._idle_task: asyncio.Task | None = None
        size = config.pool.size if config.pool.size >= 0 else \
            warm_pool.auto_size(warm_pool.mem_total_mib(), len(goldens))
        self.pool = warm_pool.WarmPool(self, size)
        self._expiry_task: asyncio.Task | None = None
        self.run_id: int | None = None  # this daemon's row in daemon_runs (gateway.tenancy.usage)
        self.shapes = ShapeGoldens(backend, goldens, self.spawn)
        # [cluster] on: gateway.cluster.quota.FleetQuota.check (a key's limits over the fleet).
        self._claimed_slots: set[int] = set()  # claim_slot: taken before their row exists
        self.fleet_quota: Callable[[str, quotas.Limits, quotas.Usage], Awaitable[None]] | None \
            = None

    @property
    def sandboxes_dir(self) -> Path:
        return self.config.server.data_dir / "sandboxes"

    # -- queries -------------------------------------------------------------------

    def get(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        rec = self.registry.get(sandbox_id)
        if rec is None or rec.tenant != tenant or rec.state is State.DESTROYED:
            moved = self._moved.get(sandbox_id)
            if moved is not None and rec is not None and rec.tenant == tenant:
                raise SandboxMoved(sandbox_id, moved)  # forwarded by the routing middleware
            raise SandboxNotFound(sandbox_id)
        return rec

    def note_moved(self, sandbox_id: str, host: str) -> None:
        """The sandbox moved to ``host``: a request that still reaches this host for it
        (route caches lag) is forwarded there, not answered 404 (bounded memory)."""
        self._moved[sandbox_id] = host
        while len(self._moved) > MAX_MOVED_REMEMBERED:
            self._moved.pop(next(iter(self._moved)))

    def list(self, tenant: str) -> list[SandboxRecord]:
        return self.registry.list(tenant)

    # -- create / destroy / update ---------------------------------------------------

    async def create(self, tenant: str, template: str | None, metadata: dict[str, Any],
                     idle_timeout: float | None,
                     lifetime: expiry.Lifetimes | None = None,
                     egress: dict[str, Any] | None = None,
                     shape_request: resources.ShapeRequest | None = None) -> SandboxRecord:
        template, golden = self.resolve_template(
            tenant, template or self.config.sandbox.default_template)
        builtin = self.goldens.get(template) is golden
        shape = self.shape_for(tenant, template, shape_request or resources.ShapeRequest(),
                               golden)
        await self.make_room(tenant)  # at max_awake: snapshot one of its paused sandboxes
        # Checked before a possibly long golden build, and again (synchronously) by _reserve.
        limits = self.limits(tenant)
        quotas.check_create(tenant, limits, self.tenant_usage(tenant, bool(limits.max_disk_mib)),
                            self._counted_disk(golden, shape))
        if self.fleet_quota is not None:  # [cluster]: the key's sandboxes on every host
            await self.fleet_quota(tenant, limits, self.tenant_usage(tenant))
        times = expiry.at_create(lifetime or expiry.Lifetimes(), self.config.sandbox,
                                    time.time())
        if builtin and shape == resources.Shape(golden.vcpus, golden.mem_mib, golden.disk_mib):
            # The pool holds the built-in templates' default shapes only.
            claimed = await self.pool.claim(tenant, template, metadata,
                                            self.config.sandbox.idle_timeout
                                            if idle_timeout is None else idle_timeout, times)
            if claimed is not None:
                # Before the answer, so the tenant's first command already runs under its
                # policy (until then the guest ran only its agent, under the host default).
                return claimed if egress is None else await self.set_egress(
                    tenant, claimed.id, egress)
        if builtin:
            golden = await self.shapes.get(template, shape.vcpus, shape.memory_mib)
        elif (shape.vcpus, shape.memory_mib) != (golden.vcpus, golden.mem_mib):
            raise BadRequest(f"template {template!r} is a snapshot of {golden.vcpus} vCPU(s) and "
                             f"{golden.mem_mib} MiB: its sandboxes have that shape (a bigger "
                             "disk_mib is possible)", code="invalid_resources")
        rec = self.reserve(tenant, template, golden, metadata, idle_timeout, shape,
                            {**times, "egress": egress})
        ctl = self.controller(rec)
        # The creation runs detached: a client that disconnects does not leave a half-made VM.
        await ctl.create()
        return ctl.record

    def resolve_template(self, tenant: str, name: str) -> tuple[str, Golden]:
        """The template ``name`` means for ``tenant`` (an alias is its built-in's name; no
        tenant template may take one) and its golden; 503 while a built-in still builds."""
        if name not in self.goldens and name in ALIASES:
            name = ALIASES[name]
        if name not in self.goldens and self.builtin_builds is not None:
            self.builtin_builds.check(name)
        return name, self.templates.resolve(tenant, name)

    def shape_for(self, tenant: str, template: str, request: resources.ShapeRequest,
                  golden: Golden | None = None) -> resources.Shape:
        """The shape a create gets (gateway.sandbox.resources decides; 400/403 if refused).
        ``golden``: what the template resolved to (a tenant's template: its snapshot, whose
        limits are those of the built-in template it was made from)."""
        golden = golden or self.goldens[template]
        cfg, key = self.config.resources, self.limits(tenant)
        default = resources.Shape(golden.vcpus, golden.mem_mib, golden.disk_mib)
        shape = resources.resolve(request, default, cfg.for_template(golden.template),
                                  resources.ResourceLimits(key.max_vcpus, key.max_memory_mib,
                                                           key.max_sandbox_disk_mib),
                                  cfg.min_memory_mib)
        if shape.disk_mib > default.disk_mib and self.backend.driver_name == "firecracker":
            raise BadRequest("this host's VMM (firecracker) cannot grow a sandbox's disk yet",
                             code="invalid_resources")
        return shape

    @staticmethod
    def _counted_disk(golden: Golden, shape: resources.Shape) -> int:
        """The disk a create counts against max_disk_mib up front: a size asked for."""
        return shape.disk_mib if shape.disk_mib != golden.disk_mib else 0

    def reserve(self, tenant: str, template: str, golden: Golden, metadata: dict[str, Any],
                 idle_timeout: float | None,
                 shape: resources.Shape | None = None,
                 extra: dict[str, Any] | None = None) -> SandboxRecord:
        """Pick an id and a network slot and record the sandbox as CREATING (synchronous,
        so two concurrent creates can never take the same slot)."""
        limits = self.limits(tenant)
        shape = shape or resources.Shape(golden.vcpus, golden.mem_mib, golden.disk_mib)
        quotas.check_create(tenant, limits, self.tenant_usage(tenant, measure_disk=bool(
            limits.max_disk_mib)), self._counted_disk(golden, shape))
        slot = self._next_slot()
        sandbox_id = secrets.token_hex(8)
        now = time.time()
        rec = SandboxRecord(
            id=sandbox_id, tenant=tenant, template=template, state=State.CREATING, slot=slot,
            root=str(self.sandboxes_dir / sandbox_id), golden=str(golden.dir),
            idle_timeout=self.config.sandbox.idle_timeout if idle_timeout is None else idle_timeout,
            host=self.registry.host, created_at=now, updated_at=now, last_activity=now,
            metadata=metadata, vcpus=shape.vcpus, memory_mib=shape.memory_mib,
            disk_mib=shape.disk_mib, **(extra or {}))
        self.registry.insert_sandbox(rec)
        return rec

    def claim_slot(self) -> int:
        """Take a network slot before its sandbox's row exists (an adoption makes the
        namespace first: gateway.sandbox.adoption); ``release_slot`` once the row holds
        it, or on failure. Unavailable when none is free."""
        slot = self._next_slot()
        self._claimed_slots.add(slot)
        return slot

    def release_slot(self, slot: int) -> None:
        self._claimed_slots.discard(slot)

    def reserve_arrival(self, fields: dict[str, Any]) -> SandboxRecord:
        """Record a sandbox moving here from another host (gateway.sandbox.migration) as
        CREATING, with this host's slot and root; its id, tenant and shape are its own."""
        golden_dir = Path(fields["golden"])
        if not (golden_dir / "manifest.json").is_file():
            raise Conflict(f"this host does not have the sandbox's golden {golden_dir.name}",
                           code="conflict")
        if self.registry.get(fields["id"]) is not None:
            raise Conflict(f"sandbox {fields['id']} is already known here", code="conflict")
        slot = self._next_slot()
        now = time.time()
        rec = SandboxRecord(state=State.CREATING, slot=slot,
                            root=str(self.sandboxes_dir / fields["id"]), host=self.registry.host,
                            updated_at=now, last_activity=now, **fields)
        self.registry.insert_sandbox(rec)
        self.golden_for(rec)  # loadable, before any VMM starts
        return rec

    def _next_slot(self) -> int:
        """The slot a new row (or claim) takes: Unavailable at the host's sandbox limit or
        when the pool is exhausted. Synchronous: no two callers can get the same one."""
        used = self.registry.used_slots() | self._claimed_slots
        if len(used) >= self.config.sandbox.max_sandboxes:
            raise Unavailable(f"this host is at its limit of {self.config.sandbox.max_sandboxes} "
                              "sandboxes", code="sandbox_limit", headers={"Retry-After": "30"})
        slot = self._free_slot(used)
        if slot is None:
            raise Unavailable("network address pool exhausted", code="sandbox_limit")
        return slot

    def _free_slot(self, used: set[int]) -> int | None:
        """Lowest slot no sandbox of ours holds and whose host interface does not exist
        (another daemon on this host may be using the same pool)."""
        cfg = self.backend.config.network
        for index in range(cfg.capacity - BUILD_SLOTS):
            if index in used or network.slot_reserved(index, cfg):
                continue
            if not os.path.exists(f"/sys/class/net/{network.slot_for(index, '', cfg).host_if}"):
                return index
        return None

    async def destroy(self, tenant: str, sandbox_id: str) -> None:
        ctl = self.controller(self.get(tenant, sandbox_id))
        await ctl.destroy("deleted by API")
        self.forget(sandbox_id)
        self.templates.collect()  # a deleted template's files may have waited for this one

    def update(self, tenant: str, sandbox_id: str, idle_timeout: float | None,
               metadata: dict[str, Any] | None,
               lifetime: expiry.Lifetimes | None = None) -> SandboxRecord:
        rec = self.get(tenant, sandbox_id)
        changes: dict[str, Any] = expiry.at_update(lifetime or expiry.Lifetimes(),
                                                      self.config.sandbox, time.time())
        if idle_timeout is not None:
            changes["idle_timeout"] = idle_timeout
        if metadata is not None:
            changes["metadata"] = metadata
        if changes:
            self.registry.update(rec.id, **changes)
        return self.controller(self.registry.get(rec.id) or rec).refresh_record()

    # -- using a sandbox ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, tenant: str, sandbox_id: str) -> AsyncIterator[MachinePort]:
        """Hold a running sandbox for one request, waking it first if it sleeps."""
        ctl = self.controller(self.get(tenant, sandbox_id))
        if ctl.state in (State.SUSPENDED, State.FAILED):
            await self.make_room(tenant)
        self._check_wake(tenant, ctl)
        async with ctl.request() as wake:
            current_wake.set(wake)
            yield ctl.machine

    @contextlib.asynccontextmanager
    async def use_stream(self, tenant: str, sandbox_id: str) -> AsyncIterator[MachinePort]:
        """Like ``use`` for long-lived connections (WebSockets, terminals): not paced."""
        ctl = self.controller(self.get(tenant, sandbox_id))
        if ctl.state in (State.SUSPENDED, State.FAILED):
            await self.make_room(tenant)
        self._check_wake(tenant, ctl)
        async with ctl.stream() as wake:
            current_wake.set(wake)
            yield ctl.machine

    def running(self, sandbox_id: str) -> SandboxController | None:
        """The controller of a sandbox that is RUNNING with no operation under way, if it
        has one (``gateway.preview.fastlane``: no registry read; anything else takes ``use()``)."""
        ctl = self._controllers.get(sandbox_id)
        return ctl if ctl is not None and ctl.serving else None

    async def suspend(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        ctl = self.controller(self.get(tenant, sandbox_id))
        if ctl.state is State.SUSPENDED:
            return ctl.record
        await ctl.wait_op()
        op = ctl.start_suspend("requested by API")
        await asyncio.shield(op)
        if ctl.state is not State.SUSPENDED:
            raise Conflict(f"suspend of {sandbox_id} was cancelled by a request",
                           code="suspend_cancelled")
        return ctl.record

    async def resume(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        async with self.use(tenant, sandbox_id):
            pass
        return self.get(tenant, sandbox_id)

    # -- quotas (gateway.tenancy.quotas decides; this measures) -----------------------------------

    def limits(self, tenant: str) -> quotas.Limits:
        """A key's effective limits: the [tenancy] defaults with its overrides."""
        key = self.registry.get_key(tenant)
        if key is None:
            return self.config.tenancy.limits
        return self.config.tenancy.limits_for(key.admin, key.limits)

    def tenant_usage(self, tenant: str, measure_disk: bool = False) -> quotas.Usage:
        recs = self.registry.list(tenant)
        disk = sum(tree_bytes(Path(r.root)) for r in recs) if measure_disk else 0
        disk += self.templates.disk_bytes(tenant) if measure_disk else 0
        return quotas.usage_of((r.state for r in recs), disk)

    def _check_wake(self, tenant: str, ctl: SandboxController) -> None:
        # Synchronous up to the controller's recording of the wake (RESTORING), so two
        # concurrent wakes of one tenant cannot both pass the check.
        if ctl.state in (State.SUSPENDED, State.FAILED):
            quotas.check_wake(tenant, self.limits(tenant), self.tenant_usage(tenant))

    # -- idle suspend --------------------------------------------------------------------

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_SCAN_S)
            for ctl in list(self._controllers.values()):
                try:
                    ctl.flush_activity()
                    await ctl.idle_check()
                except Exception:
                    log.exception("idle check of %s", ctl.id)
            try:
                self._relieve_pressure()
            except Exception:
                log.exception("paused sandboxes: memory pressure check")

    # -- paused sandboxes (gateway.sandbox.pause_policy decides; this measures and acts) -----------

    def _paused(self) -> list[pause_policy.PausedSandbox]:
        return [pause_policy.PausedSandbox(ctl.id, ctl.record.tenant, ctl.paused_since)
                for ctl in self._controllers.values()
                if ctl.is_idle_paused and ctl.record.tenant != warm_pool.POOL_TENANT]

    def _relieve_pressure(self) -> None:
        """Snapshot one paused sandbox per scan while the host needs its memory."""
        if any(t.get_name().startswith("pressure-") for t in self._tasks):
            return  # one at a time: each snapshot frees the RAM it can
        cfg = self.config.sandbox
        victim = pause_policy.pressure_victim(self._paused(), pause_policy.mem_available_mib(),
                                       pause_policy.PressureLimits(cfg.max_paused,
                                                            cfg.pause_min_available_mib))
        if victim is not None:
            sandbox_id, cause = victim
            ctl = self._controllers[sandbox_id]
            self.spawn(self._suspend_paused(ctl, cause), f"pressure-{sandbox_id}")

    async def make_room(self, tenant: str) -> None:
        """At ``max_awake``, snapshot the tenant's longest-paused sandbox (bounded: one per
        paused sandbox it has), so one more may wake or be created."""
        limits = self.limits(tenant)
        for _ in range(2 * len(self._controllers)):
            if not limits.max_awake or self.tenant_usage(tenant).awake < limits.max_awake:
                return
            victim = pause_policy.room_victim(self._paused(), tenant)
            if victim is not None:
                await self._suspend_paused(self._controllers[victim], "room for another "
                                           "awake sandbox of its tenant (max_awake)")
                continue
            # A pause is recorded when it begins, so a paused sandbox may still have an
            # operation under way (its VM stopping, or its snapshot): wait for it, then
            # look again (bounded by the machine's own timeouts).
            pausing = next((ctl for ctl in self._controllers.values()
                            if ctl.record.tenant == tenant and ctl.state is State.PAUSED
                            and not ctl.is_idle_paused), None)
            if pausing is None:
                return
            with contextlib.suppress(Exception):
                await pausing.wait_op()

    async def _suspend_paused(self, ctl: SandboxController, cause: str) -> None:
        if not ctl.is_idle_paused:
            return
        self.metrics.events["paused_suspended"] += 1
        with contextlib.suppress(Exception):  # a request may have woken it meanwhile
            await asyncio.shield(ctl.start_suspend(cause))

    # -- tasks and lifecycle -------------------------------------------------------------

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        """Start a task owned by this service (cancelled on close; errors logged)."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s failed: %s", task.get_name(), task.exception())

    def start(self) -> None:
        self.templates.collect(startup=True)
        self._idle_task = self.spawn(self._idle_loop(), "idle-loop")
        self.pool.start()
        self.run_id = self.registry.start_run()  # after recovery: its transitions are before
        self._expiry_task = self.spawn(expiry.expiry_loop(self), "expiry-loop")

    async def aclose(self, timeout: float = 15.0) -> None:
        """Stop background work; VMMs keep running for the next daemon to adopt (but the
        warm pool's own members are destroyed)."""
        await self.pool.aclose()
        loops = (self._idle_task, self._expiry_task)
        for loop in loops:
            if loop is not None:
                loop.cancel()
        ops = [t for t in self._tasks if t not in loops]
        if ops:
            _, pending = await asyncio.wait(ops, timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for ctl in self._controllers.values():
            ctl.close()
            agent, ctl.machine.agent = ctl.machine.agent, None
            if agent is not None:
                await agent.aclose()
        self._controllers.clear()
        if self.backend.cgroups is not None:  # gone only if no VMM of ours is left running
            await asyncio.to_thread(self.backend.cgroups.remove_parent)

    # -- helpers -----------------------------------------------------------------------

    def controller(self, rec: SandboxRecord) -> SandboxController:
        """The one controller of a sandbox (made on first use, from its registry row)."""
        ctl = self._controllers.get(rec.id)
        if ctl is None:
            machine = Machine(self.plan(rec), self.backend)
            # FAILED with no disk (adopted with nothing: gateway.sandbox.adoption): the core
            # answers its requests sandbox_lost rather than trying to boot nothing.
            lost = rec.state is State.FAILED and not machine.spec.disk.exists()
            ctl = SandboxController(rec, machine, self.registry, self.policy, self.holds,
                                    self.spawn, self.metrics, lost=lost)
            self._controllers[rec.id] = ctl
        return ctl

    def known(self, sandbox_id: str) -> SandboxController | None:
        """The sandbox's controller if it has one now (``controller`` makes one)."""
        return self._controllers.get(sandbox_id)

    def controllers(self) -> Iterable[SandboxController]:
        """Every controller this host holds now."""
        return self._controllers.values()

    def forget(self, sandbox_id: str) -> None:
        ctl = self._controllers.pop(sandbox_id, None)
        if ctl is not None:
            ctl.close()

    async def set_egress(self, tenant: str, sandbox_id: str,
                         egress: dict[str, Any]) -> SandboxRecord:
        """Store a sandbox's new egress policy and apply it now if its namespace exists
        (running or suspended: the firewall and resolver change in place, no restart)."""
        rec = self.get(tenant, sandbox_id)
        self.registry.update(rec.id, egress=egress)
        rec = self.get(tenant, sandbox_id)
        slot = self.plan(rec).slot
        if slot.netns in network.list_namespaces(slot.netns):
            await network.reload(slot, self.backend.config.network, self.plan(rec).egress)
        return rec

    def golden_for(self, rec: SandboxRecord) -> Golden:
        """The golden snapshot a sandbox was made from (older builds stay loadable)."""
        golden = self._golden_cache.get(rec.golden)
        if golden is None:
            golden = load_golden_dir(Path(rec.golden))
            self._golden_cache[rec.golden] = golden
        return golden

    def plan(self, rec: SandboxRecord) -> MachinePlan:
        slot = network.slot_for(rec.slot, rec.id, self.backend.config.network)
        return MachinePlan(vm_id=rec.id, root=Path(rec.root), slot=slot,
                           golden=self.golden_for(rec), disk_mib=rec.disk_mib,
                           egress=policy_of(rec.egress, self.backend.config.network))


def parse_metadata(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadRequest("'metadata' must be a JSON object")
    if len(repr(value)) > MAX_METADATA_BYTES:
        raise BadRequest(f"'metadata' must be under {MAX_METADATA_BYTES} bytes")
    return value
