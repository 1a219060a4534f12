"""Start-up recovery: make the registry and the host agree again.

The registry records every transition before it is acted on, so after a crash
(``kill -9`` at any moment) each sandbox's recorded state says what was in
progress. This module only gathers facts (is the recorded VMM alive and still
ours? is the snapshot complete and unused?) and executes what the sandbox's
core decides from them: the decisions are the ``RECOVERY`` table in
``gateway.sandbox.core`` (rendered in docs/operations.md), tested event -> command.

Then VMM processes under our data directory that no sandbox owns are killed,
and namespaces of golden-snapshot builds that nothing uses are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from gateway.sandbox import core as c
from gateway.sandbox.controller import SandboxController
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord
from gateway.sandbox.service import SandboxService
from vmctl import network, store
from vmctl.driver import kill_pid, pid_alive
from vmctl.machine import Machine
from vmctl.errors import NetworkError
from vmctl.spec import VMMRecord

log = logging.getLogger(__name__)
ADOPT_HEALTH_TIMEOUT_S = 10.0


async def reconcile(service: SandboxService) -> None:
    owned: set[int] = set()
    for rec in service.registry.list(include_destroyed=True):
        try:
            pid = await _recover(service, rec)
        except Exception:
            log.exception("recovering sandbox %s", rec.id)
            continue
        if pid:
            owned.add(pid)
    await _kill_orphan_vmms(service.sandboxes_dir, owned, _jail_base(service))
    await _remove_unused_build_namespaces(service.backend.config.network.netns_prefix)


async def _recover(service: SandboxService, rec: SandboxRecord) -> int | None:
    """Returns the pid of a VMM that was kept (adopted)."""
    record = VMMRecord(**rec.vmm) if rec.vmm else None
    alive = record is not None and _is_our_vmm(record, rec.root)
    if rec.state is State.DESTROYED and not alive and not _leftovers(service, rec):
        return None
    ctl = service.controller(rec)
    found = c.Recovered(vmm_alive=alive, snapshot=_snapshot(service, ctl, rec))
    if rec.state not in (State.CREATING, State.DESTROYED):
        await network_ready(service, rec)
    before = ctl.state
    # Only a VMM that is still ours is adopted or killed: a recorded pid may be reused.
    await _execute(ctl, found, record if alive else None)
    if ctl.state is not before:
        log.info("sandbox %s: %s -> %s (%s)", rec.id, before.value, ctl.state.value,
                 ctl.record.failure or "recovered")
    if ctl.state is State.DESTROYED:
        service.forget(rec.id)
    return ctl.vmm_pid


async def _execute(ctl: SandboxController, found: c.Recovered,
                   record: VMMRecord | None) -> None:
    """Run the recovery commands; the plan's own step reports back to the core."""
    pending = ctl.tell(found)
    reported = False
    while pending:
        cmd = pending.pop(0)
        if isinstance(cmd, c.RemoveResources):
            await ctl.machine.destroy()
            continue
        assert isinstance(cmd, c.RunStep), cmd
        try:
            vmm = await _step(ctl, cmd.step, record)
        except Exception as exc:
            if reported:
                raise
            log.warning("sandbox %s: %s failed: %s", ctl.id, cmd.step.value, exc)
            event: object = c.RecoveryStepFailed(str(exc) or type(exc).__name__)
        else:
            event = c.RecoveryStepDone(vmm)
        if not reported:
            reported = True
            pending = [*ctl.tell(event), *pending]


async def _step(ctl: SandboxController, step: c.Step,
                record: VMMRecord | None) -> dict | None:
    machine = ctl.machine
    if step in (c.Step.KILL, c.Step.DISCARD):
        if record is not None:  # the VMM, and its cgroup (which outlives it otherwise)
            await machine.kill_recorded(record)
        if step is c.Step.DISCARD:
            await machine.destroy()
        return None
    assert record is not None
    if step is c.Step.ADOPT_PAUSED:  # its guest cannot answer while stopped: no health check
        await machine.adopt_paused(record)
        return dict(record.__dict__)
    await machine.adopt(record)
    if step is c.Step.ADOPT:
        await machine.ensure_running()
    if step is c.Step.RESUME:
        await machine.abort_suspend()
    if step is c.Step.FINISH_RESTORE:
        await machine.finish_restore()
    else:
        await machine.require_agent().health(timeout=ADOPT_HEALTH_TIMEOUT_S)
    return dict(record.__dict__)


def _snapshot(service: SandboxService, ctl: SandboxController,
              rec: SandboxRecord) -> c.Snapshot:
    """USABLE: complete, never resumed from, and (mid-suspend) written by this suspend."""
    directory = ctl.machine.snapshot_dir
    try:
        _, manifest = store.load(directory, verify=False)
    except Exception:
        return c.Snapshot.UNUSABLE
    if rec.state is State.SUSPENDING and manifest.created_at < _last_transition_at(service, rec):
        return c.Snapshot.UNUSABLE  # an older snapshot: not what this suspend wrote
    return c.Snapshot.USABLE


def _leftovers(service: SandboxService, rec: SandboxRecord) -> bool:
    prefix = service.backend.config.network.netns_prefix
    return Path(rec.root).exists() or f"{prefix}{rec.id}" in network.list_namespaces(prefix)


async def network_ready(service: SandboxService, rec: SandboxRecord) -> None:
    """Recreate a sandbox's namespace if it is gone (e.g. after a host reboot); else reload
    its firewall, so an upgrade or a config change never leaves a guest under an old one."""
    slot = service.plan(rec).slot
    if slot.netns not in network.list_namespaces(slot.netns):
        tap_owner = Machine(service.plan(rec), service.backend).tap_owner
        await network.create(slot, service.backend.config.network,
                             policy=service.plan(rec).egress, tap_owner=tap_owner)
        return
    try:
        await network.reload(slot, service.backend.config.network,
                             policy=service.plan(rec).egress)
    except NetworkError:  # the old ruleset stays; recovering the sandbox matters more
        log.exception("sandbox %s: reloading its firewall failed", rec.id)


def _last_transition_at(service: SandboxService, rec: SandboxRecord) -> float:
    log_rows = service.registry.transitions(rec.id)
    return float(log_rows[-1]["at"]) if log_rows else 0.0


def _is_our_vmm(record: VMMRecord, root: str) -> bool:
    """Alive *and* still the VMM we recorded (guards against pid reuse): its command line
    names the sandbox directory, or (a jailed Firecracker, whose command line names only
    paths inside its jail) it is chrooted where its recorded API socket is."""
    if not pid_alive(record.pid):
        return False
    try:
        if root.encode() in Path(f"/proc/{record.pid}/cmdline").read_bytes():
            return True
        return os.readlink(f"/proc/{record.pid}/root") == str(
            Path(record.control_socket).parent)
    except OSError:
        return False


def _jail_base(service: SandboxService) -> Path | None:
    """Where this daemon's jailed Firecracker VMMs live (``<chroot_base>/firecracker``)."""
    backend = service.backend
    fc = backend.config.firecracker
    if backend.driver_name != "firecracker" or not fc.jailer:
        return None
    return fc.chroot_base / "firecracker"


async def _kill_orphan_vmms(sandboxes_dir: Path, owned: set[int],
                            jail_base: Path | None = None) -> None:
    """Kill VMMs nothing owns: those naming our sandboxes dir in their command line, and
    jailed ones chrooted under our jail base (``chroot_base`` is one daemon's own)."""
    marker = str(sandboxes_dir).encode() + b"/"
    jails = str(jail_base).encode() + b"/" if jail_base else None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in owned:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            jailed = jails is not None and b"firecracker" in cmdline and \
                os.fsencode(os.readlink(entry / "root")).startswith(jails)
        except OSError:
            continue
        if jailed or (marker in cmdline and (b"qemu-system" in cmdline
                                             or b"firecracker" in cmdline)):
            log.warning("killing VMM pid %s that no sandbox owns", entry.name)
            await kill_pid(int(entry.name), timeout=2.0)


async def _remove_unused_build_namespaces(prefix: str) -> None:
    for name in network.list_namespaces(prefix + "golden-"):
        if not _namespace_in_use(name):
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
