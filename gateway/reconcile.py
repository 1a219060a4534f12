"""Start-up reconciliation: make the registry and the host agree again.

The registry records every transition before it is acted on, so after a crash
(``kill -9`` at any moment) each sandbox's recorded state says what was in
progress. For each one we look at reality (is its VMM alive? is its snapshot
complete?) and roll the transition forward or back:

=========== =============== ==================================================
recorded    VMM alive?      outcome
=========== =============== ==================================================
RUNNING     yes             re-adopt (QMP socket + agent)
RUNNING     no              FAILED (crashed); the next request cold-boots its disk
CREATING    any             kill, remove resources, FAILED
SUSPENDING  yes, snapshot   kill the paused VMM -> SUSPENDED (roll forward)
            complete
SUSPENDING  yes, no         resume the VM -> RUNNING (roll back)
            snapshot
SUSPENDING  no              SUSPENDED if the snapshot is complete, else FAILED
RESTORING   yes             re-adopt, re-init the guest -> RUNNING
RESTORING   no              SUSPENDED (retry on next request) if the snapshot is
                            still there, else FAILED
SUSPENDED,  yes             kill it (nothing should be running)
FAILED
DESTROYED   -               remove whatever is left
=========== =============== ==================================================

Then VMM processes under our data directory that no sandbox owns are killed,
and namespaces of golden-snapshot builds that nothing uses are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from pathlib import Path

from gateway.lifecycle import Event, State
from gateway.registry import SandboxRecord
from gateway.sandboxes import SandboxService
from vmctl import network, store
from vmctl.driver import kill_pid, pid_alive
from vmctl.machine import Machine
from vmctl.spec import VMMRecord

log = logging.getLogger(__name__)


async def reconcile(service: SandboxService) -> None:
    owned: set[int] = set()
    for rec in service.registry.list(include_destroyed=True):
        try:
            pid = await _reconcile_one(service, rec)
        except Exception:
            log.exception("reconciling sandbox %s", rec.id)
            continue
        if pid:
            owned.add(pid)
    await _kill_orphan_vmms(service.sandboxes_dir, owned)
    await _remove_unused_build_namespaces()


async def _reconcile_one(service: SandboxService, rec: SandboxRecord) -> int | None:
    """Returns the pid of a VMM that was kept (adopted)."""
    record = VMMRecord(**rec.vmm) if rec.vmm else None
    alive = record is not None and _is_our_vmm(record.pid, rec.root)
    if rec.state is State.DESTROYED:
        netns = f"{network.NETNS_PREFIX}{rec.id}"
        if Path(rec.root).exists() or netns in network.list_namespaces():
            await _kill(record, alive)
            await _machine(service, rec).destroy()
        return None
    machine = _machine(service, rec)
    state = rec.state
    if state is State.RUNNING:
        if alive and await _adopt(machine, record):
            _keep(service, rec, machine)
            return record.pid  # type: ignore[union-attr]
        return _fail(service, rec, Event.CRASHED, "VMM gone after daemon restart")
    if state is State.CREATING:
        await _kill(record, alive)
        await machine.destroy()
        service.registry.transition(rec.id, Event.CREATE_FAILED, "daemon stopped mid-create",
                                    failure="interrupted create", vmm=None)
        return None
    await network_ready(service, rec)
    if state is State.SUSPENDING:
        return await _finish_suspend(service, rec, machine, record, alive)
    if state is State.RESTORING:
        if alive and await _adopt(machine, record):
            await machine._init_guest()
            shutil.rmtree(machine.snapshot_dir, ignore_errors=True)
            service.registry.transition(rec.id, Event.RESTORED, "restore finished (adopted)")
            _keep(service, rec, machine)
            return record.pid  # type: ignore[union-attr]
        if _snapshot_complete(machine):
            service.registry.transition(rec.id, Event.RESTORE_FAILED,
                                        "daemon stopped mid-restore", vmm=None)
        else:
            _fail(service, rec, Event.SNAPSHOT_LOST, "daemon stopped mid-restore; no snapshot")
        return None
    await _kill(record, alive)  # SUSPENDED / FAILED: nothing should run
    if record:
        service.registry.update(rec.id, vmm=None)
    return None


async def _finish_suspend(service: SandboxService, rec: SandboxRecord, machine: Machine,
                          record: VMMRecord | None, alive: bool) -> int | None:
    complete = _snapshot_complete(machine, newer_than=_last_transition_at(service, rec))
    if complete:
        await _kill(record, alive)
        service.registry.transition(rec.id, Event.SUSPENDED, "suspend finished (reconciled)",
                                    vmm=None)
        return None
    if alive and await _adopt(machine, record, health=False):
        await machine.abort_suspend()
        await machine.require_agent().health(timeout=10)
        service.registry.transition(rec.id, Event.SUSPEND_ABORTED, "daemon stopped mid-suspend")
        _keep(service, rec, machine)
        return record.pid  # type: ignore[union-attr]
    _fail(service, rec, Event.SUSPEND_FAILED, "daemon and VMM stopped mid-suspend")
    return None


def _machine(service: SandboxService, rec: SandboxRecord) -> Machine:
    return Machine(service.plan(rec), service.backend)


def _keep(service: SandboxService, rec: SandboxRecord, machine: Machine) -> None:
    fresh = service.registry.get(rec.id) or rec
    service.adopt_controller(fresh, machine)
    log.info("sandbox %s: %s, VMM adopted", rec.id, fresh.state.value)


def _fail(service: SandboxService, rec: SandboxRecord, event: Event, cause: str) -> None:
    service.registry.transition(rec.id, event, cause, failure=cause, vmm=None)
    log.warning("sandbox %s: %s", rec.id, cause)


async def _adopt(machine: Machine, record: VMMRecord | None, health: bool = True) -> bool:
    assert record is not None
    try:
        await machine.adopt(record)
        if health:
            await machine.require_agent().health(timeout=10)
        return True
    except Exception as exc:
        log.warning("could not adopt VMM %d: %s", record.pid, exc)
        await machine.kill_recorded(record)
        return False


async def _kill(record: VMMRecord | None, alive: bool) -> None:
    if record is not None and alive:
        await kill_pid(record.pid, timeout=2.0)


async def network_ready(service: SandboxService, rec: SandboxRecord) -> None:
    """Recreate a sandbox's namespace if it is gone (e.g. after a host reboot)."""
    slot = service.plan(rec).slot
    if slot.netns not in network.list_namespaces():
        await network.create(slot, service.backend.config.network)


def _snapshot_complete(machine: Machine, newer_than: float = 0.0) -> bool:
    try:
        _, manifest = store.load(machine.snapshot_dir, verify=False)
    except Exception:
        return False
    return manifest.created_at >= newer_than


def _last_transition_at(service: SandboxService, rec: SandboxRecord) -> float:
    log_rows = service.registry.transitions(rec.id)
    return float(log_rows[-1]["at"]) if log_rows else 0.0


def _is_our_vmm(pid: int, root: str) -> bool:
    """Alive *and* still the VMM we recorded (guards against pid reuse)."""
    if not pid_alive(pid):
        return False
    try:
        return root.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


async def _kill_orphan_vmms(sandboxes_dir: Path, owned: set[int]) -> None:
    marker = str(sandboxes_dir).encode() + b"/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in owned:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and (b"qemu-system" in cmdline or b"firecracker" in cmdline):
            log.warning("killing VMM pid %s that no sandbox owns", entry.name)
            await kill_pid(int(entry.name), timeout=2.0)


async def _remove_unused_build_namespaces() -> None:
    for name in network.list_namespaces():
        if name.startswith(network.NETNS_PREFIX + "golden-") and not _namespace_in_use(name):
            log.warning("removing namespace %s left by an interrupted golden build", name)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(network.netns.remove, name)


def _namespace_in_use(name: str) -> bool:
    try:
        target = os.stat(f"{network.NETNS_DIR}/{name}").st_ino
    except OSError:
        return False
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino == target:
                    return True
    return False
