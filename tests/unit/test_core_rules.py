"""The core's runtime rules as one table: (state and operation before, event) -> (commands,
state and operation after), as ``test_core.py`` does for ``RECOVERY``.

A row reads like the rule it pins: "a request asks while SUSPENDED -> record the wake,
start a restore, hold it". Commands are written short (``summary``): ``record:<event>``,
``start:<op>``, ``hold:<timeout>/<deadline>``, ``reject:<code>``, ``abort:<code>``,
``watch:<pid>``, and ``admit``, ``touch``, ``probe``, ``wait_drain``, ``write_snapshot``,
``remove``. Sequences that span several events live in ``test_core.py`` and
``test_core_pause.py``; this table is the one-step view, one row per branch of ``handle``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.sandbox import core as c
from gateway.sandbox.states import State

S, Op = State, c.Op
VMM = {"pid": 9}
RECOVERY_EVENTS = {c.Recovered, c.RecoveryStepDone, c.RecoveryStepFailed}


@dataclass(frozen=True)
class At:
    """A core's situation before the event: state, operation, counters, policy."""

    state: State
    op: c.Op | None = None
    entering: int = 0
    active: int = 0
    vmm_pid: int | None = 9
    policy: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)  # cancel_suspend, failed_restores...

    def core(self) -> c.SandboxCore:
        k = c.SandboxCore(self.state, c.Policy(**self.policy), vmm_pid=self.vmm_pid)
        k.op, k.entering, k.active = self.op, self.entering, self.active
        for name, value in self.attrs.items():
            setattr(k, name, value)
        return k


def summary(cmds: list[c.Command]) -> list[str]:
    out = []
    for cmd in cmds:
        if isinstance(cmd, c.Record):
            out.append(f"record:{cmd.event.value}")
        elif isinstance(cmd, c.StartOp):
            out.append(f"start:{cmd.op.value}")
        elif isinstance(cmd, c.Hold):
            out.append(f"hold:{cmd.timeout:g}/{cmd.deadline:g}")
        elif isinstance(cmd, (c.Reject, c.AbortRequests)):
            kind = "reject" if isinstance(cmd, c.Reject) else "abort"
            out.append(f"{kind}:{cmd.error.code}")
        elif isinstance(cmd, c.Watch):
            out.append(f"watch:{cmd.pid}")
        else:
            out.append({c.Admit: "admit", c.Touch: "touch", c.ProbeGuest: "probe",
                        c.WaitDrain: "wait_drain", c.WriteSnapshot: "write_snapshot",
                        c.RemoveResources: "remove"}[type(cmd)])
    return out


def row(name: str, before: At, event: object, cmds: list[str], state: State,
        op: c.Op | None = None):
    return pytest.param(before, event, cmds, state, op, id=name)


ASK = c.AdmissionAsked(waited_s=0.0, held_globally=0)
AT_ONCE = {"cold_boot_failed_at_once": True}
PAUSING = {"suspend_after_pause": 10.0}
IDLE = c.IdleTick(now=100.0, timeout=60.0)
QUIET = c.GuestProbed(busy=False, now=100.0, timeout=60.0)
WAKING = {"restore": "a request arrived"}

RULES = [
    # -- a request arrives, asks to be admitted, leaves ------------------------------------
    row("entered-counts", At(S.RUNNING), c.RequestEntered(), [], S.RUNNING),
    row("asked-running", At(S.RUNNING, entering=1), ASK, ["admit"], S.RUNNING),
    row("asked-suspended", At(S.SUSPENDED, entering=1, vmm_pid=None), ASK,
        ["record:wake", "start:restore", "hold:30/30"], S.RESTORING, Op.RESTORE),
    row("asked-failed-cold-boots", At(S.FAILED, entering=1, vmm_pid=None), ASK,
        ["record:wake", "start:cold_boot", "hold:100/100"], S.RESTORING, Op.COLD_BOOT),
    row("asked-paused", At(S.PAUSED, entering=1), ASK,
        ["record:unpause", "start:unpause", "hold:30/30"], S.RUNNING, Op.UNPAUSE),
    row("asked-pausing", At(S.PAUSED, Op.PAUSE, entering=1), ASK, ["hold:30/30"],
        S.PAUSED, Op.PAUSE),
    row("asked-suspending-cancels-it", At(S.SUSPENDING, Op.SUSPEND, entering=1), ASK,
        ["hold:30/30"], S.SUSPENDING, Op.SUSPEND),
    row("asked-restoring", At(S.RESTORING, Op.RESTORE, entering=1), ASK, ["hold:30/30"],
        S.RESTORING, Op.RESTORE),
    row("asked-cold-booting", At(S.RESTORING, Op.COLD_BOOT, entering=1),
        c.AdmissionAsked(waited_s=40.0, held_globally=0), ["hold:60/100"],
        S.RESTORING, Op.COLD_BOOT),
    row("asked-unpausing", At(S.RUNNING, Op.UNPAUSE, entering=1), ASK, ["hold:30/30"],
        S.RUNNING, Op.UNPAUSE),
    row("asked-creating", At(S.CREATING, Op.CREATE, entering=1), ASK, ["hold:30/30"],
        S.CREATING, Op.CREATE),
    row("asked-destroyed", At(S.DESTROYED, entering=1), ASK, ["reject:sandbox_not_found"],
        S.DESTROYED),
    row("asked-queue-full", At(S.SUSPENDED, entering=1001), ASK,
        ["reject:hold_queue_full"], S.SUSPENDED),
    row("asked-global-queue-full", At(S.SUSPENDED, entering=1),
        c.AdmissionAsked(waited_s=0.0, held_globally=10000), ["reject:hold_queue_full"],
        S.SUSPENDED),
    row("asked-too-late", At(S.RESTORING, Op.RESTORE, entering=1),
        c.AdmissionAsked(waited_s=30.0, held_globally=0), ["reject:wake_timeout"],
        S.RESTORING, Op.RESTORE),
    row("admit-now-serving", At(S.RUNNING), c.AdmitNow(), ["admit"], S.RUNNING),
    row("admit-now-paused", At(S.PAUSED), c.AdmitNow(), [], S.PAUSED),
    row("admit-now-busy", At(S.RUNNING, Op.SUSPEND), c.AdmitNow(), [], S.RUNNING, Op.SUSPEND),
    row("left-admitted", At(S.RUNNING, active=1), c.RequestLeft(admitted=True, now=5.0),
        ["touch"], S.RUNNING),
    row("left-while-held", At(S.RESTORING, Op.RESTORE, entering=1),
        c.RequestLeft(admitted=False, now=5.0), [], S.RESTORING, Op.RESTORE),
    # -- idle: probe the guest, then pause or suspend -----------------------------------------
    row("idle-probes", At(S.RUNNING), IDLE, ["probe"], S.RUNNING),
    row("idle-never", At(S.RUNNING), c.IdleTick(now=100.0, timeout=0.0), [], S.RUNNING),
    row("idle-not-yet", At(S.RUNNING), c.IdleTick(now=30.0, timeout=60.0), [], S.RUNNING),
    row("idle-in-use", At(S.RUNNING, active=1), IDLE, [], S.RUNNING),
    row("idle-busy-op", At(S.RUNNING, Op.UNPAUSE), IDLE, [], S.RUNNING, Op.UNPAUSE),
    row("idle-paused-long-enough", At(S.PAUSED, policy=PAUSING), IDLE,
        ["record:suspend", "start:suspend"], S.SUSPENDING, Op.SUSPEND),
    row("idle-paused-not-long-enough", At(S.PAUSED, policy=PAUSING),
        c.IdleTick(now=5.0, timeout=60.0), [], S.PAUSED),
    row("idle-paused-request-waiting", At(S.PAUSED, entering=1, policy=PAUSING), IDLE, [],
        S.PAUSED),
    row("idle-paused-never", At(S.PAUSED, policy=PAUSING), c.IdleTick(now=100.0, timeout=0.0),
        [], S.PAUSED),
    row("probed-quiet-suspends", At(S.RUNNING), QUIET, ["record:suspend", "start:suspend"],
        S.SUSPENDING, Op.SUSPEND),
    row("probed-quiet-pauses", At(S.RUNNING, policy=PAUSING), QUIET,
        ["record:pause", "start:pause"], S.PAUSED, Op.PAUSE),
    row("probed-busy", At(S.RUNNING), c.GuestProbed(busy=True, now=100.0, timeout=60.0),
        ["touch"], S.RUNNING),
    row("probed-request-came", At(S.RUNNING, active=1), QUIET, [], S.RUNNING),
    # -- suspend -------------------------------------------------------------------------------
    row("suspend-running", At(S.RUNNING), c.SuspendRequested("api"),
        ["record:suspend", "start:suspend"], S.SUSPENDING, Op.SUSPEND),
    row("suspend-paused", At(S.PAUSED), c.SuspendRequested("api"),
        ["record:suspend", "start:suspend"], S.SUSPENDING, Op.SUSPEND),
    row("suspend-suspended", At(S.SUSPENDED), c.SuspendRequested("api"),
        ["reject:not_running"], S.SUSPENDED),
    row("suspend-busy", At(S.RUNNING, Op.UNPAUSE), c.SuspendRequested("api"),
        ["reject:not_running"], S.RUNNING, Op.UNPAUSE),
    row("drain-waits", At(S.SUSPENDING, Op.SUSPEND, active=1), c.DrainTick(1.0),
        ["wait_drain"], S.SUSPENDING, Op.SUSPEND),
    row("drain-done", At(S.SUSPENDING, Op.SUSPEND), c.DrainTick(1.0), ["write_snapshot"],
        S.SUSPENDING, Op.SUSPEND),
    row("drain-cancelled-by-request", At(S.SUSPENDING, Op.SUSPEND, entering=1,
                                         attrs={"cancel_suspend": True}),
        c.DrainTick(1.0), ["record:suspend_aborted"], S.RUNNING),
    row("drain-gives-up", At(S.SUSPENDING, Op.SUSPEND, active=1,
                             attrs={"_drain_deadline": 50.0}),
        c.DrainTick(100.0), ["record:suspend_aborted"], S.RUNNING),
    row("drain-request-just-in", At(S.SUSPENDING, Op.SUSPEND, entering=1), c.DrainTick(1.0),
        ["record:suspend_aborted"], S.RUNNING),
    row("drain-cancelled-from-pause", At(S.SUSPENDING, Op.SUSPEND, entering=1,
                                         attrs={"_suspend_from_pause": True}),
        c.DrainTick(1.0), ["record:suspend_aborted", "start:unpause"], S.RUNNING, Op.UNPAUSE),
    row("snapshot-written", At(S.SUSPENDING, Op.SUSPEND), c.SnapshotWritten(120.0),
        ["record:suspended"], S.SUSPENDED),
    row("snapshot-written-request-waits", At(S.SUSPENDING, Op.SUSPEND, entering=1),
        c.SnapshotWritten(120.0), ["record:suspended", "record:wake", "start:restore"],
        S.RESTORING, Op.RESTORE),
    row("suspend-failed-vm-resumed", At(S.SUSPENDING, Op.SUSPEND),
        c.SuspendFailed("qmp", vm_alive=True), ["record:suspend_aborted"], S.RUNNING),
    row("suspend-failed-vm-lost", At(S.SUSPENDING, Op.SUSPEND),
        c.SuspendFailed("qmp", vm_alive=False), ["record:suspend_failed"], S.FAILED),
    row("suspend-failed-vm-lost-boot-at-once", At(S.SUSPENDING, Op.SUSPEND, policy=AT_ONCE),
        c.SuspendFailed("qmp", vm_alive=False),
        ["record:suspend_failed", "record:wake", "start:cold_boot"], S.RESTORING, Op.COLD_BOOT),
    # -- pause / unpause -------------------------------------------------------------------
    row("pause-running", At(S.RUNNING), c.PauseRequested("pool"),
        ["record:pause", "start:pause"], S.PAUSED, Op.PAUSE),
    row("pause-in-use", At(S.RUNNING, active=1), c.PauseRequested("pool"),
        ["reject:not_running"], S.RUNNING),
    row("pause-request-waiting", At(S.RUNNING, entering=1), c.PauseRequested("pool"),
        ["reject:not_running"], S.RUNNING),
    row("pause-paused", At(S.PAUSED), c.PauseRequested("pool"), ["reject:not_running"],
        S.PAUSED),
    row("paused", At(S.PAUSED, Op.PAUSE), c.PauseFinished(7.0), [], S.PAUSED),
    row("paused-request-waits", At(S.PAUSED, Op.PAUSE, entering=1), c.PauseFinished(7.0),
        ["record:unpause", "start:unpause"], S.RUNNING, Op.UNPAUSE),
    row("pause-failed-vm-runs", At(S.PAUSED, Op.PAUSE), c.PauseFailed("qmp", vm_alive=True),
        ["record:unpause"], S.RUNNING),
    row("pause-failed-vm-lost", At(S.PAUSED, Op.PAUSE), c.PauseFailed("qmp", vm_alive=False),
        ["record:crashed"], S.FAILED),
    row("unpaused", At(S.RUNNING, Op.UNPAUSE), c.UnpauseFinished(3.0), ["touch"], S.RUNNING),
    row("unpause-failed", At(S.RUNNING, Op.UNPAUSE), c.UnpauseFailed("agent silent"),
        ["record:crashed"], S.FAILED),
    row("unpause-failed-boot-at-once", At(S.RUNNING, Op.UNPAUSE, policy=AT_ONCE),
        c.UnpauseFailed("agent silent"), ["record:crashed", "record:wake", "start:cold_boot"],
        S.RESTORING, Op.COLD_BOOT),
    # -- create --------------------------------------------------------------------------------
    row("created", At(S.CREATING, Op.CREATE, vmm_pid=None), c.CreateFinished(VMM),
        ["record:created", "watch:9", "touch"], S.RUNNING),
    row("created-no-vmm-record", At(S.CREATING, Op.CREATE, vmm_pid=None),
        c.CreateFinished(None), ["record:created", "touch"], S.RUNNING),
    row("create-failed", At(S.CREATING, Op.CREATE, vmm_pid=None), c.CreateFailed("boom"),
        ["record:create_failed"], S.FAILED),
    # -- restore / cold boot ---------------------------------------------------------------
    row("restored", At(S.RESTORING, Op.RESTORE, vmm_pid=None), c.RestoreFinished(80.0, VMM),
        ["record:restored", "watch:9", "touch"], S.RUNNING),
    row("cold-booted", At(S.RESTORING, Op.COLD_BOOT, vmm_pid=None),
        c.RestoreFinished(8000.0, VMM), ["record:restored", "watch:9", "touch"], S.RUNNING),
    row("restore-failed-transient", At(S.RESTORING, Op.RESTORE, vmm_pid=None),
        c.RestoreFailedEvent("timeout", guest_started=False, snapshot_unusable=False),
        ["record:restore_failed"], S.SUSPENDED),
    row("restore-failed-again-cold-boots", At(S.RESTORING, Op.RESTORE, vmm_pid=None,
                                              attrs={"failed_restores": 1}),
        c.RestoreFailedEvent("timeout", guest_started=False, snapshot_unusable=False),
        ["record:snapshot_lost", "record:wake", "start:cold_boot"], S.RESTORING, Op.COLD_BOOT),
    row("restore-failed-guest-ran", At(S.RESTORING, Op.RESTORE, vmm_pid=None),
        c.RestoreFailedEvent("agent", guest_started=True, snapshot_unusable=False),
        ["record:snapshot_lost", "record:wake", "start:cold_boot"], S.RESTORING, Op.COLD_BOOT),
    row("restore-failed-snapshot-unusable", At(S.RESTORING, Op.RESTORE, vmm_pid=None),
        c.RestoreFailedEvent("bad", guest_started=False, snapshot_unusable=True),
        ["record:snapshot_lost", "record:wake", "start:cold_boot"], S.RESTORING, Op.COLD_BOOT),
    row("cold-boot-failed-waits-for-a-request", At(S.RESTORING, Op.COLD_BOOT, vmm_pid=None,
                                                   policy=AT_ONCE),
        c.RestoreFailedEvent("boot", guest_started=True, snapshot_unusable=True),
        ["record:snapshot_lost"], S.FAILED),
    # -- the VMM died ----------------------------------------------------------------------
    row("vmm-lost-running", At(S.RUNNING, active=1), c.VMMExited(9),
        ["abort:sandbox_crashed", "record:crashed"], S.FAILED),
    row("vmm-lost-paused", At(S.PAUSED), c.VMMExited(9),
        ["abort:sandbox_crashed", "record:crashed"], S.FAILED),
    row("vmm-lost-boot-at-once", At(S.RUNNING, policy=AT_ONCE), c.VMMExited(9),
        ["abort:sandbox_crashed", "record:crashed", "record:wake", "start:cold_boot"],
        S.RESTORING, Op.COLD_BOOT),
    row("vmm-lost-suspending", At(S.SUSPENDING, Op.SUSPEND, active=1), c.VMMExited(9),
        ["abort:sandbox_crashed"], S.SUSPENDING, Op.SUSPEND),
    row("vmm-lost-unpausing", At(S.RUNNING, Op.UNPAUSE), c.VMMExited(9), [],
        S.RUNNING, Op.UNPAUSE),
    row("vmm-old-pid", At(S.RUNNING), c.VMMExited(8), [], S.RUNNING),
    row("vmm-stopped-on-purpose", At(S.SUSPENDED, vmm_pid=None), c.VMMExited(9), [],
        S.SUSPENDED),
    # -- delete --------------------------------------------------------------------------------
    row("destroy-running", At(S.RUNNING), c.DestroyRequested("api"),
        ["record:destroy", "remove"], S.DESTROYED),
    row("destroy-suspended", At(S.SUSPENDED, vmm_pid=None), c.DestroyRequested("ttl"),
        ["record:destroy", "remove"], S.DESTROYED),
    row("destroy-failed", At(S.FAILED, vmm_pid=None), c.DestroyRequested("api"),
        ["record:destroy", "remove"], S.DESTROYED),
    # -- live migration (a drain) ----------------------------------------------------------
    row("migrate-running", At(S.RUNNING), c.MigrateRequested("host-b"),
        ["start:migrate"], S.RUNNING, Op.MIGRATE),
    row("migrate-refused-while-suspending", At(S.SUSPENDING, Op.SUSPEND),
        c.MigrateRequested("host-b"), ["reject:not_running"], S.SUSPENDING, Op.SUSPEND),
    row("migrate-refused-paused", At(S.PAUSED), c.MigrateRequested("host-b"),
        ["reject:not_running"], S.PAUSED),
    row("move-waits-for-requests-in-flight", At(S.RUNNING, Op.MIGRATE, active=1),
        c.DrainTick(1.0), ["wait_drain"], S.RUNNING, Op.MIGRATE),
    row("move-goes-once-none-in-flight", At(S.RUNNING, Op.MIGRATE), c.DrainTick(1.0), [],
        S.RUNNING, Op.MIGRATE),
    row("move-stops-waiting-for-an-endless-stream", At(S.RUNNING, Op.MIGRATE, active=1,
                                                       attrs={"_drain_deadline": 50.0}),
        c.DrainTick(100.0), [], S.RUNNING, Op.MIGRATE),
    row("request-held-during-migration", At(S.RUNNING, Op.MIGRATE, entering=1), ASK,
        ["hold:30/30"], S.RUNNING, Op.MIGRATE),
    row("migrated-aborts-the-requests-using-it", At(S.RUNNING, Op.MIGRATE, active=1),
        c.MigrateFinished("host-b"), ["record:destroy", "abort:owner_unavailable", "remove"],
        S.DESTROYED),
    row("held-request-after-the-move-goes-to-the-new-owner",
        At(S.DESTROYED, vmm_pid=None, entering=1, attrs={"moved_to": "host-b"}), ASK,
        ["reject:owner_unavailable"], S.DESTROYED),
    row("migration-failed-vm-runs-here", At(S.RUNNING, Op.MIGRATE, entering=1),
        c.MigrateFailed("destination died", vm_alive=True), ["touch"], S.RUNNING),
    row("migration-failed-vm-lost", At(S.RUNNING, Op.MIGRATE),
        c.MigrateFailed("source died", vm_alive=False), ["record:crashed"], S.FAILED),
    # a suspended sandbox handed over by its record (its snapshot shipped)
    row("migrate-suspended", At(S.SUSPENDED, vmm_pid=None), c.MigrateRequested("host-b"),
        ["start:migrate"], S.SUSPENDED, Op.MIGRATE),
    row("migrate-refused-while-waking", At(S.SUSPENDED, Op.RESTORE, vmm_pid=None),
        c.MigrateRequested("host-b"), ["reject:not_running"], S.SUSPENDED, Op.RESTORE),
    row("request-held-not-woken-during-handover",
        At(S.SUSPENDED, Op.MIGRATE, vmm_pid=None, entering=1), ASK, ["hold:30/30"],
        S.SUSPENDED, Op.MIGRATE),
    row("handed-over-suspended-goes", At(S.SUSPENDED, Op.MIGRATE, vmm_pid=None, entering=1),
        c.MigrateFinished("host-b"), ["record:destroy", "abort:owner_unavailable", "remove"],
        S.DESTROYED),
    row("handover-failed-stays-suspended",
        At(S.SUSPENDED, Op.MIGRATE, vmm_pid=None, entering=1),
        c.MigrateFailed("record changed", vm_alive=False), [], S.SUSPENDED),
    row("held-request-after-handover-failed-wakes-here",
        At(S.SUSPENDED, vmm_pid=None, entering=1), ASK,
        ["record:wake", "start:restore", "hold:30/30"], S.RESTORING, Op.RESTORE),
]


@pytest.mark.parametrize("before,event,cmds,state,op", RULES)
def test_runtime_rule(before: At, event: object, cmds: list[str], state: State,
                      op: c.Op | None) -> None:
    k = before.core()
    assert summary(k.handle(event)) == cmds
    assert (k.state, k.op) == (state, op)


def test_every_rule_is_in_the_table():
    """A handler missing from ``RULES`` would never run."""
    handlers = {name for name in vars(c.SandboxCore) if name.startswith("_on_")}
    assert {f"_on_{t.__name__}" for t in c.RULES} == handlers
    assert all(c.RULES[t] is getattr(c.SandboxCore, f"_on_{t.__name__}") for t in c.RULES)


def test_every_runtime_event_has_a_row():
    runtime = set(c.RULES) - RECOVERY_EVENTS
    in_table = {type(p.values[1]) for p in RULES}
    assert runtime - in_table == set()


@pytest.mark.parametrize("state", [S.RUNNING, S.SUSPENDED, S.SUSPENDING, S.PAUSED, S.FAILED,
                                   S.RESTORING, S.CREATING, S.DESTROYED])
def test_a_request_arriving_in_each_state_has_a_row(state: State) -> None:
    assert any(p.values[0].state is state and isinstance(p.values[1], c.AdmissionAsked)
               for p in RULES)


def test_counters_move_with_admission():
    """The table's commands, and what they do to the counters the next rows read."""
    k = At(S.RUNNING, entering=1).core()
    k.handle(ASK)
    assert (k.entering, k.active) == (0, 1)
    k = At(S.DESTROYED, entering=1).core()
    k.handle(ASK)
    assert k.entering == 0  # a rejected request leaves the queue
    k = At(S.SUSPENDING, Op.SUSPEND, entering=1).core()
    k.handle(ASK)
    assert k.cancel_suspend  # a request during the drain cancels the suspend


def test_an_unknown_event_has_no_rule():
    with pytest.raises(TypeError):
        At(S.RUNNING).core().handle(object())


def test_create_is_begun_not_reported():
    """A create starts from the service (``begin_create``), not from an event."""
    k = At(S.CREATING, vmm_pid=None).core()
    assert summary(k.begin_create()) == ["start:create"]
    assert (k.state, k.op) == (S.CREATING, Op.CREATE)
