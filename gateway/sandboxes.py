"""Sandbox service: tenant-scoped operations on sandboxes.

Policy lives here and in ``gateway.lifecycle``; mechanism in ``vmctl.Machine``;
transport in ``gateway.api``. Each sandbox has a ``Runtime`` (its Machine plus a
lock that serialises lifecycle operations). Every state change goes through
``Registry.transition`` first, then the I/O happens.

VMM processes are deliberately *not* stopped when the daemon stops: they are
re-adopted on the next start (``reconcile``), so upgrading or restarting the
daemon never loses a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config import Config
from gateway.errors import BadRequest, Conflict, SandboxNotFound, TemplateNotFound, Unavailable
from gateway.lifecycle import Event, State
from gateway.registry import Registry, SandboxRecord
from vmctl import network
from vmctl.backend import Backend
from vmctl.golden import BUILD_SLOTS, Golden
from vmctl.machine import Machine, MachinePlan
from vmctl.spec import VMMRecord

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 16 * 1024


@dataclass
class Runtime:
    machine: Machine
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: int = 0


class SandboxService:
    def __init__(self, config: Config, registry: Registry, backend: Backend,
                 goldens: dict[str, Golden]) -> None:
        self.config = config
        self.registry = registry
        self.backend = backend
        self.goldens = goldens
        self._runtimes: dict[str, Runtime] = {}
        self._create_lock = asyncio.Lock()

    @property
    def sandboxes_dir(self) -> Path:
        return self.config.server.data_dir / "sandboxes"

    # -- queries -------------------------------------------------------------------

    def get(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        rec = self.registry.get(sandbox_id)
        if rec is None or rec.tenant != tenant or rec.state is State.DESTROYED:
            raise SandboxNotFound(sandbox_id)
        return rec

    def list(self, tenant: str) -> list[SandboxRecord]:
        return self.registry.list(tenant)

    # -- create / destroy ------------------------------------------------------------

    async def create(self, tenant: str, template: str | None, metadata: dict[str, Any],
                     idle_timeout: float | None) -> SandboxRecord:
        template = template or self.config.sandbox.default_template
        golden = self.goldens.get(template)
        if golden is None:
            raise TemplateNotFound(f"template {template!r} not found; available: "
                                   f"{', '.join(sorted(self.goldens)) or 'none'}")
        rec = self._reserve(tenant, template, golden, metadata, idle_timeout)
        machine = Machine(self._plan(rec, golden), self.backend)
        runtime = Runtime(machine)
        self._runtimes[rec.id] = runtime
        async with runtime.lock:
            try:
                await machine.create()
            except BaseException as exc:
                await asyncio.shield(self._fail_create(rec.id, machine, exc))
                raise
            vmm = machine.vmm_record()
            return self.registry.transition(rec.id, Event.CREATED, "restored from golden",
                                            vmm=vmm.__dict__ if vmm else None,
                                            last_activity=time.time())

    def _reserve(self, tenant: str, template: str, golden: Golden, metadata: dict[str, Any],
                 idle_timeout: float | None) -> SandboxRecord:
        """Pick an id and a network slot and record the sandbox as CREATING (synchronous,
        so two concurrent creates can never take the same slot)."""
        used = self.registry.used_slots()
        if len(used) >= self.config.sandbox.max_sandboxes:
            raise Unavailable(f"this host is at its limit of {self.config.sandbox.max_sandboxes} "
                              "sandboxes", code="sandbox_limit", headers={"Retry-After": "30"})
        capacity = self.backend.config.network.capacity - BUILD_SLOTS
        slot = next((i for i in range(capacity) if i not in used), None)
        if slot is None:
            raise Unavailable("network address pool exhausted", code="sandbox_limit")
        sandbox_id = secrets.token_hex(8)
        now = time.time()
        rec = SandboxRecord(
            id=sandbox_id, tenant=tenant, template=template, state=State.CREATING, slot=slot,
            root=str(self.sandboxes_dir / sandbox_id), golden=str(golden.dir),
            idle_timeout=self.config.sandbox.idle_timeout if idle_timeout is None else idle_timeout,
            host=self.registry.host, created_at=now, updated_at=now, last_activity=now,
            metadata=metadata)
        self.registry.insert_sandbox(rec)
        return rec

    async def _fail_create(self, sandbox_id: str, machine: Machine, exc: BaseException) -> None:
        self.registry.transition(sandbox_id, Event.CREATE_FAILED, f"create failed: {exc!r}",
                                 failure=str(exc) or type(exc).__name__)
        self._runtimes.pop(sandbox_id, None)
        try:
            await machine.destroy()
        except Exception:
            log.exception("cleanup after failed create of %s", sandbox_id)

    async def destroy(self, tenant: str, sandbox_id: str) -> None:
        rec = self.get(tenant, sandbox_id)
        runtime = self._runtime(rec)
        async with runtime.lock:
            self.registry.transition(rec.id, Event.DESTROY, "deleted by API", vmm=None)
            self._runtimes.pop(rec.id, None)
            await runtime.machine.destroy()

    # -- using a sandbox ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, tenant: str, sandbox_id: str) -> AsyncIterator[Machine]:
        """Hold a running sandbox for one request (counted as activity from its start)."""
        rec = self.get(tenant, sandbox_id)
        runtime = self._runtime(rec)
        runtime.inflight += 1
        try:
            if rec.state is not State.RUNNING:
                raise Conflict(f"sandbox {sandbox_id} is {rec.state.value}", code="not_running")
            yield runtime.machine
        finally:
            runtime.inflight -= 1
            self.registry.update(rec.id, last_activity=time.time())

    # -- start-up and shut-down ----------------------------------------------------------

    async def reconcile(self) -> None:
        """Bring the registry and reality into agreement after a (re)start."""
        known = set()
        for rec in self.registry.list():
            known.add(network.NETNS_PREFIX + rec.id)
            try:
                await self._reconcile_one(rec)
            except Exception:
                log.exception("reconciling sandbox %s", rec.id)
        for ns in network.list_namespaces():
            if ns not in known and not ns.startswith(network.NETNS_PREFIX + "golden-"):
                log.warning("removing orphaned namespace %s", ns)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(network.netns.remove, ns)

    async def _reconcile_one(self, rec: SandboxRecord) -> None:
        golden = self._golden_for(rec)
        machine = Machine(self._plan(rec, golden), self.backend) if golden else None
        record = VMMRecord(**rec.vmm) if rec.vmm else None
        if rec.state is State.RUNNING and machine and record:
            try:
                await machine.adopt(record)
                await machine.require_agent().health(timeout=10)
                self._runtimes[rec.id] = Runtime(machine)
                log.info("re-adopted sandbox %s (pid %d)", rec.id, record.pid)
                return
            except Exception as exc:
                log.warning("sandbox %s: VMM not adoptable: %s", rec.id, exc)
                self.registry.transition(rec.id, Event.CRASHED, f"not adoptable: {exc}",
                                         failure=str(exc))
        elif rec.state is State.CREATING:
            self.registry.transition(rec.id, Event.CREATE_FAILED, "daemon stopped mid-create",
                                     failure="interrupted create")
        if machine and record:
            await machine.kill_recorded(record)
            self.registry.update(rec.id, vmm=None)
        if machine:
            self._runtimes[rec.id] = Runtime(machine)

    async def aclose(self) -> None:
        """Release host-side resources; VMMs keep running for the next daemon."""
        for runtime in list(self._runtimes.values()):
            agent, runtime.machine.agent = runtime.machine.agent, None
            if agent is not None:
                await agent.aclose()
        self._runtimes.clear()

    # -- helpers -----------------------------------------------------------------------

    def _runtime(self, rec: SandboxRecord) -> Runtime:
        runtime = self._runtimes.get(rec.id)
        if runtime is None:
            golden = self._golden_for(rec)
            if golden is None:
                raise Conflict(f"sandbox {rec.id}'s template {rec.template!r} is not loaded",
                               code="template_unavailable")
            runtime = self._runtimes[rec.id] = Runtime(Machine(self._plan(rec, golden),
                                                               self.backend))
        return runtime

    def _golden_for(self, rec: SandboxRecord) -> Golden | None:
        golden = self.goldens.get(rec.template)
        return golden if golden and str(golden.dir) == rec.golden else None

    def _plan(self, rec: SandboxRecord, golden: Golden) -> MachinePlan:
        slot = network.slot_for(rec.slot, rec.id, self.backend.config.network)
        return MachinePlan(vm_id=rec.id, root=Path(rec.root), slot=slot, golden=golden)


def validate_create(body: Any) -> tuple[str | None, dict[str, Any], float | None]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = set(body) - {"template", "environment", "metadata", "idle_timeout"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    template = body.get("template", body.get("environment"))
    if template is not None and (not isinstance(template, str) or not template):
        raise BadRequest("'template' must be a non-empty string")
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise BadRequest("'metadata' must be a JSON object")
    if len(repr(metadata)) > MAX_METADATA_BYTES:
        raise BadRequest(f"'metadata' must be under {MAX_METADATA_BYTES} bytes")
    idle = body.get("idle_timeout")
    if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float))
                             or idle < 0):
        raise BadRequest("'idle_timeout' must be a number of seconds >= 0 (0 = never)")
    return template, metadata, idle

