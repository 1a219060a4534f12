"""The sandbox core, event -> command, without I/O (microseconds per test)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gateway.sandbox import core as c
from gateway.sandbox.states import Event, State

S, E = State, Event


def core(state: State, **policy) -> c.SandboxCore:
    return c.SandboxCore(state, c.Policy(**policy))


def records(cmds) -> list[Event]:
    return [cmd.event for cmd in cmds if isinstance(cmd, c.Record)]


def kinds(cmds) -> list[type]:
    return [type(cmd) for cmd in cmds]


def ask(k: c.SandboxCore, waited=0.0, held=0):
    return k.handle(c.AdmissionAsked(waited_s=waited, held_globally=held))


# -- requests ------------------------------------------------------------------------------

def test_running_admits_and_counts():
    k = core(S.RUNNING)
    k.handle(c.RequestEntered())
    assert kinds(ask(k)) == [c.Admit] and (k.entering, k.active) == (0, 1)
    assert kinds(k.handle(c.RequestLeft(admitted=True, now=5.0))) == [c.Touch]
    assert k.active == 0 and k.idle_since == 5.0


@pytest.mark.parametrize("state", list(S))
def test_admit_now_admits_only_a_serving_sandbox_and_changes_nothing_else(state):
    k = core(state)
    cmds = k.handle(c.AdmitNow())
    if state is S.RUNNING:
        assert kinds(cmds) == [c.Admit] and (k.entering, k.active) == (0, 1)
        assert kinds(k.handle(c.RequestLeft(admitted=True, now=5.0))) == [c.Touch]
        assert k.active == 0
    else:  # never a wake, a hold or a record: the caller takes the waiting path
        assert cmds == [] and (k.state, k.op, k.entering, k.active) == (state, None, 0, 0)
    k.op = c.Op.SUSPEND  # an operation under way: not serving even when RUNNING
    assert k.handle(c.AdmitNow()) == [] and k.active == 0


def test_request_to_suspended_records_wake_then_starts_restore_then_holds():
    k = core(S.SUSPENDED)
    k.handle(c.RequestEntered())
    cmds = ask(k)
    assert cmds[0] == c.Record(E.WAKE, "woken by a request", {})
    assert cmds[1] == c.StartOp(c.Op.RESTORE) and isinstance(cmds[2], c.Hold)
    assert k.state is S.RESTORING and k.op is c.Op.RESTORE
    k.handle(c.RequestEntered())
    assert kinds(ask(k)) == [c.Hold]  # single flight: the second request only waits


def test_request_to_failed_cold_boots():
    k = core(S.FAILED)
    k.handle(c.RequestEntered())
    assert c.StartOp(c.Op.COLD_BOOT) in ask(k)


def test_hold_limits_and_deadline_reject_and_uncount():
    k = core(S.SUSPENDED, max_waiters_per_sandbox=1, wake_deadline=1.0)
    k.handle(c.RequestEntered())
    k.handle(c.RequestEntered())
    (rej,) = ask(k)
    assert isinstance(rej, c.Reject) and rej.error.code == "hold_queue_full"
    assert rej.error.headers["Retry-After"] and k.entering == 1
    (late,) = ask(k, waited=2.0)
    assert late.error.code == "wake_timeout" and k.entering == 0


def test_a_failed_sandbox_holds_by_the_cold_boot_deadline():
    k = core(S.FAILED, wake_deadline=1.0, cold_boot_deadline=5.0)
    k.handle(c.RequestEntered())
    *_, hold = ask(k, waited=2.0)  # past wake_deadline: a cold boot is allowed longer
    assert hold == c.Hold(3.0, 5.0) and k.op is c.Op.COLD_BOOT
    (late,) = ask(k, waited=5.5)
    assert late.error.code == "wake_timeout" and "5s" in str(late.error)


def test_a_restore_holds_by_the_wake_deadline():
    k = core(S.SUSPENDED, wake_deadline=1.0, cold_boot_deadline=5.0)
    k.handle(c.RequestEntered())
    *_, hold = ask(k, waited=0.25)
    assert hold == c.Hold(0.75, 1.0) and k.op is c.Op.RESTORE


def test_global_hold_limit():
    k = core(S.SUSPENDED, max_waiters_global=3)
    k.handle(c.RequestEntered())
    (rej,) = ask(k, held=3)
    assert rej.error.status == 503


def test_destroyed_rejects_404():
    k = core(S.DESTROYED)
    k.handle(c.RequestEntered())
    (rej,) = ask(k)
    assert rej.error.status == 404


def test_request_during_suspend_cancels_it_before_the_snapshot():
    k = core(S.RUNNING)
    assert kinds(k.handle(c.SuspendRequested("api"))) == [c.Record, c.StartOp]
    k.handle(c.RequestEntered())
    assert kinds(ask(k)) == [c.Hold] and k.cancel_suspend
    assert records(k.handle(c.DrainTick(now=0.0))) == [E.SUSPEND_ABORTED]
    assert k.state is S.RUNNING and k.op is None
    assert kinds(ask(k)) == [c.Admit]


def test_drain_waits_for_admitted_requests_then_gives_up_after_timeout():
    k = core(S.RUNNING, drain_timeout=10)
    k.handle(c.RequestEntered())
    ask(k)
    k.handle(c.SuspendRequested("api"))
    assert kinds(k.handle(c.DrainTick(now=100.0))) == [c.WaitDrain]
    assert kinds(k.handle(c.DrainTick(now=105.0))) == [c.WaitDrain]
    assert records(k.handle(c.DrainTick(now=111.0))) == [E.SUSPEND_ABORTED]


def test_drained_suspend_writes_snapshot_and_a_late_request_restores():
    k = core(S.RUNNING)
    k.handle(c.SuspendRequested("api"))
    assert kinds(k.handle(c.DrainTick(now=0.0))) == [c.WriteSnapshot]
    k.handle(c.RequestEntered())  # arrives while the snapshot is being written
    assert kinds(ask(k)) == [c.Hold]
    cmds = k.handle(c.SnapshotWritten(ms=12.0))
    assert records(cmds) == [E.SUSPENDED, E.WAKE] and c.StartOp(c.Op.RESTORE) in cmds
    assert cmds[0].fields["suspend_count"] == 1 and cmds[0].fields["vmm"] is None


def test_idle_tick_probes_guest_then_suspends_unless_busy():
    k = core(S.RUNNING)
    assert k.handle(c.IdleTick(now=10.0, timeout=60)) == []
    assert kinds(k.handle(c.IdleTick(now=61.0, timeout=60))) == [c.ProbeGuest]
    assert kinds(k.handle(c.GuestProbed(busy=True, now=61.0, timeout=60))) == [c.Touch]
    assert k.handle(c.IdleTick(now=62.0, timeout=60)) == []
    assert records(k.handle(c.GuestProbed(busy=False, now=200.0, timeout=60))) == [E.SUSPEND]
    assert k.handle(c.IdleTick(now=999.0, timeout=0)) == []  # 0 = never


def test_suspend_of_a_non_running_sandbox_is_rejected():
    (rej,) = core(S.SUSPENDED).handle(c.SuspendRequested("api"))
    assert isinstance(rej, c.Reject) and rej.error.status == 409


def test_suspend_failure():
    k = core(S.RUNNING)
    k.handle(c.SuspendRequested("x"))
    assert records(k.handle(c.SuspendFailed("disk full", vm_alive=True))) == [E.SUSPEND_ABORTED]
    assert k.state is S.RUNNING
    k.handle(c.SuspendRequested("x"))
    assert records(k.handle(c.SuspendFailed("qmp", vm_alive=False))) == [E.SUSPEND_FAILED]
    assert k.state is S.FAILED


# -- restores --------------------------------------------------------------------------------

def restoring(**policy) -> c.SandboxCore:
    k = core(S.SUSPENDED, **policy)
    k.handle(c.RequestEntered())
    ask(k)
    return k


def test_restore_finished_records_and_watches_the_vmm():
    k = restoring()
    cmds = k.handle(c.RestoreFinished(ms=80.0, vmm={"pid": 42}))
    assert records(cmds) == [E.RESTORED] and c.Watch(42) in cmds and k.vmm_pid == 42
    assert cmds[0].fields["restore_count"] == 1 and cmds[0].fields["failure"] is None


@pytest.mark.parametrize("guest_started,unusable", [(True, False), (False, True)])
def test_restore_failures_that_cannot_improve_fall_back_to_a_cold_boot_at_once(
        guest_started, unusable):
    k = restoring()
    cmds = k.handle(c.RestoreFailedEvent("/var/lib/x/memory does not match its SHA256",
                                         guest_started, unusable))
    assert records(cmds) == [E.SNAPSHOT_LOST, E.WAKE] and cmds[-1] == c.StartOp(c.Op.COLD_BOOT)
    assert cmds[0].fields["failure"] == "restore failed: memory does not match its SHA256"
    assert k.state is S.RESTORING and k.op is c.Op.COLD_BOOT
    # a failed cold boot is not retried at once (no loop): FAILED until the next request
    assert records(k.handle(c.RestoreFailedEvent("no disk", True, False))) == [E.SNAPSHOT_LOST]
    assert k.op is None and k.state is S.FAILED
    k.handle(c.RequestEntered())
    assert c.StartOp(c.Op.COLD_BOOT) in ask(k)


def test_a_failed_sandbox_with_no_disk_is_answered_sandbox_lost_never_booted():
    # Adopted with nothing (its host died before any of it was shipped): the shell found
    # no disk, so the core rejects every request at once (410), starts nothing, and the
    # sandbox can still be destroyed.
    k = c.SandboxCore(S.FAILED, c.Policy(cold_boot_failed_at_once=True), lost=True)
    k.handle(c.RequestEntered())
    [reject] = ask(k)
    assert isinstance(reject, c.Reject) and reject.error.code == "sandbox_lost"
    assert reject.error.status == 410 and (k.state, k.op, k.entering) == (S.FAILED, None, 0)
    assert records(k.handle(c.DestroyRequested("deleted by API"))) == [E.DESTROY]
    # A cold boot that finds no disk: FAILED, lost from then on (no second attempt).
    k = core(S.FAILED)
    k.handle(c.RequestEntered())
    assert c.StartOp(c.Op.COLD_BOOT) in ask(k)
    cmds = k.handle(c.RestoreFailedEvent("the sandbox has no disk to boot", False, False,
                                         disk_missing=True))
    assert records(cmds) == [E.SNAPSHOT_LOST] and (k.state, k.op, k.lost) == (S.FAILED, None, True)
    assert c.wake_error("s", "x", False, lost=True).code == "sandbox_lost"
    k.handle(c.RequestEntered())
    assert isinstance(ask(k)[-1], c.Reject)


def test_transient_restore_failures_are_retried_a_bounded_number_of_times():
    k = restoring(max_restore_attempts=2)
    assert records(k.handle(c.RestoreFailedEvent("EMFILE", False, False))) == [E.RESTORE_FAILED]
    assert k.state is S.SUSPENDED
    k.handle(c.RequestEntered())
    ask(k)
    cmds = k.handle(c.RestoreFailedEvent("EMFILE", False, False))
    assert records(cmds) == [E.SNAPSHOT_LOST, E.WAKE] and k.op is c.Op.COLD_BOOT


def test_cold_boot_at_once_policy_after_a_crash():
    k = restoring(cold_boot_failed_at_once=True)
    k.handle(c.RestoreFinished(ms=1.0, vmm={"pid": 7}))
    cmds = k.handle(c.VMMExited(pid=7))
    assert records(cmds) == [E.CRASHED, E.WAKE] and cmds[-1] == c.StartOp(c.Op.COLD_BOOT)
    k2 = core(S.RUNNING)
    k2.handle(c.Recovered(vmm_alive=False, snapshot=X))
    assert not k2.op  # default: on the next request


# -- the VMM dies ------------------------------------------------------------------------------

def test_vmm_exit_while_running_fails_the_sandbox_and_aborts_its_requests():
    k = restoring()
    k.handle(c.RestoreFinished(ms=1.0, vmm={"pid": 7}))
    assert k.handle(c.VMMExited(pid=8)) == []  # not ours
    cmds = k.handle(c.VMMExited(pid=7))
    assert isinstance(cmds[0], c.AbortRequests) and cmds[0].error.status == 503
    assert cmds[0].error.headers["Retry-After"]
    assert records(cmds) == [E.CRASHED] and k.state is S.FAILED
    assert k.handle(c.VMMExited(pid=7)) == []  # reported once


def test_vmm_exit_during_drain_aborts_requests_and_leaves_the_outcome_to_the_suspend():
    k = restoring()
    k.handle(c.RestoreFinished(ms=1.0, vmm={"pid": 7}))
    k.handle(c.SuspendRequested("x"))
    assert kinds(k.handle(c.VMMExited(pid=7))) == [c.AbortRequests]
    assert k.state is S.SUSPENDING


def test_destroy():
    cmds = core(S.SUSPENDED).handle(c.DestroyRequested("api"))
    assert records(cmds) == [E.DESTROY] and isinstance(cmds[-1], c.RemoveResources)


# -- start-up recovery -----------------------------------------------------------------------

def test_recovery_table_covers_every_case():
    for state, alive, snap in itertools.product(State, (True, False), c.Snapshot):
        assert (state, alive, snap) in c.RECOVERY, (state, alive, snap)


U, X = c.Snapshot.USABLE, c.Snapshot.UNUSABLE
EXPECTED = [
    # recorded, alive, snapshot -> step, state after success, state after a failed step
    (S.RUNNING, True, U, c.Step.ADOPT, S.RUNNING, S.FAILED),
    (S.RUNNING, False, X, c.Step.NOTHING, S.FAILED, None),
    (S.CREATING, True, X, c.Step.DISCARD, S.DESTROYED, None),
    (S.SUSPENDING, True, U, c.Step.KILL, S.SUSPENDED, None),
    (S.SUSPENDING, True, X, c.Step.RESUME, S.RUNNING, S.FAILED),
    (S.SUSPENDING, False, U, c.Step.NOTHING, S.SUSPENDED, None),
    (S.SUSPENDING, False, X, c.Step.NOTHING, S.FAILED, None),
    # the bug this table exists for: a live VMM mid-restore is adopted, never killed
    (S.RESTORING, True, U, c.Step.FINISH_RESTORE, S.RUNNING, S.SUSPENDED),
    (S.RESTORING, True, X, c.Step.FINISH_RESTORE, S.RUNNING, S.FAILED),
    (S.RESTORING, False, U, c.Step.NOTHING, S.SUSPENDED, None),
    (S.RESTORING, False, X, c.Step.NOTHING, S.FAILED, None),
    (S.SUSPENDED, True, U, c.Step.KILL, S.SUSPENDED, None),
    (S.SUSPENDED, False, X, c.Step.NOTHING, S.FAILED, None),
    (S.FAILED, True, X, c.Step.KILL, S.FAILED, None),
    (S.DESTROYED, False, X, c.Step.DISCARD, S.DESTROYED, None),
]


@pytest.mark.parametrize("state,alive,snap,step,after,after_failure", EXPECTED)
def test_recovery(state, alive, snap, step, after, after_failure):
    k = core(state)
    cmds = k.handle(c.Recovered(vmm_alive=alive, snapshot=snap))
    if step is c.Step.NOTHING:
        assert not any(isinstance(x, c.RunStep) for x in cmds)
    else:
        assert cmds == [c.RunStep(step)]
        cmds = k.handle(c.RecoveryStepDone({"pid": 9} if step in (
            c.Step.ADOPT, c.Step.RESUME, c.Step.FINISH_RESTORE) else None))
    assert k.state is after, cmds
    if step in (c.Step.ADOPT, c.Step.RESUME, c.Step.FINISH_RESTORE):
        assert c.Watch(9) in cmds and k.vmm_pid == 9
    if after_failure is not None:
        k2 = core(state)
        k2.handle(c.Recovered(vmm_alive=alive, snapshot=snap))
        cmds = k2.handle(c.RecoveryStepFailed("agent silent"))
        assert cmds[0] == c.RunStep(c.Step.KILL) and k2.state is after_failure


def test_failed_recovery_records_a_cause_without_host_paths():
    k = core(S.RUNNING)
    k.handle(c.Recovered(vmm_alive=True, snapshot=X))
    cmds = k.handle(c.RecoveryStepFailed("cannot connect to /run/agentbox/abc.qmp"))
    (rec,) = [x for x in cmds if isinstance(x, c.Record)]
    assert "/run" not in rec.fields["failure"] and "abc.qmp" in rec.fields["failure"]


def test_public_cause_is_bounded():
    assert len(c.public_cause("x" * 10_000)) == c.MAX_CAUSE


def test_operations_doc_has_the_recovery_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert c.recovery_table_markdown() in doc, "regenerate: python -m gateway.sandbox.core"


def test_causes_from_untrusted_text_are_bounded_before_the_registry():
    # A cause carries exception text, which can come from the guest (agent error messages).
    k = core(S.CREATING)
    k.begin_create()
    flood = "guest says: " + "x" * 1_000_000
    (rec,) = [x for x in k.handle(c.CreateFailed(flood)) if isinstance(x, c.Record)]
    assert len(rec.cause) <= c.MAX_RECORDED_CAUSE and rec.cause.startswith("create failed")
    assert len(rec.fields["failure"]) <= c.MAX_CAUSE
