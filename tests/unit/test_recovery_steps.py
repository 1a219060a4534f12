"""Start-up recovery's steps against a fake machine (no VMs): a VMM a previous daemon left is
killed through the port's ``kill_recorded`` (which also removes the VMM's cgroup), and only
if it is still ours (a recorded pid may have been reused by another process)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import SimpleNamespace

import pytest

from gateway.sandbox import core as c
from gateway.sandbox.controller import HoldCounter, SandboxController, WakePolicy
from gateway.sandbox.recovery import _execute, _recover
from gateway.sandbox.states import Event, State
from gateway.store.registry import Registry, SandboxRecord
from tests.unit.test_controller import FakeMachine
from vmctl.spec import VMMRecord


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    yield reg
    reg.close()


def vmm(pid: int) -> VMMRecord:
    return VMMRecord("qemu", pid, "/nonexistent/qmp.sock", "/nonexistent/vm", "tcg", 0.0)


def make(registry, root, events: list[Event], record: VMMRecord | None = None,
         machine: FakeMachine | None = None) -> SandboxController:
    """A controller over a sandbox the registry left after ``events`` (from CREATING)."""
    now = time.time()
    rec = SandboxRecord(id="sb1", tenant="t", template="python", state=State.CREATING, slot=0,
                        root=str(root), golden="/g", idle_timeout=60, host="h",
                        created_at=now, updated_at=now, last_activity=now,
                        vmm=dict(record.__dict__) if record else None)
    registry.insert_sandbox(rec)
    for event in events:
        registry.transition("sb1", event)
    return SandboxController(registry.get("sb1"), machine or FakeMachine(), registry,
                             WakePolicy(), HoldCounter(),
                             lambda coro, name: asyncio.ensure_future(coro))


async def recover(ctl: SandboxController, alive: bool, snapshot: c.Snapshot,
                  record: VMMRecord) -> None:
    await _execute(ctl, c.Recovered(vmm_alive=alive, snapshot=snapshot), record)


async def test_a_suspending_sandboxs_vmm_is_killed_through_kill_recorded(registry, tmp_path):
    record = vmm(4242)
    ctl = make(registry, tmp_path, [Event.CREATED, Event.SUSPEND], record)
    await recover(ctl, True, c.Snapshot.USABLE, record)
    assert ctl.machine.calls == [("kill_recorded", record)]
    assert ctl.state is State.SUSPENDED


async def test_a_failed_sandboxs_vmm_is_killed_through_kill_recorded(registry, tmp_path):
    record = vmm(4242)
    ctl = make(registry, tmp_path, [Event.CREATED, Event.CRASHED], record)
    await recover(ctl, True, c.Snapshot.UNUSABLE, record)
    assert ctl.machine.calls == [("kill_recorded", record)]
    assert ctl.state is State.FAILED


async def test_a_vmm_that_cannot_be_adopted_is_killed_through_kill_recorded(registry, tmp_path):
    class Unadoptable(FakeMachine):
        async def adopt(self, record):
            self.calls.append(("adopt", record))
            raise RuntimeError("its control socket is gone")

    record = vmm(4242)
    ctl = make(registry, tmp_path, [Event.CREATED], record, machine=Unadoptable())
    await recover(ctl, True, c.Snapshot.UNUSABLE, record)
    assert ctl.machine.calls == [("adopt", record), ("kill_recorded", record)]
    assert ctl.state is State.FAILED and ctl.core.vmm_pid is None


async def _recover_creating(registry, tmp_path, pid: int) -> SandboxController:
    """Recover a sandbox recorded mid-create with a VMM record of ``pid``."""
    record = vmm(pid)
    ctl = make(registry, tmp_path, [], record)
    service = SimpleNamespace(registry=registry, controller=lambda rec: ctl,
                              forget=lambda sandbox_id: None)
    assert await _recover(service, registry.get("sb1")) is None  # type: ignore[arg-type]
    assert ctl.state is State.DESTROYED
    return ctl


async def test_a_mid_create_vmm_still_ours_is_killed_then_discarded(registry, tmp_path):
    # A process whose command line names the sandbox's directory, as its VMM's does.
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c",
                                                "import time; time.sleep(60)", str(tmp_path))
    try:
        ctl = await _recover_creating(registry, tmp_path, proc.pid)
        assert ctl.machine.calls[0] == ("kill_recorded", vmm(proc.pid))
        assert ("destroy",) in ctl.machine.calls
    finally:
        proc.kill()
        await proc.wait()


async def test_a_recorded_pid_that_is_no_longer_our_vmm_is_never_killed(registry, tmp_path):
    ctl = await _recover_creating(registry, tmp_path, os.getpid())  # alive, but not a VMM
    assert {call[0] for call in ctl.machine.calls} == {"destroy"}
