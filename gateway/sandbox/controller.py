"""One sandbox's controller: the asyncio shell around its ``SandboxCore``.

The controller decides nothing. It tells the core what happened (a request
arrived or left, an operation finished or failed, the VMM exited, the idle
timer fired) and executes the commands the core returns, in order: write a
transition to the registry, start an operation task, admit, hold or reject a
request, probe the guest, abort the requests of a VM that died.

Operations (create, restore, cold boot, suspend) run as tasks owned by the
service, detached from the request that triggered them, so a client that goes
away cancels only its own wait. Requests that must wait hold on the running
operation, bounded by the core's limits.

A watcher on the VMM's pidfd reports its exit at once (``vmctl.watch``): a
sandbox whose VMM dies while RUNNING goes FAILED, and the requests using it are
cancelled and answered 503 ``sandbox_crashed`` with ``Retry-After`` instead of
hanging until a proxy timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.sandbox import core as c
from gateway.sandbox.core import Policy, RestoreFailed, VMLost, WakeTimeout
from gateway.sandbox.machine_port import MachinePort
from gateway.errors import ApiError, SandboxLost, SandboxMoved, SandboxNotFound, Unavailable
from gateway.sandbox.states import State
from gateway.sandbox.metrics import Metrics
from gateway.store.registry import Registry, SandboxRecord
from gateway.sandbox.slots import Slots
from vmctl.errors import OutcomeUnknown
from vmctl.machine import RestoreError
from vmctl.watch import ExitWatch

log = logging.getLogger(__name__)

WakePolicy = Policy  # the name the rest of the gateway knows the limits by
DRAIN_POLL_S = 0.005

__all__ = ["HoldCounter", "Lease", "RestoreFailed", "SandboxController", "VMLost", "Wake",
           "WakePolicy", "WakeTimeout"]


class HoldCounter:
    """Requests held across all sandboxes (the global bound)."""

    def __init__(self) -> None:
        self.held = 0


@dataclass
class Wake:
    """What a request learns from entering: whether it woke the sandbox, and how long it took."""

    woke: bool = False
    wake_ms: float = 0.0


class Lease:
    """One request admitted by ``SandboxController.try_request`` (no task to cancel)."""

    __slots__ = ("_ctl", "_on_abort", "machine")

    def __init__(self, ctl: SandboxController, on_abort: Callable[[ApiError], None]) -> None:
        self._ctl: SandboxController | None = ctl
        self._on_abort = on_abort
        self.machine = ctl.machine

    def release(self) -> None:
        """The request is over (answered, failed or abandoned); idempotent."""
        ctl, self._ctl = self._ctl, None
        if ctl is not None:
            ctl._lease_done(self)

    def abort(self, error: ApiError) -> None:
        """The VM is gone: the holder stops using it (and releases)."""
        if self._ctl is not None:
            self._on_abort(error)
            self.release()


class SandboxController:
    def __init__(self, rec: SandboxRecord, machine: MachinePort, registry: Registry,
                 policy: Policy, holds: HoldCounter,
                 spawn: Callable[[Awaitable[Any], str], asyncio.Task],
                 metrics: Metrics | None = None, *, lost: bool = False) -> None:
        self.rec = rec
        self.machine = machine
        self.registry = registry
        self.holds = holds
        self.metrics = metrics or Metrics()
        self._spawn = spawn
        self.core = c.SandboxCore(rec.state, policy, suspend_count=rec.suspend_count,
                                  restore_count=rec.restore_count, now=time.monotonic(),
                                  lost=lost)
        self._op: asyncio.Task | None = None
        self._pace = Slots(policy.max_concurrent_requests)
        self._admitted: set[asyncio.Task] = set()
        self._aborted: dict[asyncio.Task, ApiError] = {}
        self._leases: set[Lease] = set()  # requests admitted by try_request()
        self._watch: ExitWatch | None = None
        self._last_activity: float | None = None  # wall clock of the last request's end
        self.streams = 0  # open WebSockets / streamed responses (for metrics and tests)
        self._move: tuple[str, Callable[[], Awaitable[None]], asyncio.Future[None]] | None = None
        machine.on_vmm_started = self._vmm_started

    def __repr__(self) -> str:
        return f"<SandboxController {self.id} {self.core!r}>"

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def record(self) -> SandboxRecord:
        """The sandbox's current registry row, as of the controller's last write (read-only:
        only the controller replaces it)."""
        return self.rec

    @property
    def state(self) -> State:
        return self.core.state

    @property
    def entering(self) -> int:
        return self.core.entering

    @property
    def active(self) -> int:
        return self.core.active

    # Read-only facts of the core, for the service and the warm pool (they never touch it).

    @property
    def serving(self) -> bool:
        """RUNNING with no operation under way: a request is admitted at once."""
        return self.core.serving

    @property
    def is_idle_paused(self) -> bool:
        """PAUSED with no operation under way: claimable, or a snapshot may start."""
        return self.core.is_idle_paused

    @property
    def paused_since(self) -> float:
        """When (monotonic) the current pause began."""
        return self.core.paused_since

    @property
    def vmm_pid(self) -> int | None:
        """The VMM the controller watches (None: none, or not its own)."""
        return self.core.vmm_pid

    def busy_with(self, ops: Collection[c.Op]) -> bool:
        """One of ``ops`` is under way."""
        return self.core.op in ops

    def refresh_record(self) -> SandboxRecord:
        """Re-read the registry row after someone else changed it (a PATCH, a pool claim)."""
        self.rec = self.registry.get(self.id) or self.rec
        return self.rec

    def tell(self, event: object) -> list[c.Command]:
        """Hand the core an event (start-up recovery's), execute what needs no waiting and
        return the rest for the caller."""
        return self._run(self.core.handle(event))

    # -- requests -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def request(self, paced: bool = True) -> AsyncIterator[Wake]:
        """Admit one request: wake the sandbox if needed, then hold it RUNNING while in use."""
        wake = await self._admit()
        task = asyncio.current_task()
        assert task is not None
        self._admitted.add(task)
        try:
            if paced:
                async with self._paced():
                    yield wake
            else:
                yield wake
        except asyncio.CancelledError:
            error = self._aborted.pop(task, None)
            if error is None:
                raise
            task.uncancel()
            raise error from None
        finally:
            self._admitted.discard(task)
            self._aborted.pop(task, None)
            self._run(self.core.handle(c.RequestLeft(admitted=True, now=time.monotonic())))

    @contextlib.asynccontextmanager
    async def _paced(self) -> AsyncIterator[None]:
        """One of the sandbox's ``max_concurrent_requests`` slots. The queue for a slot is
        bounded like the wake hold queue (per sandbox, and in the global count): beyond it,
        503 ``hold_queue_full`` at once rather than an ever longer line of held requests."""
        p = self.core.policy
        if self._pace.full and (self._pace.waiting >= p.max_waiters_per_sandbox
                                or self.holds.held >= p.max_waiters_global):
            raise self._rejection(Unavailable(
                "too many requests queued for this sandbox", code="hold_queue_full",
                headers={"Retry-After": str(p.retry_after_s)}))
        self.holds.held += 1
        try:
            await self._pace.take()
        finally:
            self.holds.held -= 1
        try:
            yield
        finally:
            self._pace.release()

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[Wake]:
        """Like ``request`` for long-lived connections (WebSockets): counted, not paced."""
        async with self.request(paced=False) as wake:
            self.streams += 1
            try:
                yield wake
            finally:
                self.streams -= 1

    def try_request(self, on_abort: Callable[[ApiError], None]) -> Lease | None:
        """``request()`` for a caller that cannot wait (``gateway.preview.fastlane``): a free pacing
        slot and the core's admission now (``AdmitNow``), or None with nothing changed. The
        lease's ``release()`` is the request's end (RequestLeft); a VM that dies calls
        ``on_abort``."""
        if not self._pace.try_take():
            return None
        if not self.core.handle(c.AdmitNow()):  # not serving: the caller takes request()
            self._pace.release()
            return None
        lease = Lease(self, on_abort)
        self._leases.add(lease)
        return lease

    def _lease_done(self, lease: Lease) -> None:
        self._leases.discard(lease)
        self._pace.release()
        self._run(self.core.handle(c.RequestLeft(admitted=True, now=time.monotonic())))

    def idle_for(self) -> float:
        return self.core.idle_for(time.monotonic())

    async def _admit(self) -> Wake:
        self._run(self.core.handle(c.RequestEntered()))
        started, woke = time.monotonic(), False
        queued = True  # counted by the core as entering
        try:
            while True:
                verdict = self._run(self.core.handle(c.AdmissionAsked(
                    waited_s=time.monotonic() - started, held_globally=self.holds.held)))[-1]
                if isinstance(verdict, c.Admit):
                    queued = False
                    ms = (time.monotonic() - started) * 1000 if woke else 0.0
                    return Wake(woke, ms)
                if isinstance(verdict, c.Reject):
                    queued = False
                    raise self._rejection(verdict.error)
                assert isinstance(verdict, c.Hold)
                woke = True
                await self._hold(verdict)
        finally:
            if queued:  # cancelled or failed while held
                self._run(self.core.handle(c.RequestLeft(admitted=False, now=time.monotonic())))

    def _rejection(self, error: ApiError) -> ApiError:
        self.metrics.events[{"hold_queue_full": "hold_rejected"}.get(error.code, error.code)] += 1
        if isinstance(error, SandboxMoved):
            return SandboxMoved(self.id, error.host)
        if isinstance(error, SandboxNotFound):
            return SandboxNotFound(self.id)
        if isinstance(error, SandboxLost):
            return c.lost_error(self.id, self.rec.failure or "")
        return error

    async def _hold(self, hold: c.Hold) -> None:
        """Wait for the current operation (bounded), without being able to cancel it; return
        when it ends or hands over to another (a failed restore to a cold boot), so the caller
        asks the core again and gets the deadline of what now serves the request."""
        op = self._op
        if op is None:
            await asyncio.sleep(0.01)
            return
        self.holds.held += 1
        try:
            await asyncio.wait_for(asyncio.shield(op), hold.timeout)
        except TimeoutError as exc:
            if self._op is not op and self._op is not None:
                return  # handed over just as the wait ended: the core decides again
            self.metrics.events["wake_timeout"] += 1
            raise WakeTimeout(f"sandbox {self.id} did not wake within "
                              f"{hold.deadline:g}s") from exc
        finally:
            self.holds.held -= 1

    # -- operations -------------------------------------------------------------------

    async def create(self) -> None:
        """Create the sandbox's VM (a detached operation); raises what the create raised."""
        self._run(self.core.begin_create())
        assert self._op is not None
        await asyncio.shield(self._op)

    def start_suspend(self, cause: str) -> asyncio.Task:
        """Begin a suspend (RUNNING only). Returns the operation's task."""
        for cmd in self._run(self.core.handle(c.SuspendRequested(cause))):
            if isinstance(cmd, c.Reject):
                raise cmd.error
        assert self._op is not None
        return self._op

    def start_pause(self, cause: str) -> asyncio.Task:
        """Pause now (RUNNING, unused). Returns the operation's task."""
        for cmd in self._run(self.core.handle(c.PauseRequested(cause))):
            if isinstance(cmd, c.Reject):
                raise cmd.error
        assert self._op is not None
        return self._op

    def start_migrate(self, host: str, move: Callable[[], Awaitable[None]]) -> asyncio.Future:
        """Begin moving the running (or shipped SUSPENDED) sandbox to ``host`` (a drain):
        ``move()`` does it
        (``gateway.sandbox.migration``) and returns once the guest runs there, or raises
        with the VM running here again. New requests are held meanwhile. Returns a future
        of the move's outcome (it raises what ``move`` raised; the held requests do not
        see that error: they are admitted, or sent on to the new owner)."""
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._move = (host, move, outcome)
        for cmd in self._run(self.core.handle(c.MigrateRequested(host))):
            if isinstance(cmd, c.Reject):
                raise cmd.error
        assert self._op is not None
        return outcome

    def arrived(self) -> None:
        """The destination's side: the VM moved here runs (``gateway.sandbox.migration``):
        CREATING -> RUNNING, its VMM watched, requests admitted."""
        self._run(self.core.handle(c.CreateFinished(self._vmm())))

    def close(self) -> None:
        """Stop watching the VMM (the daemon is stopping; the VMM keeps running)."""
        self._stop_watch()
        self.flush_activity()

    async def idle_check(self) -> None:
        now, timeout = time.monotonic(), self.rec.idle_timeout
        if not self._run(self.core.handle(c.IdleTick(now, timeout))):
            return
        busy = False
        agent = self.machine.agent
        if agent is not None:
            health = await agent.health(timeout=5)
            busy = bool(health.running or health.veto)
        self._run(self.core.handle(c.GuestProbed(busy, time.monotonic(), timeout)))

    async def destroy(self, cause: str) -> None:
        """Wait for any operation, then destroy. Held requests then see 404."""
        while self._op is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._op)
        self._stop_watch()
        self._run(self.core.handle(c.DestroyRequested(cause)))
        await self.machine.destroy()

    async def wait_op(self) -> None:
        """Wait for the current operation (API suspend/resume wait for completion)."""
        op = self._op
        if op is not None:
            await asyncio.shield(op)

    def _start(self, op: c.Op) -> None:
        coro = {c.Op.CREATE: self._create_op, c.Op.SUSPEND: self._suspend_op,
                c.Op.PAUSE: self._pause_op, c.Op.UNPAUSE: self._unpause_op,
                c.Op.MIGRATE: self._migrate_op}.get(op)
        self._op = self._spawn(coro() if coro else self._restore_op(op),
                               f"{op.value}-{self.id}")

    def _end_op(self) -> None:
        if self._op is asyncio.current_task():
            self._op = None

    async def _create_op(self) -> None:
        try:
            try:
                await self.machine.create()
            except BaseException as exc:
                self._run(self.core.handle(c.CreateFailed(str(exc) or type(exc).__name__)))
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.machine.destroy())
                raise
            self._run(self.core.handle(c.CreateFinished(self._vmm())))
        finally:
            self._end_op()

    async def _restore_op(self, op: c.Op) -> None:
        cold = op is c.Op.COLD_BOOT
        try:
            try:
                ms = await (self.machine.cold_boot() if cold else self.machine.wake())
            except Exception as exc:
                self.metrics.events["restore_failed"] += 1
                err = exc if isinstance(exc, RestoreError) else None
                self._run(self.core.handle(c.RestoreFailedEvent(
                    str(exc) or repr(exc), guest_started=bool(err and err.guest_started),
                    snapshot_unusable=bool(err and err.snapshot_unusable),
                    disk_missing=bool(err and err.disk_missing))))
                if self.core.op is c.Op.COLD_BOOT:
                    return  # the waiters carry on waiting, for the cold boot
                if self.core.lost:
                    raise c.lost_error(self.id, self.rec.failure or "") from exc
                raise c.wake_error(self.id, str(exc), bool(err and err.vmm_died)) from exc
            self.metrics.events["cold_boot" if cold else "restore"] += 1
            self.metrics.restore_seconds.observe(ms / 1000)
            self._run(self.core.handle(c.RestoreFinished(ms, self._vmm())))
        finally:
            self._end_op()

    async def _suspend_op(self) -> None:
        started = time.monotonic()
        try:
            while True:
                cmds = self._run(self.core.handle(c.DrainTick(time.monotonic())))
                if not cmds or not isinstance(cmds[-1], c.WaitDrain):
                    break
                await asyncio.sleep(DRAIN_POLL_S)
            if not cmds or not isinstance(cmds[-1], c.WriteSnapshot):
                self.metrics.events["suspend_cancelled"] += 1
                return
            self._stop_watch()  # from here on the VMM exits on purpose
            try:
                await self.machine.suspend()
            except Exception as exc:
                log.warning("suspend of %s failed: %s", self.id, exc)
                alive = await self._resume_after_failed_suspend()
                self._run(self.core.handle(c.SuspendFailed(str(exc), vm_alive=alive)))
                return
            ms = (time.monotonic() - started) * 1000
            self.metrics.events["suspend"] += 1
            self.metrics.suspend_seconds.observe(ms / 1000)
            self._run(self.core.handle(c.SnapshotWritten(ms)))
        finally:
            self._end_op()

    async def _pause_op(self) -> None:
        try:
            try:
                await self.machine.pause()
            except Exception as exc:
                log.warning("pause of %s failed: %s", self.id, exc)
                alive = await self._resume_after_failed_suspend()
                self._run(self.core.handle(c.PauseFailed(str(exc) or repr(exc), vm_alive=alive)))
                return
            self.metrics.events["pause"] += 1
            self._run(self.core.handle(c.PauseFinished(time.monotonic())))
        finally:
            self._end_op()

    async def _unpause_op(self) -> None:
        try:
            try:
                ms = await self.machine.unpause()
            except Exception as exc:
                log.warning("wake of %s from pause failed: %s", self.id, exc)
                self.metrics.events["unpause_failed"] += 1
                self._stop_watch()  # the VMM is killed on purpose: not a crash
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.machine.stop_vmm())
                self._run(self.core.handle(c.UnpauseFailed(str(exc) or repr(exc))))
                return
            self.metrics.events["unpause"] += 1
            self.metrics.unpause_seconds.observe(ms / 1000)
            self._run(self.core.handle(c.UnpauseFinished(ms)))
        finally:
            self._end_op()

    async def _migrate_op(self) -> None:
        assert self._move is not None
        host, move, outcome = self._move
        try:
            while self._run(self.core.handle(c.DrainTick(time.monotonic()))):
                await asyncio.sleep(DRAIN_POLL_S)  # requests in flight finish here first
            self._stop_watch()  # once moved, this VMM exits on purpose
            try:
                await move()
            except BaseException as exc:
                if isinstance(exc, OutcomeUnknown):
                    # The other host may run the guest: this copy must never run again.
                    # FAILED here; a request cold-boots its disk (docs/cluster.md, Drain:
                    # an operator should check the destination first).
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.machine.stop_vmm())
                driver = self.machine.driver
                alive = driver is not None and driver.alive()
                if alive:
                    vmm = self._vmm()
                    if vmm:
                        self._start_watch(vmm["pid"])
                self.metrics.events["migrate_failed"] += 1
                self._run(self.core.handle(c.MigrateFailed(str(exc) or repr(exc), alive)))
                if not outcome.done():
                    outcome.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            self.metrics.events["migrate"] += 1
            self._run(self.core.handle(c.MigrateFinished(host)))
            with contextlib.suppress(Exception):
                await asyncio.shield(self.machine.destroy())  # its namespace and files
            if not outcome.done():
                outcome.set_result(None)
        finally:
            if not outcome.done():
                outcome.cancel()
            self._end_op()

    async def _resume_after_failed_suspend(self) -> bool:
        try:
            await self.machine.abort_suspend()
        except Exception as exc:
            log.warning("sandbox %s: VM lost after a failed suspend: %s", self.id, exc)
            return False
        vmm = self._vmm()
        if vmm:
            self._start_watch(vmm["pid"])
        return True

    # -- the VMM watcher ----------------------------------------------------------------

    def _vmm_started(self, record: Any) -> None:
        """A VMM exists before its guest may run: record it (recovery adopts it after a
        crash instead of killing it as an orphan)."""
        self.registry.update(self.id, vmm=dict(record.__dict__))

    def _start_watch(self, pid: int) -> None:
        self._stop_watch()
        self._watch = ExitWatch(pid, self._vmm_exited)

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def _vmm_exited(self, pid: int) -> None:
        driver = self.machine.driver
        log.warning("sandbox %s: VMM pid %d exited%s", self.id, pid,
                    driver.exit_detail() if driver is not None and driver.pid == pid else "")
        self._watch = None
        self.metrics.events["vmm_exited"] += 1
        self._run(self.core.handle(c.VMMExited(pid)))

    # -- executing commands ----------------------------------------------------------------

    def _run(self, cmds: Sequence[c.Command]) -> list[c.Command]:
        """Execute the commands that need no waiting; return the others for the caller."""
        rest: list[c.Command] = []
        for cmd in cmds:
            if isinstance(cmd, c.Record):
                self.rec = self.registry.transition(self.id, cmd.event, cmd.cause, **cmd.fields)
                if cmd.fields.get("failure"):
                    log.warning("sandbox %s: %s", self.id, cmd.cause)
            elif isinstance(cmd, c.StartOp):
                self._start(cmd.op)
            elif isinstance(cmd, c.Touch):
                self._touch()
            elif isinstance(cmd, c.Watch):
                self._start_watch(cmd.pid)
            elif isinstance(cmd, c.AbortRequests):
                self._abort_requests(cmd.error)
            else:
                rest.append(cmd)
        return rest

    def _abort_requests(self, error: ApiError) -> None:
        for lease in list(self._leases):
            lease.abort(error)
        for task in list(self._admitted):
            if task not in self._aborted:
                self._aborted[task] = error
                task.cancel()

    def _touch(self) -> None:
        # On every request's end: no disk write on the hot path; flush_activity() persists
        # it (the idle loop, once a second, and at shutdown).
        self._last_activity = time.time()

    def flush_activity(self) -> None:
        """Write ``last_activity`` to the registry if a request ended since the last flush."""
        now, self._last_activity = self._last_activity, None
        if now is not None:
            self.registry.update(self.id, last_activity=now)
            self.rec = dataclasses.replace(self.rec, last_activity=now)

    def _vmm(self) -> dict[str, Any] | None:
        vmm = self.machine.vmm_record()
        return dict(vmm.__dict__) if vmm else None
