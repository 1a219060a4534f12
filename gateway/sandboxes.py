"""Sandbox service: tenant-scoped operations on sandboxes.

Policy lives here, in ``gateway.controller`` (one per sandbox: wake on request,
suspend when idle) and in ``gateway.lifecycle`` (the transition table);
mechanism in ``vmctl.Machine``; transport in ``gateway.api``.

VMM processes are deliberately *not* stopped when the daemon stops: they are
re-adopted on the next start (``gateway.reconcile``), so restarting or
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
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from gateway import quotas
from gateway.config import Config
from gateway.controller import HoldCounter, SandboxController, Wake, WakePolicy
from gateway.builtin_builds import BuiltinBuilds
from gateway.errors import BadRequest, Conflict, SandboxNotFound, TemplateNotFound, Unavailable
from gateway.lifecycle import State
from gateway.metrics import Metrics
from gateway.registry import Registry, SandboxRecord
from images.templates import ALIASES
from vmctl import network
from vmctl.backend import Backend
from vmctl.golden import BUILD_SLOTS, Golden, load_golden_dir
from vmctl.machine import Machine, MachinePlan

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 16 * 1024
IDLE_SCAN_S = 1.0
# Set while a request runs: how long it waited for its sandbox to wake (for a response header).
current_wake: contextvars.ContextVar[Wake | None] = contextvars.ContextVar("wake", default=None)


class SandboxService:
    def __init__(self, config: Config, registry: Registry, backend: Backend,
                 goldens: dict[str, Golden], policy: WakePolicy | None = None) -> None:
        self.config = config
        self.registry = registry
        self.backend = backend
        self.goldens = goldens
        self.builtin_builds: BuiltinBuilds | None = None  # gateway.builtin_builds (set by app)
        self.policy = policy or WakePolicy()
        self.holds = HoldCounter()
        self.metrics = Metrics()
        self._controllers: dict[str, SandboxController] = {}
        self._tasks: set[asyncio.Task] = set()
        self._golden_cache: dict[str, Golden] = {str(g.dir): g for g in goldens.values()}
        self._idle_task: asyncio.Task | None = None

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

    # -- create / destroy / update ---------------------------------------------------

    async def create(self, tenant: str, template: str | None, metadata: dict[str, Any],
                     idle_timeout: float | None) -> SandboxRecord:
        template = template or self.config.sandbox.default_template
        template = ALIASES.get(template, template) if template not in self.goldens else template
        golden = self.goldens.get(template)
        if golden is None and self.builtin_builds is not None:
            self.builtin_builds.check(template)  # 503 while a built-in is still building
        if golden is None:
            raise TemplateNotFound(f"template {template!r} not found; available: "
                                   f"{', '.join(sorted(self.goldens)) or 'none'}")
        rec = self._reserve(tenant, template, golden, metadata, idle_timeout)
        ctl = self.controller(rec)
        # The creation runs detached: a client that disconnects does not leave a half-made VM.
        await ctl.create()
        return ctl.rec

    def _reserve(self, tenant: str, template: str, golden: Golden, metadata: dict[str, Any],
                 idle_timeout: float | None) -> SandboxRecord:
        """Pick an id and a network slot and record the sandbox as CREATING (synchronous,
        so two concurrent creates can never take the same slot)."""
        limits = self.limits(tenant)
        quotas.check_create(tenant, limits, self._usage(tenant, measure_disk=bool(
            limits.max_disk_mib)))
        used = self.registry.used_slots()
        if len(used) >= self.config.sandbox.max_sandboxes:
            raise Unavailable(f"this host is at its limit of {self.config.sandbox.max_sandboxes} "
                              "sandboxes", code="sandbox_limit", headers={"Retry-After": "30"})
        slot = self._free_slot(used)
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

    def update(self, tenant: str, sandbox_id: str, idle_timeout: float | None,
               metadata: dict[str, Any] | None) -> SandboxRecord:
        rec = self.get(tenant, sandbox_id)
        changes: dict[str, Any] = {}
        if idle_timeout is not None:
            changes["idle_timeout"] = idle_timeout
        if metadata is not None:
            changes["metadata"] = metadata
        if changes:
            self.registry.update(rec.id, **changes)
        ctl = self.controller(self.registry.get(rec.id) or rec)
        ctl.rec = self.registry.get(rec.id) or rec
        return ctl.rec

    # -- using a sandbox ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, tenant: str, sandbox_id: str) -> AsyncIterator[Machine]:
        """Hold a running sandbox for one request, waking it first if it sleeps."""
        ctl = self.controller(self.get(tenant, sandbox_id))
        self._check_wake(tenant, ctl)
        async with ctl.request() as wake:
            current_wake.set(wake)
            yield ctl.machine  # type: ignore[misc]

    @contextlib.asynccontextmanager
    async def use_stream(self, tenant: str, sandbox_id: str) -> AsyncIterator[Machine]:
        """Like ``use`` for long-lived connections (WebSockets, terminals): not paced."""
        ctl = self.controller(self.get(tenant, sandbox_id))
        self._check_wake(tenant, ctl)
        async with ctl.stream() as wake:
            current_wake.set(wake)
            yield ctl.machine  # type: ignore[misc]

    async def suspend(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        ctl = self.controller(self.get(tenant, sandbox_id))
        if ctl.state is State.SUSPENDED:
            return ctl.rec
        await ctl.wait_op()
        op = ctl.start_suspend("requested by API")
        await asyncio.shield(op)
        if ctl.state is not State.SUSPENDED:
            raise Conflict(f"suspend of {sandbox_id} was cancelled by a request",
                           code="suspend_cancelled")
        return ctl.rec

    async def resume(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        async with self.use(tenant, sandbox_id):
            pass
        return self.get(tenant, sandbox_id)

    # -- quotas (gateway.quotas decides; this measures) -----------------------------------

    def limits(self, tenant: str) -> quotas.Limits:
        """A key's effective limits: the [tenancy] defaults with its overrides."""
        key = self.registry.get_key(tenant)
        if key is None:
            return self.config.tenancy.limits
        return self.config.tenancy.limits_for(key.admin, key.limits)

    def _usage(self, tenant: str, measure_disk: bool = False) -> quotas.Usage:
        recs = self.registry.list(tenant)
        disk = sum(tree_bytes(Path(r.root)) for r in recs) if measure_disk else 0
        return quotas.usage_of((r.state for r in recs), disk)

    def _check_wake(self, tenant: str, ctl: SandboxController) -> None:
        # Synchronous up to the controller's recording of the wake (RESTORING), so two
        # concurrent wakes of one tenant cannot both pass the check.
        if ctl.state in (State.SUSPENDED, State.FAILED):
            quotas.check_wake(tenant, self.limits(tenant), self._usage(tenant))

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
        self._idle_task = self.spawn(self._idle_loop(), "idle-loop")

    async def aclose(self, timeout: float = 15.0) -> None:
        """Stop background work; VMMs keep running for the next daemon to adopt."""
        if self._idle_task is not None:
            self._idle_task.cancel()
        ops = [t for t in self._tasks if t is not self._idle_task]
        if ops:
            _, pending = await asyncio.wait(ops, timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for ctl in self._controllers.values():
            ctl.close()
            agent, ctl.machine.agent = ctl.machine.agent, None  # type: ignore[attr-defined]
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
            ctl = SandboxController(rec, machine, self.registry, self.policy, self.holds,
                                    self.spawn, self.metrics)
            self._controllers[rec.id] = ctl
        return ctl

    def forget(self, sandbox_id: str) -> None:
        ctl = self._controllers.pop(sandbox_id, None)
        if ctl is not None:
            ctl.close()

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
                           golden=self.golden_for(rec))


def tree_bytes(root: Path) -> int:
    """Bytes allocated to the files under ``root`` (sparse files count what they use)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed while we walk
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def parse_seconds(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise BadRequest(f"'{name}' must be a number of seconds >= 0 (0 = never)")
    return float(value)


def parse_metadata(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadRequest("'metadata' must be a JSON object")
    if len(repr(value)) > MAX_METADATA_BYTES:
        raise BadRequest(f"'metadata' must be under {MAX_METADATA_BYTES} bytes")
    return value


def parse_object(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    return body


def validate_create(body: Any) -> tuple[str | None, dict[str, Any], float | None]:
    body = parse_object(body, {"template", "environment", "metadata", "idle_timeout"})
    template = body.get("template", body.get("environment"))
    if template is not None and (not isinstance(template, str) or not template):
        raise BadRequest("'template' must be a non-empty string")
    metadata = parse_metadata(body.get("metadata")) or {}
    return template, metadata, parse_seconds(body.get("idle_timeout"), "idle_timeout")


def validate_update(body: Any) -> tuple[float | None, dict[str, Any] | None]:
    # "public_ports" is validated and applied by gateway.preview_auth.
    body = parse_object(body, {"metadata", "idle_timeout", "public_ports"})
    idle = parse_seconds(body.get("idle_timeout"), "idle_timeout")
    return idle, parse_metadata(body.get("metadata"))
