"""The sandbox core: every decision about one sandbox's state, and no I/O.

Theory of operation
-------------------
One ``SandboxCore`` per sandbox holds everything that decides what happens to
it: its ``State``, the request counters, the operation in flight (create,
restore, cold boot, suspend) and the VMM it watches. The controller, the
service and start-up recovery (the *shells*) never decide anything: they tell
the core what happened (an event, a frozen dataclass named as a fact) and
execute the commands it returns (imperatives), in order.

The core changes its own state synchronously when it emits a ``Record``; the
shell writes that transition to the registry before it executes the next
command, so the registry always says what was about to happen. Every state
change goes through ``gateway.sandbox.states.TRANSITIONS``; an illegal one raises.

Two tables carry the policy:

* the runtime rules, ``RULES`` by event type (a request arrives at a sleeping sandbox ->
  record WAKE and start a restore, then hold it; a restore fails after the guest
  ran -> FAILED, cold boot next; the VMM dies while RUNNING -> FAILED and abort
  the requests using it; ...);
* ``RECOVERY``: what start-up does with a sandbox given the state the registry
  recorded, whether its VMM is alive, and whether its snapshot is still usable
  (complete and never resumed from). Its one rule above all others: a VMM whose
  guest may have run is never killed while it can be adopted, and a snapshot a
  guest resumed from is never restored again.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from gateway.errors import (ApiError, Conflict, OwnerUnavailable, SandboxLost, SandboxMoved,
                            SandboxNotFound, Unavailable)
from gateway.sandbox.states import Event, State, next_state


class WakeTimeout(ApiError):
    status = 504
    code = "wake_timeout"


class RestoreFailed(ApiError):
    status = 502
    code = "restore_failed"


class VMLost(ApiError):
    """The sandbox's VMM died under a request; it cold-boots on the next one."""

    status = 503
    code = "sandbox_crashed"


class Op(enum.Enum):
    CREATE = "create"
    RESTORE = "restore"
    COLD_BOOT = "cold_boot"
    SUSPEND = "suspend"
    PAUSE = "pause"  # stop the vCPUs (QMP ``stop``); the VMM and its RAM stay
    UNPAUSE = "unpause"  # ``cont`` plus the clock fix
    MIGRATE = "migrate"  # live migration to another host (a drain); requests are held


class Snapshot(enum.Enum):
    """What start-up recovery found in the sandbox's snapshot directory."""

    USABLE = "usable"  # complete (manifest written) and never resumed from
    UNUSABLE = "unusable"  # missing, incomplete, stale, or consumed by a guest that ran


class Step(enum.Enum):
    """The one piece of I/O a recovery row asks for."""

    NOTHING = "nothing"
    ADOPT = "adopt"  # reconnect to the VMM, let it run if it is stopped, check the agent
    ADOPT_PAUSED = "adopt_paused"  # reconnect to a paused VMM and make sure it stays stopped
    RESUME = "resume"  # adopt a VMM paused by an unfinished suspend and let it run again
    FINISH_RESTORE = "finish_restore"  # adopt a VMM that was restoring and finish the restore
    KILL = "kill"  # the VMM must not run (its sandbox is asleep or failed)
    DISCARD = "discard"  # kill and remove everything the sandbox had on the host


@dataclass(frozen=True)
class Policy:
    max_waiters_per_sandbox: int = 1000
    max_waiters_global: int = 10000
    wake_deadline: float = 30.0  # seconds a request waits, in all, for a restore or unpause
    # Seconds a request waits, in all, when what serves it is a cold boot (a FAILED sandbox,
    # or a restore that handed over to one): a boot takes far longer than a restore (TCG:
    # ~8 s at 2 vCPUs, bench/README.md). SandboxService sets it from `[vm]`'s timeouts.
    cold_boot_deadline: float = 100.0
    max_concurrent_requests: int = 64
    retry_after_s: int = 2
    drain_timeout: float = 30.0  # a suspend waits this long for in-flight work, then gives up
    max_restore_attempts: int = 2  # transient restore failures in a row before a cold boot
    cold_boot_failed_at_once: bool = False  # True: a FAILED sandbox cold-boots without a request
    # Seconds an idle sandbox stays PAUSED (VMM alive, vCPUs stopped) before its snapshot;
    # 0: an idle sandbox is snapshotted at once, never paused.
    suspend_after_pause: float = 0.0

    def __post_init__(self) -> None:
        if min(self.max_waiters_per_sandbox, self.max_waiters_global,
               self.max_concurrent_requests, self.max_restore_attempts) < 1 \
                or min(self.wake_deadline, self.cold_boot_deadline) <= 0 or self.drain_timeout < 0 \
                or self.suspend_after_pause < 0:
            raise ValueError("wake limits must be positive")


# -- events: facts -----------------------------------------------------------------------

@dataclass(frozen=True)
class RequestEntered:
    """A request was counted (before anything else looks at the state)."""


@dataclass(frozen=True)
class AdmissionAsked:
    """A counted request asks whether it may use the machine now."""

    waited_s: float
    held_globally: int


@dataclass(frozen=True)
class AdmitNow:
    """A request that cannot wait (the fast lane) asks to use the machine at once: admitted
    while the sandbox is serving, else nothing changes (the caller takes the waiting path)."""


@dataclass(frozen=True)
class RequestLeft:
    admitted: bool
    now: float


@dataclass(frozen=True)
class IdleTick:
    now: float
    timeout: float  # the sandbox's idle_timeout (0 = never)


@dataclass(frozen=True)
class GuestProbed:
    busy: bool  # a command runs in the guest, or it vetoed suspension
    now: float
    timeout: float


@dataclass(frozen=True)
class SuspendRequested:
    cause: str


@dataclass(frozen=True)
class DrainTick:
    now: float


@dataclass(frozen=True)
class SnapshotWritten:
    ms: float


@dataclass(frozen=True)
class SuspendFailed:
    cause: str
    vm_alive: bool  # the paused VM was resumed


@dataclass(frozen=True)
class PauseRequested:
    """Pause now, idle or not (e.g. a warm-pool member waiting to be claimed)."""

    cause: str


@dataclass(frozen=True)
class PauseFinished:
    now: float


@dataclass(frozen=True)
class PauseFailed:
    cause: str
    vm_alive: bool  # the VM still runs (the stop did not happen)


@dataclass(frozen=True)
class UnpauseFinished:
    ms: float


@dataclass(frozen=True)
class UnpauseFailed:
    cause: str


@dataclass(frozen=True)
class MigrateRequested:
    """Move the running sandbox to ``host`` (a drain)."""

    host: str


@dataclass(frozen=True)
class MigrateFinished:
    """The guest runs on the other host now; this host's VMM is gone."""

    host: str


@dataclass(frozen=True)
class MigrateFailed:
    cause: str
    vm_alive: bool  # the VM runs here again (every failure before the destination started it)


@dataclass(frozen=True)
class CreateFinished:
    vmm: dict[str, Any] | None


@dataclass(frozen=True)
class CreateFailed:
    cause: str


@dataclass(frozen=True)
class RestoreFinished:
    ms: float
    vmm: dict[str, Any] | None


@dataclass(frozen=True)
class RestoreFailedEvent:
    cause: str
    guest_started: bool  # the guest ran from the snapshot: it is consumed
    snapshot_unusable: bool  # corrupt, missing, truncated, or its device state did not load
    disk_missing: bool = False  # a cold boot found no disk to boot: the sandbox is lost


@dataclass(frozen=True)
class VMMExited:
    pid: int


@dataclass(frozen=True)
class DestroyRequested:
    cause: str


@dataclass(frozen=True)
class Recovered:
    """Start-up found this sandbox (recorded state is the core's state)."""

    vmm_alive: bool
    snapshot: Snapshot


@dataclass(frozen=True)
class RecoveryStepDone:
    vmm: dict[str, Any] | None = None


@dataclass(frozen=True)
class RecoveryStepFailed:
    cause: str


# -- commands: imperatives ------------------------------------------------------------------

@dataclass(frozen=True)
class Record:
    """Write this transition (and fields) to the registry before anything else."""

    event: Event
    cause: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StartOp:
    op: Op


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Hold:
    """Wait up to `timeout` s for the operation under way; `deadline` is the whole wait allowed
    (a WakeTimeout names it). The caller asks again when the operation ends or is replaced."""

    timeout: float
    deadline: float


@dataclass(frozen=True)
class Reject:
    error: ApiError


@dataclass(frozen=True)
class ProbeGuest:
    pass


@dataclass(frozen=True)
class Touch:
    pass


@dataclass(frozen=True)
class WaitDrain:
    pass


@dataclass(frozen=True)
class WriteSnapshot:
    pass


@dataclass(frozen=True)
class AbortRequests:
    error: ApiError


@dataclass(frozen=True)
class Watch:
    pid: int


@dataclass(frozen=True)
class RunStep:
    step: Step


@dataclass(frozen=True)
class RemoveResources:
    pass


Command = (Record | StartOp | Admit | Hold | Reject | ProbeGuest | Touch | WaitDrain
           | WriteSnapshot | AbortRequests | Watch | RunStep | RemoveResources)


# -- the recovery table ----------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    step: Step
    on_success: Event | None
    on_failure: Event | None
    cause: str


S, E, U, X = State, Event, Snapshot.USABLE, Snapshot.UNUSABLE

RECOVERY: dict[tuple[State, bool, Snapshot], Plan] = {}


def _row(state: State, alive: bool | None, snap: Snapshot | None, plan: Plan) -> None:
    for a in (True, False) if alive is None else (alive,):
        for s in (U, X) if snap is None else (snap,):
            RECOVERY[(state, a, s)] = plan


_row(S.RUNNING, True, None, Plan(Step.ADOPT, None, E.CRASHED, "VMM could not be re-adopted"))
# A paused VMM is kept paused (the daemon may have died between recording PAUSE and the stop).
_row(S.PAUSED, True, None, Plan(Step.ADOPT_PAUSED, None, E.CRASHED,
                                "paused VMM could not be re-adopted"))
_row(S.PAUSED, False, None, Plan(Step.NOTHING, E.CRASHED, None,
                                 "VMM of a paused sandbox gone after a restart"))
_row(S.RUNNING, False, None, Plan(Step.NOTHING, E.CRASHED, None, "VMM gone after a restart"))
_row(S.CREATING, None, None, Plan(Step.DISCARD, E.DESTROY, None, "daemon stopped mid-create"))
_row(S.SUSPENDING, True, U, Plan(Step.KILL, E.SUSPENDED, None, "suspend finished (recovered)"))
_row(S.SUSPENDING, True, X, Plan(Step.RESUME, E.SUSPEND_ABORTED, E.SUSPEND_FAILED,
                                 "daemon stopped mid-suspend"))
_row(S.SUSPENDING, False, U, Plan(Step.NOTHING, E.SUSPENDED, None, "suspend finished (recovered)"))
_row(S.SUSPENDING, False, X, Plan(Step.NOTHING, E.SUSPEND_FAILED, None,
                                  "daemon and VMM stopped mid-suspend, no snapshot"))
# Roll a restore forward whenever its VMM lives: its guest may have run.
_row(S.RESTORING, True, U, Plan(Step.FINISH_RESTORE, E.RESTORED, E.RESTORE_FAILED,
                                "restore finished (recovered)"))
_row(S.RESTORING, True, X, Plan(Step.FINISH_RESTORE, E.RESTORED, E.SNAPSHOT_LOST,
                                "restore finished (recovered)"))
_row(S.RESTORING, False, U, Plan(Step.NOTHING, E.RESTORE_FAILED, None,
                                 "daemon stopped before the guest resumed; snapshot intact"))
_row(S.RESTORING, False, X, Plan(Step.NOTHING, E.SNAPSHOT_LOST, None,
                                 "daemon and VMM stopped after the guest resumed"))
_row(S.SUSPENDED, True, U, Plan(Step.KILL, None, None, "VMM of a suspended sandbox"))
_row(S.SUSPENDED, False, U, Plan(Step.NOTHING, None, None, ""))
_row(S.SUSPENDED, True, X, Plan(Step.KILL, E.SNAPSHOT_LOST, None, "snapshot missing or used"))
_row(S.SUSPENDED, False, X, Plan(Step.NOTHING, E.SNAPSHOT_LOST, None, "snapshot missing or used"))
_row(S.FAILED, True, None, Plan(Step.KILL, None, None, "VMM of a failed sandbox"))
_row(S.FAILED, False, None, Plan(Step.NOTHING, None, None, ""))
_row(S.DESTROYED, None, None, Plan(Step.DISCARD, None, None, "leftovers of a deleted sandbox"))


_PATH = re.compile(r"(?:/[\w.@+-]+)+/([\w.@+-]+)")
MAX_CAUSE = 500
MAX_RECORDED_CAUSE = 2000  # a transition's cause as written to the registry


def wake_error(sandbox_id: str, cause: str, vmm_died: bool, lost: bool = False) -> ApiError:
    """What the requests waiting for a failed restore or cold boot are answered. A VMM that
    died under it (killed, crashed) is transient: the next request starts it again, so
    503 with Retry-After, as for a VMM that dies while running. No disk to boot: 410
    ``sandbox_lost`` (nothing will ever start it). Anything else is 502."""
    if lost:
        return lost_error(sandbox_id)
    if vmm_died:
        return VMLost("the sandbox's VM stopped while it was starting; the next request "
                      "starts it again", headers={"Retry-After": "1"})
    return RestoreFailed(f"sandbox {sandbox_id} could not be restored: {public_cause(cause)}")


def lost_error(sandbox_id: str, failure: str = "") -> ApiError:
    why = f" ({public_cause(failure)})" if failure else ""
    return SandboxLost(f"sandbox {sandbox_id} failed and has no disk left to boot{why}; "
                       "delete it")


def public_cause(text: str) -> str:
    """A failure cause fit for API users: host paths reduced to file names, bounded."""
    return _PATH.sub(r"\1", text)[:MAX_CAUSE]


# -- the core -----------------------------------------------------------------------------------

class SandboxCore:
    def __init__(self, state: State, policy: Policy, *, vmm_pid: int | None = None,
                 suspend_count: int = 0, restore_count: int = 0, now: float = 0.0,
                 lost: bool = False) -> None:
        self.state = state
        # FAILED with no disk to boot (the shell found none, or a cold boot did): requests
        # are answered sandbox_lost at once, never a boot attempt (only DELETE helps).
        self.lost = lost
        self.policy = policy
        self.op: Op | None = None
        self.entering = 0  # counted, not yet admitted (held or about to be)
        self.active = 0  # admitted, using the machine
        self.cancel_suspend = False
        self.vmm_pid = vmm_pid
        self.suspend_count = suspend_count
        self.restore_count = restore_count
        self.failed_restores = 0  # transient failures in a row (bounded: then cold boot)
        self.idle_since = now
        self.paused_since = now  # when the current pause began (or recovery found it)
        self._suspend_from_pause = False  # the running suspend found the VM paused
        self._drain_deadline: float | None = None
        self._plan: Plan | None = None
        self.moved_to: str | None = None  # the host a migration moved it to

    def __repr__(self) -> str:
        return (f"<SandboxCore {self.state.name} op={self.op and self.op.name} "
                f"active={self.active} entering={self.entering}>")

    @property
    def serving(self) -> bool:
        """RUNNING with no operation under way: a request is admitted at once."""
        return self.state is S.RUNNING and self.op is None

    @property
    def is_idle_paused(self) -> bool:
        """PAUSED with no operation under way (no stop, continue or snapshot in flight): a
        request unpauses it, a claim takes it, a suspend may start from it."""
        return self.state is S.PAUSED and self.op is None

    def idle_for(self, now: float) -> float:
        return 0.0 if self.active or self.entering else max(0.0, now - self.idle_since)

    def handle(self, event: object) -> list[Command]:
        """The rule for ``event``'s type (``RULES``), applied to this sandbox."""
        rule = RULES.get(type(event))
        if rule is None:
            raise TypeError(f"no rule for {event!r}")
        return rule(self, event)

    # -- requests --------------------------------------------------------------------------

    def _on_RequestEntered(self, ev: RequestEntered) -> list[Command]:
        self.entering += 1
        return []

    def _on_AdmissionAsked(self, ev: AdmissionAsked) -> list[Command]:
        p, st = self.policy, self.state
        if self.serving:
            self.entering -= 1
            self.active += 1
            return [Admit()]
        if st is S.DESTROYED:
            if self.moved_to is not None:  # held through a move: the new owner serves it
                return self._leave_queue(Reject(SandboxMoved("", self.moved_to)))
            return self._leave_queue(Reject(SandboxNotFound("")))
        if st is S.FAILED and self.lost and self.op is None:
            return self._leave_queue(Reject(lost_error("")))
        if self.entering > p.max_waiters_per_sandbox or ev.held_globally >= p.max_waiters_global:
            return self._leave_queue(Reject(Unavailable(
                "too many requests waiting for this sandbox to wake", code="hold_queue_full",
                headers={"Retry-After": str(p.retry_after_s)})))
        cold = self.op is Op.COLD_BOOT or (self.op is None and st is S.FAILED)
        deadline = p.cold_boot_deadline if cold else p.wake_deadline
        remaining = deadline - ev.waited_s
        if remaining <= 0:
            return self._leave_queue(Reject(WakeTimeout(
                f"the sandbox did not wake within {deadline:g}s")))
        cmds: list[Command] = []
        if st in (S.SUSPENDED, S.FAILED) and self.op is None:
            cmds += self._begin_restore("woken by a request")
        elif self.is_idle_paused:
            cmds += self._begin_unpause("woken by a request")
        elif st is S.SUSPENDING:
            self.cancel_suspend = True
        return [*cmds, Hold(remaining, deadline)]

    def _on_AdmitNow(self, ev: AdmitNow) -> list[Command]:
        if not self.serving:
            return []
        self.active += 1
        return [Admit()]

    def _leave_queue(self, cmd: Command) -> list[Command]:
        self.entering -= 1
        return [cmd]

    def _on_RequestLeft(self, ev: RequestLeft) -> list[Command]:
        if ev.admitted:
            self.active -= 1
        else:
            self.entering -= 1
        self.idle_since = ev.now
        return [Touch()] if ev.admitted else []

    # -- idle suspend --------------------------------------------------------------------------

    def _idle(self, now: float, timeout: float) -> bool:
        return self.state is S.RUNNING and self.op is None and timeout > 0 \
            and self.idle_for(now) >= timeout

    def _on_IdleTick(self, ev: IdleTick) -> list[Command]:
        if self.is_idle_paused and not self.entering and ev.timeout > 0 \
                and ev.now - self.paused_since >= self.policy.suspend_after_pause:
            return self._begin_suspend(f"paused for {self.policy.suspend_after_pause:g}s")
        return [ProbeGuest()] if self._idle(ev.now, ev.timeout) else []

    def _on_GuestProbed(self, ev: GuestProbed) -> list[Command]:
        if ev.busy:
            self.idle_since = ev.now  # busy inside the guest: look again after another period
            return [Touch()]
        if self._idle(ev.now, ev.timeout):
            if self.policy.suspend_after_pause > 0:
                return self._begin_pause(f"idle for {ev.timeout:g}s")
            return self._begin_suspend(f"idle for {ev.timeout:g}s")
        return []

    def _on_SuspendRequested(self, ev: SuspendRequested) -> list[Command]:
        if self.state not in (S.RUNNING, S.PAUSED) or self.op is not None:
            return [Reject(Conflict(f"sandbox is {self.state.value}", code="not_running"))]
        return self._begin_suspend(ev.cause)

    def _begin_suspend(self, cause: str) -> list[Command]:
        self._suspend_from_pause = self.state is S.PAUSED
        self.cancel_suspend = False
        self.op = Op.SUSPEND
        self._drain_deadline = None
        return [*self._record(E.SUSPEND, cause), StartOp(Op.SUSPEND)]

    def _on_DrainTick(self, ev: DrainTick) -> list[Command]:
        """Requests already admitted finish first; new ones are held meanwhile. Open
        streams can last forever: give up after ``drain_timeout``."""
        if self.op is Op.MIGRATE:
            return self._quiesce_for_move(ev)
        if self._drain_deadline is None:
            self._drain_deadline = ev.now + self.policy.drain_timeout
        if self.active and not self.cancel_suspend and ev.now <= self._drain_deadline:
            return [WaitDrain()]
        if self.active or self.cancel_suspend or self.entering:
            self.op = None
            cmds = self._record(E.SUSPEND_ABORTED,
                                "requests still in flight, or one arrived before the snapshot")
            if self._suspend_from_pause:  # the VM is still stopped: continue it first
                self.op = Op.UNPAUSE
                cmds.append(StartOp(Op.UNPAUSE))
            return cmds
        self._suspend_from_pause = False  # the snapshot step continues a paused VM itself
        return [WriteSnapshot()]

    def _quiesce_for_move(self, ev: DrainTick) -> list[Command]:
        """Before a move's switch-over, requests already admitted finish (new ones are
        held): their answers come from here. An open stream can last forever: after
        ``drain_timeout`` the move goes on, and what is still in flight then is answered
        ``owner_unavailable`` (it may have had effects: never re-sent)."""
        if self._drain_deadline is None:
            self._drain_deadline = ev.now + self.policy.drain_timeout
        if self.active and ev.now <= self._drain_deadline:
            return [WaitDrain()]
        self._drain_deadline = None
        return []

    def _on_SnapshotWritten(self, ev: SnapshotWritten) -> list[Command]:
        self.op = None
        self.suspend_count += 1
        self.vmm_pid = None
        cmds = self._record(E.SUSPENDED, "snapshot written; VMM exited", vmm=None,
                            suspend_count=self.suspend_count, last_suspend_ms=round(ev.ms, 1))
        if self.entering:  # requests arrived while the snapshot was being written
            cmds += self._begin_restore("a request arrived during the suspend")
        return cmds

    def _on_SuspendFailed(self, ev: SuspendFailed) -> list[Command]:
        self.op = None
        if ev.vm_alive:
            return self._record(E.SUSPEND_ABORTED, f"suspend failed, VM resumed: {ev.cause}")
        self.vmm_pid = None
        return self._fail(E.SUSPEND_FAILED, f"suspend failed and the VM is lost: {ev.cause}")

    # -- pause before snapshot ------------------------------------------------------------
    #
    # Both moves are recorded before the VMM is stopped or continued: a daemon killed in
    # between finds PAUSED (recovery stops the VMM again, idempotently) or RUNNING (recovery
    # continues it, idempotently, before checking its agent).

    def _begin_pause(self, cause: str) -> list[Command]:
        self.op = Op.PAUSE
        return [*self._record(E.PAUSE, cause), StartOp(Op.PAUSE)]

    def _on_PauseRequested(self, ev: PauseRequested) -> list[Command]:
        if self.state is not S.RUNNING or self.op is not None or self.active or self.entering:
            return [Reject(Conflict(f"sandbox is {self.state.value}", code="not_running"))]
        return self._begin_pause(ev.cause)

    def _on_PauseFinished(self, ev: PauseFinished) -> list[Command]:
        self.op = None
        self.paused_since = ev.now
        if self.entering:  # a request arrived while the VM was being stopped
            return self._begin_unpause("a request arrived during the pause")
        return []

    def _on_PauseFailed(self, ev: PauseFailed) -> list[Command]:
        self.op = None
        if ev.vm_alive:
            return self._record(E.UNPAUSE, f"pause failed, VM kept running: {ev.cause}")
        self.vmm_pid = None
        return self._fail(E.CRASHED, f"pause failed and the VM is lost: {ev.cause}")

    def _begin_unpause(self, cause: str) -> list[Command]:
        self.op = Op.UNPAUSE
        return [*self._record(E.UNPAUSE, cause), StartOp(Op.UNPAUSE)]

    def _on_UnpauseFinished(self, ev: UnpauseFinished) -> list[Command]:
        self.op = None
        return [Touch()]

    def _on_UnpauseFailed(self, ev: UnpauseFailed) -> list[Command]:
        """The VMM would not continue (or its agent not answer): lost, like a crash. The
        held requests then see FAILED and cold-boot the disk."""
        self.op = None
        self.vmm_pid = None
        return self._fail(E.CRASHED, f"wake from pause failed: {ev.cause}")

    # -- live migration (a drain) ---------------------------------------------------------
    #
    # The sandbox stays RUNNING while its disk and RAM are copied (the guest serves the
    # requests already admitted); new requests are held, as during a wake. A move that
    # succeeded is recorded as DESTROY here (the sandbox lives on the other host now, whose
    # record etcd holds) and the held requests are refused with SandboxMoved, which the
    # routing middleware forwards to the new owner. A move that failed left the VM running
    # here (vmctl guarantees it) and the held requests are admitted.
    #
    # A SUSPENDED sandbox whose snapshot is shipped moves the same way, with nothing to
    # copy: the op is the record's compare-and-set (the other host adopts it from the
    # object store). Held meanwhile, no request can wake it here between the decision and
    # the move; a move that failed leaves it SUSPENDED, and the held requests wake it here.

    def _on_MigrateRequested(self, ev: MigrateRequested) -> list[Command]:
        if self.state is S.SUSPENDED and self.op is None:
            self.op = Op.MIGRATE
            return [StartOp(Op.MIGRATE)]
        if not self.serving:
            return [Reject(Conflict(f"sandbox is {self.state.value}"
                                    f"{' (' + self.op.value + ' under way)' if self.op else ''}",
                                    code="not_running"))]
        self.op = Op.MIGRATE
        self._drain_deadline = None
        return [StartOp(Op.MIGRATE)]

    def _on_MigrateFinished(self, ev: MigrateFinished) -> list[Command]:
        self.op = None
        self.vmm_pid = None  # its exit is the move's, not a crash
        self.moved_to = ev.host
        # Requests admitted before the move were using the guest here: their connection
        # to it is gone (the guest, and what they started in it, runs on there). Not
        # forwarded: they may have had effects already.
        gone = OwnerUnavailable(f"the sandbox moved to host {ev.host} while this request "
                                "ran; retry", headers={"Retry-After": "1"})
        return [*self._record(E.DESTROY, f"moved to host {ev.host}", vmm=None),
                AbortRequests(gone), RemoveResources()]

    def _on_MigrateFailed(self, ev: MigrateFailed) -> list[Command]:
        self.op = None
        if self.state is S.SUSPENDED:
            return []  # its record stays here; held requests ask again and wake it
        if ev.vm_alive:
            return [Touch()]  # still RUNNING here; held requests ask again and are admitted
        self.vmm_pid = None
        return self._fail(E.CRASHED, f"migration failed and the VM is lost: {ev.cause}")

    # -- create / restore --------------------------------------------------------------------

    def begin_create(self) -> list[Command]:
        self.op = Op.CREATE
        return [StartOp(Op.CREATE)]

    def _on_CreateFinished(self, ev: CreateFinished) -> list[Command]:
        self.op = None
        return [*self._record(E.CREATED, "restored from golden snapshot", vmm=ev.vmm),
                *self._watch(ev.vmm), Touch()]

    def _on_CreateFailed(self, ev: CreateFailed) -> list[Command]:
        self.op = None
        return self._record(E.CREATE_FAILED, f"create failed: {ev.cause}",
                            failure=public_cause(ev.cause))

    def _begin_restore(self, cause: str) -> list[Command]:
        op = Op.COLD_BOOT if self.state is S.FAILED else Op.RESTORE
        self.op = op
        return [*self._record(E.WAKE, cause), StartOp(op)]

    def _on_RestoreFinished(self, ev: RestoreFinished) -> list[Command]:
        cold = self.op is Op.COLD_BOOT
        self.op = None
        self.failed_restores = 0
        self.restore_count += 1
        return [*self._record(E.RESTORED, "cold boot of its disk" if cold else "restored snapshot",
                              vmm=ev.vmm, failure=None, restore_count=self.restore_count,
                              last_restore_ms=round(ev.ms, 1)),
                *self._watch(ev.vmm), Touch()]

    def _on_RestoreFailedEvent(self, ev: RestoreFailedEvent) -> list[Command]:
        cold = self.op is Op.COLD_BOOT
        self.op = None
        self.vmm_pid = None
        self.failed_restores += 1
        cause = f"{'cold boot' if cold else 'restore'} failed: {ev.cause}"
        if cold:  # nothing left to fall back to: FAILED until the next request tries again
            self.lost = ev.disk_missing  # ... unless there is no disk to try: never again
            return self._fail(E.SNAPSHOT_LOST, cause, on_request_only=True)
        if ev.guest_started or ev.snapshot_unusable \
                or self.failed_restores >= self.policy.max_restore_attempts:
            # The snapshot is spent or cannot be trusted: never try it again. The waiting
            # requests are served by a cold boot of the disk (files kept, processes lost).
            cmds = self._record(E.SNAPSHOT_LOST, cause, failure=public_cause(cause), vmm=None)
            return [*cmds, *self._begin_restore("cold boot: the snapshot is unusable")]
        return self._record(E.RESTORE_FAILED, cause, failure=public_cause(cause))

    # -- the VMM died --------------------------------------------------------------------------

    def _on_VMMExited(self, ev: VMMExited) -> list[Command]:
        if ev.pid != self.vmm_pid:
            return []  # an old VMM, or one we stopped on purpose
        self.vmm_pid = None
        lost = VMLost("the sandbox's VM stopped unexpectedly; the next request cold-boots it "
                      "from its disk", headers={"Retry-After": "1"})
        if self.state in (S.RUNNING, S.PAUSED) and self.op is None:
            return [AbortRequests(lost), *self._fail(E.CRASHED, "VMM exited unexpectedly")]
        if self.state is S.SUSPENDING:  # the suspend's own failure path records the outcome
            return [AbortRequests(lost)]
        return []

    # -- destroy ----------------------------------------------------------------------------------

    def _on_DestroyRequested(self, ev: DestroyRequested) -> list[Command]:
        self.vmm_pid = None
        return [*self._record(E.DESTROY, ev.cause, vmm=None), RemoveResources()]

    # -- start-up recovery ----------------------------------------------------------------------

    def _on_Recovered(self, ev: Recovered) -> list[Command]:
        plan = RECOVERY[(self.state, ev.vmm_alive, ev.snapshot)]
        self._plan = plan
        if plan.step is Step.NOTHING:
            return self._finish_plan(plan.on_success, plan.cause)
        return [RunStep(plan.step)]

    def _on_RecoveryStepDone(self, ev: RecoveryStepDone) -> list[Command]:
        plan = self._plan
        assert plan is not None
        if ev.vmm is not None:
            cmds = self._finish_plan(plan.on_success, plan.cause, vmm=ev.vmm)
            return [*cmds, *self._watch(ev.vmm)]
        return self._finish_plan(plan.on_success, plan.cause)

    def _on_RecoveryStepFailed(self, ev: RecoveryStepFailed) -> list[Command]:
        plan = self._plan
        assert plan is not None
        self.vmm_pid = None
        return [RunStep(Step.KILL), *self._finish_plan(plan.on_failure,
                                                       f"{plan.cause}: {ev.cause}")]

    def _finish_plan(self, event: Event | None, cause: str, **fields: Any) -> list[Command]:
        self._plan = None
        if event is None:
            return []
        if event in (E.CRASHED, E.SUSPEND_FAILED, E.SNAPSHOT_LOST):
            return self._fail(event, cause)
        if event is E.DESTROY:
            return [*self._record(E.DESTROY, cause, vmm=None), RemoveResources()]
        if event is E.RESTORED:
            self.restore_count += 1
            fields |= {"failure": None, "restore_count": self.restore_count}
        if event in (E.SUSPENDED, E.RESTORE_FAILED):
            fields |= {"vmm": None}
        return self._record(event, cause, **fields)

    # -- helpers ------------------------------------------------------------------------------

    def _fail(self, event: Event, cause: str, on_request_only: bool = False) -> list[Command]:
        """Record a move to FAILED; its next request (or, by policy, now) cold-boots the disk."""
        cmds = self._record(event, cause, failure=public_cause(cause), vmm=None)
        assert self.state is S.FAILED, self.state
        if self.policy.cold_boot_failed_at_once and not on_request_only and self.op is None \
                and not self.lost:
            cmds += self._begin_restore("cold boot of a failed sandbox (policy: at once)")
        return cmds

    def _record(self, event: Event, cause: str, **fields: Any) -> list[Command]:
        self.state = next_state(self.state, event)
        # Causes carry exception text, some of it from the guest: bounded before the registry.
        return [Record(event, cause[:MAX_RECORDED_CAUSE], fields)]

    def _watch(self, vmm: dict[str, Any] | None) -> list[Command]:
        pid = vmm.get("pid") if vmm else None
        self.vmm_pid = pid
        return [Watch(pid)] if pid else []


# The runtime rules and start-up recovery's, by event type (tests/unit/test_core_rules.py
# has a row for every runtime one; each rule branches on the state, operation and counters).
RULES: dict[type, Callable[[SandboxCore, Any], list[Command]]] = {
    RequestEntered: SandboxCore._on_RequestEntered,
    AdmissionAsked: SandboxCore._on_AdmissionAsked,
    AdmitNow: SandboxCore._on_AdmitNow,
    RequestLeft: SandboxCore._on_RequestLeft,
    IdleTick: SandboxCore._on_IdleTick,
    GuestProbed: SandboxCore._on_GuestProbed,
    SuspendRequested: SandboxCore._on_SuspendRequested,
    DrainTick: SandboxCore._on_DrainTick,
    SnapshotWritten: SandboxCore._on_SnapshotWritten,
    SuspendFailed: SandboxCore._on_SuspendFailed,
    PauseRequested: SandboxCore._on_PauseRequested,
    PauseFinished: SandboxCore._on_PauseFinished,
    PauseFailed: SandboxCore._on_PauseFailed,
    UnpauseFinished: SandboxCore._on_UnpauseFinished,
    UnpauseFailed: SandboxCore._on_UnpauseFailed,
    MigrateRequested: SandboxCore._on_MigrateRequested,
    MigrateFinished: SandboxCore._on_MigrateFinished,
    MigrateFailed: SandboxCore._on_MigrateFailed,
    CreateFinished: SandboxCore._on_CreateFinished,
    CreateFailed: SandboxCore._on_CreateFailed,
    RestoreFinished: SandboxCore._on_RestoreFinished,
    RestoreFailedEvent: SandboxCore._on_RestoreFailedEvent,
    VMMExited: SandboxCore._on_VMMExited,
    DestroyRequested: SandboxCore._on_DestroyRequested,
    Recovered: SandboxCore._on_Recovered,
    RecoveryStepDone: SandboxCore._on_RecoveryStepDone,
    RecoveryStepFailed: SandboxCore._on_RecoveryStepFailed,
}


def recovery_table_markdown() -> str:
    """``RECOVERY`` as the table in docs/operations.md (a test keeps the two equal)."""
    rows = ["| recorded | VMM alive | snapshot | step | then | if the step fails |",
            "|---|---|---|---|---|---|"]
    for (state, alive, snap), plan in RECOVERY.items():
        same = RECOVERY[(state, alive, U)] == RECOVERY[(state, alive, X)]
        if same and snap is X:
            continue  # shown once, as "any"
        ok = next_state(state, plan.on_success).value if plan.on_success else state.value
        bad = next_state(state, plan.on_failure).value if plan.on_failure else "-"
        rows.append(f"| {state.value} | {'yes' if alive else 'no'} | "
                    f"{'any' if same else snap.value} | {plan.step.value} | {ok} | {bad} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(recovery_table_markdown())
