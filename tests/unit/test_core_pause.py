"""Pause before snapshot in the sandbox core, event -> command, and its decisions
(gateway.sandbox.pause_policy), without I/O."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sandbox import core as c
from gateway.sandbox import pause_policy
from gateway.sandbox.states import Event, IllegalTransition, State, next_state

S, E = State, Event


def core(state: State, **policy) -> c.SandboxCore:
    return c.SandboxCore(state, c.Policy(**policy))


def records(cmds) -> list[Event]:
    return [cmd.event for cmd in cmds if isinstance(cmd, c.Record)]


def ask(k: c.SandboxCore):
    return k.handle(c.AdmissionAsked(waited_s=0.0, held_globally=0))


def paused(k: c.SandboxCore, now: float = 100.0) -> c.SandboxCore:
    """Drive an idle RUNNING core through probe and pause."""
    assert k.handle(c.IdleTick(now, 10)) == [c.ProbeGuest()]
    cmds = k.handle(c.GuestProbed(False, now, 10))
    assert records(cmds) == [E.PAUSE] and cmds[-1] == c.StartOp(c.Op.PAUSE)
    assert k.state is S.PAUSED and k.op is c.Op.PAUSE
    assert k.handle(c.PauseFinished(now)) == [] and k.op is None
    return k


def test_table_has_the_paused_moves():
    assert next_state(S.RUNNING, E.PAUSE) is S.PAUSED
    assert next_state(S.PAUSED, E.UNPAUSE) is S.RUNNING
    assert next_state(S.PAUSED, E.SUSPEND) is S.SUSPENDING
    assert next_state(S.PAUSED, E.CRASHED) is S.FAILED
    assert next_state(S.PAUSED, E.DESTROY) is S.DESTROYED
    for bad in (E.WAKE, E.RESTORED, E.PAUSE, E.SUSPENDED):
        with pytest.raises(IllegalTransition):
            next_state(S.PAUSED, bad)


def test_idle_without_pause_policy_suspends_at_once():
    k = core(S.RUNNING)
    k.handle(c.IdleTick(100.0, 10))
    assert records(k.handle(c.GuestProbed(False, 100.0, 10))) == [E.SUSPEND]


def test_idle_with_pause_policy_pauses_and_a_busy_guest_is_not_paused():
    paused(core(S.RUNNING, suspend_after_pause=60))
    k = core(S.RUNNING, suspend_after_pause=60)
    k.handle(c.IdleTick(100.0, 10))
    assert k.handle(c.GuestProbed(True, 100.0, 10)) == [c.Touch()] and k.state is S.RUNNING


def test_request_to_paused_records_unpause_before_the_cont_and_holds():
    k = paused(core(S.RUNNING, suspend_after_pause=60))
    k.handle(c.RequestEntered())
    cmds = ask(k)
    assert cmds[0] == c.Record(E.UNPAUSE, "woken by a request", {})
    assert cmds[1] == c.StartOp(c.Op.UNPAUSE) and isinstance(cmds[2], c.Hold)
    assert k.state is S.RUNNING and k.op is c.Op.UNPAUSE
    k.handle(c.RequestEntered())
    assert [type(x) for x in ask(k)] == [c.Hold]  # one cont, the others wait for it
    assert k.handle(c.UnpauseFinished(8.0)) == [c.Touch()] and k.op is None
    assert [type(x) for x in ask(k)] == [c.Admit]


def test_request_during_the_pause_continues_the_vm_right_after():
    k = core(S.RUNNING, suspend_after_pause=60)
    k.handle(c.IdleTick(100.0, 10))
    k.handle(c.GuestProbed(False, 100.0, 10))
    k.handle(c.RequestEntered())
    assert [type(x) for x in ask(k)] == [c.Hold]  # op PAUSE in flight: wait for it
    cmds = k.handle(c.PauseFinished(101.0))
    assert records(cmds) == [E.UNPAUSE] and c.StartOp(c.Op.UNPAUSE) in cmds


def test_paused_long_enough_is_snapshotted_without_a_probe():
    k = paused(core(S.RUNNING, suspend_after_pause=60), now=100.0)
    assert k.handle(c.IdleTick(159.0, 10)) == []
    cmds = k.handle(c.IdleTick(160.0, 10))
    assert records(cmds) == [E.SUSPEND] and cmds[-1] == c.StartOp(c.Op.SUSPEND)
    assert k.state is S.SUSPENDING
    assert k.handle(c.DrainTick(160.0)) == [c.WriteSnapshot()]
    assert records(k.handle(c.SnapshotWritten(900.0))) == [E.SUSPENDED]


def test_a_paused_sandbox_can_be_suspended_on_request():
    k = paused(core(S.RUNNING, suspend_after_pause=60))
    assert records(k.handle(c.SuspendRequested("host memory low"))) == [E.SUSPEND]


def test_request_before_the_snapshot_of_a_paused_vm_aborts_and_continues_it():
    k = paused(core(S.RUNNING, suspend_after_pause=60))
    k.handle(c.SuspendRequested("paused for 60s"))
    k.handle(c.RequestEntered())
    ask(k)  # cancels the suspend
    cmds = k.handle(c.DrainTick(200.0))
    assert records(cmds) == [E.SUSPEND_ABORTED] and cmds[-1] == c.StartOp(c.Op.UNPAUSE)
    assert k.state is S.RUNNING and k.op is c.Op.UNPAUSE


def test_a_suspend_that_fails_after_the_snapshot_step_does_not_unpause_again():
    k = paused(core(S.RUNNING, suspend_after_pause=60))
    k.handle(c.SuspendRequested("paused for 60s"))
    assert k.handle(c.DrainTick(200.0)) == [c.WriteSnapshot()]  # the machine continues it
    cmds = k.handle(c.SuspendFailed("disk full", vm_alive=True))
    assert records(cmds) == [E.SUSPEND_ABORTED] and k.op is None


def test_pause_failures():
    k = core(S.RUNNING, suspend_after_pause=60)
    k.handle(c.IdleTick(100.0, 10))
    k.handle(c.GuestProbed(False, 100.0, 10))
    assert records(k.handle(c.PauseFailed("qmp", vm_alive=True))) == [E.UNPAUSE]
    assert k.state is S.RUNNING
    k = core(S.RUNNING, suspend_after_pause=60)
    k.handle(c.IdleTick(100.0, 10))
    k.handle(c.GuestProbed(False, 100.0, 10))
    assert records(k.handle(c.PauseFailed("gone", vm_alive=False))) == [E.CRASHED]
    assert k.state is S.FAILED


def test_unpause_failure_fails_the_sandbox_and_the_held_request_cold_boots():
    k = paused(core(S.RUNNING, suspend_after_pause=60))
    k.handle(c.RequestEntered())
    ask(k)
    assert records(k.handle(c.UnpauseFailed("agent silent"))) == [E.CRASHED]
    assert k.state is S.FAILED
    assert c.StartOp(c.Op.COLD_BOOT) in ask(k)


def test_vmm_exit_while_paused_fails_the_sandbox():
    k = paused(core(S.RUNNING, suspend_after_pause=60))
    k.vmm_pid = 7
    cmds = k.handle(c.VMMExited(7))
    assert isinstance(cmds[0], c.AbortRequests) and k.state is S.FAILED


@pytest.mark.parametrize("alive,step,after,after_failure", [
    (True, c.Step.ADOPT_PAUSED, S.PAUSED, S.FAILED),
    (False, c.Step.NOTHING, S.FAILED, None),
])
def test_recovery_of_a_paused_sandbox(alive, step, after, after_failure):
    for snap in c.Snapshot:
        k = core(S.PAUSED)
        cmds = k.handle(c.Recovered(vmm_alive=alive, snapshot=snap))
        if step is c.Step.NOTHING:
            assert records(cmds) == [E.CRASHED] and k.state is after
            continue
        assert cmds == [c.RunStep(step)]
        cmds = k.handle(c.RecoveryStepDone({"pid": 9}))
        assert cmds == [c.Watch(9)] and k.state is after and k.vmm_pid == 9
        k2 = core(S.PAUSED)
        k2.handle(c.Recovered(vmm_alive=alive, snapshot=snap))
        cmds = k2.handle(c.RecoveryStepFailed("qmp silent"))
        assert cmds[0] == c.RunStep(c.Step.KILL) and k2.state is after_failure


def test_policy_rejects_a_negative_pause():
    with pytest.raises(ValueError):
        c.Policy(suspend_after_pause=-1)


# -- gateway.sandbox.pause_policy: which paused sandbox the host snapshots -------------------------

P = pause_policy.PausedSandbox
LIMITS = pause_policy.PressureLimits(max_paused=2, min_available_mib=1000)


def test_pressure_picks_the_longest_paused():
    vms = [P("b", "t", 5.0), P("a", "t", 1.0), P("c", "u", 9.0)]
    assert pause_policy.pressure_victim(vms, 500, LIMITS)[0] == "a"  # memory low
    assert pause_policy.pressure_victim(vms, 5000, LIMITS)[0] == "a"  # 3 > max_paused
    assert pause_policy.pressure_victim(vms[:2], 5000, LIMITS) is None
    assert pause_policy.pressure_victim([], 10, LIMITS) is None
    assert pause_policy.pressure_victim(vms, None, pause_policy.PressureLimits(0, 1000)) is None


def test_room_is_made_from_the_tenants_own_paused_sandboxes():
    vms = [P("b", "t", 5.0), P("a", "u", 1.0), P("c", "t", 3.0)]
    assert pause_policy.room_victim(vms, "t") == "c"
    assert pause_policy.room_victim(vms, "x") is None


def test_mem_available(tmp_path: Path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:    2097152 kB\n")
    assert pause_policy.mem_available_mib(f) == 2048
    f.write_text("garbage")
    assert pause_policy.mem_available_mib(f) is None
    assert pause_policy.mem_available_mib(tmp_path / "missing") is None


def test_pause_on_request_and_idle_timeout_zero_never_snapshots_a_paused_one():
    k = core(S.RUNNING, suspend_after_pause=5)
    cmds = k.handle(c.PauseRequested("warm pool member"))
    assert records(cmds) == [E.PAUSE] and k.state is S.PAUSED
    k.handle(c.PauseFinished(0.0))
    assert k.handle(c.IdleTick(1000.0, 0)) == []  # idle_timeout 0: never sleeps further
    k2 = core(S.RUNNING)
    k2.handle(c.RequestEntered())
    assert isinstance(k2.handle(c.PauseRequested("pool"))[0], c.Reject)
