"""One sandbox's controller: wake-on-request and idle suspend.

Theory of operation
-------------------
Every request to a sandbox enters through ``request()``, which counts it
*before* looking at the state (so an idle check can never pick a sandbox that
has a request on its way in). Then, by state:

* RUNNING: go ahead (through a per-sandbox pacing semaphore).
* SUSPENDED / FAILED: start the restore if none is running, and wait for it.
* RESTORING: wait for the restore that is already running.
* SUSPENDING: ask the suspend to give up; it does so if it has not started
  writing the snapshot yet, otherwise it finishes and the request then starts
  a restore. Either way the request is answered once.

There is at most one operation (restore or suspend) per sandbox at a time: a
task owned by the controller, detached from the request that triggered it, so
a client that goes away cancels only its own wait. Waiting is bounded: a
per-sandbox and a global hold limit (overflow: 503 + Retry-After) and a wake
deadline (504). A failed restore is reported to every waiter and not cached:
the state goes back to SUSPENDED, or to FAILED if the guest had already
started (its memory and disk moved on, so the old snapshot is no longer
consistent; the next request cold-boots the sandbox's disk).

All state changes go through ``Registry.transition`` before the I/O they
announce, so a crash at any point leaves a state that reconciliation can
finish or roll back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import ApiError, Conflict, SandboxNotFound, Unavailable
from gateway.lifecycle import Event, State
from gateway.metrics import Metrics
from gateway.registry import Registry, SandboxRecord
from vmctl.machine import RestoreError

log = logging.getLogger(__name__)


class WakeTimeout(ApiError):
    status = 504
    code = "wake_timeout"


class RestoreFailed(ApiError):
    status = 502
    code = "restore_failed"


class MachineLike(Protocol):
    """What the controller needs from ``vmctl.Machine`` (a fake implements it in tests)."""

    async def suspend(self) -> None: ...
    async def wake(self) -> float: ...
    async def cold_boot(self) -> float: ...
    async def abort_suspend(self) -> None: ...
    async def destroy(self) -> None: ...
    def vmm_record(self) -> Any: ...


@dataclass(frozen=True)
class WakePolicy:
    max_waiters_per_sandbox: int = 1000
    max_waiters_global: int = 10000
    wake_deadline: float = 30.0
    max_concurrent_requests: int = 64
    retry_after_s: int = 2
    drain_timeout: float = 30.0  # a suspend waits this long for in-flight work, then gives up

    def __post_init__(self) -> None:
        if min(self.max_waiters_per_sandbox, self.max_waiters_global,
               self.max_concurrent_requests) < 1 or self.wake_deadline <= 0:
            raise ValueError("wake limits must be positive")


class HoldCounter:
    """Requests held across all sandboxes (the global bound)."""

    def __init__(self) -> None:
        self.held = 0


@dataclass
class Wake:
    """What a request learns from entering: whether it woke the sandbox, and how long it took."""

    woke: bool = False
    wake_ms: float = 0.0


class SandboxController:
    def __init__(self, rec: SandboxRecord, machine: MachineLike, registry: Registry,
                 policy: WakePolicy, holds: HoldCounter,
                 spawn: Callable[[Awaitable[Any], str], asyncio.Task],
                 metrics: Metrics | None = None) -> None:
        self.rec = rec
        self.metrics = metrics or Metrics()
        self.machine = machine
        self.registry = registry
        self.policy = policy
        self.holds = holds
        self._spawn = spawn
        self.entering = 0  # requests counted but not yet admitted (held or about to be)
        self.active = 0  # requests using the machine now
        self.streams = 0  # open WebSockets / streamed responses
        self._op: asyncio.Task | None = None
        self._cancel_suspend = False
        self._pace = asyncio.Semaphore(policy.max_concurrent_requests)
        self._idle_since = time.monotonic()

    def __repr__(self) -> str:
        return (f"<SandboxController {self.rec.id} {self.state.name} active={self.active} "
                f"entering={self.entering} streams={self.streams}>")

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def state(self) -> State:
        return self.rec.state

    # -- requests -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def request(self, paced: bool = True) -> AsyncIterator[Wake]:
        """Admit one request: wake the sandbox if needed, then hold it RUNNING while in use."""
        self.entering += 1
        try:
            wake = await self._admit()
        finally:
            self.entering -= 1
        self.active += 1
        try:
            if paced:
                async with self._pace:
                    yield wake
            else:
                yield wake
        finally:
            self.active -= 1
            self.touch()

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[Wake]:
        """Like ``request`` for long-lived connections (WebSockets): counted, not paced."""
        async with self.request(paced=False) as wake:
            self.streams += 1
            try:
                yield wake
            finally:
                self.streams -= 1

    def touch(self) -> None:
        self._idle_since = time.monotonic()
        self.rec = self._update(last_activity=time.time())

    def idle_for(self) -> float:
        """Seconds without any host-visible activity (0 while anything is in flight)."""
        if self.active or self.entering or self.streams:
            return 0.0
        return time.monotonic() - self._idle_since

    async def _admit(self) -> Wake:
        wake = Wake()
        started = time.monotonic()
        while True:
            state = self.state
            if state is State.RUNNING:
                if wake.woke:
                    wake.wake_ms = (time.monotonic() - started) * 1000
                return wake
            if state is State.DESTROYED:
                raise SandboxNotFound(self.id)
            if state in (State.SUSPENDED, State.FAILED):
                self._start_restore(cause="woken by a request")
                wake.woke = True
            elif state is State.SUSPENDING:
                self._cancel_suspend = True
                wake.woke = True
            elif state is State.RESTORING:
                wake.woke = True
            await self._hold(started)

    async def _hold(self, started: float) -> None:
        """Wait for the current operation (bounded), without being able to cancel it."""
        if self.entering > self.policy.max_waiters_per_sandbox or \
                self.holds.held >= self.policy.max_waiters_global:
            self.metrics.events["hold_rejected"] += 1
            raise Unavailable(f"too many requests waiting for sandbox {self.id} to wake",
                              code="hold_queue_full",
                              headers={"Retry-After": str(self.policy.retry_after_s)})
        op = self._op
        if op is None:  # CREATING with no task is handled by the service; just yield
            await asyncio.sleep(0.01)
            return
        remaining = self.policy.wake_deadline - (time.monotonic() - started)
        if remaining <= 0:
            raise WakeTimeout(f"sandbox {self.id} did not wake within "
                              f"{self.policy.wake_deadline:.0f}s")
        self.holds.held += 1
        try:
            await asyncio.wait_for(asyncio.shield(op), remaining)
        except TimeoutError as exc:
            self.metrics.events["wake_timeout"] += 1
            raise WakeTimeout(f"sandbox {self.id} did not wake within "
                              f"{self.policy.wake_deadline:.0f}s") from exc
        finally:
            self.holds.held -= 1

    # -- restore ---------------------------------------------------------------------

    def _start_restore(self, cause: str) -> asyncio.Task:
        if self._op is None:
            cold = self.state is State.FAILED
            self.rec = self.registry.transition(self.id, Event.WAKE, cause)
            self._op = self._spawn(self._restore(cold), f"restore-{self.id}")
        return self._op

    async def _restore(self, cold: bool) -> None:
        try:
            try:
                ms = await (self.machine.cold_boot() if cold else self.machine.wake())
            except RestoreError as exc:
                self.metrics.events["restore_failed"] += 1
                if exc.guest_started or cold:
                    self._set(Event.SNAPSHOT_LOST, f"restore failed: {exc}", failure=str(exc))
                else:
                    self._set(Event.RESTORE_FAILED, f"restore failed: {exc}", failure=str(exc))
                raise RestoreFailed(f"sandbox {self.id} could not be restored: {exc}") from exc
            except Exception as exc:
                self.metrics.events["restore_failed"] += 1
                self._set(Event.RESTORE_FAILED, f"restore failed: {exc!r}", failure=str(exc))
                raise RestoreFailed(f"sandbox {self.id} could not be restored: {exc}") from exc
            self.metrics.events["cold_boot" if cold else "restore"] += 1
            self.metrics.restore_seconds.observe(ms / 1000)
            vmm = self.machine.vmm_record()
            self._set(Event.RESTORED, "cold boot of its disk" if cold else "restored snapshot",
                      vmm=vmm.__dict__ if vmm else None, failure=None,
                      restore_count=self.rec.restore_count + 1, last_restore_ms=round(ms, 1))
            self.touch()
        finally:
            self._op = None

    # -- suspend ---------------------------------------------------------------------

    def start_suspend(self, cause: str) -> asyncio.Task:
        """Begin a suspend (RUNNING only). Returns the operation's task."""
        if self.state is not State.RUNNING or self._op is not None:
            raise Conflict(f"sandbox {self.id} is {self.state.value}", code="not_running")
        self._cancel_suspend = False
        self.rec = self.registry.transition(self.id, Event.SUSPEND, cause)
        self._op = self._spawn(self._suspend(), f"suspend-{self.id}")
        return self._op

    async def _suspend(self) -> None:
        started = time.monotonic()
        try:
            # Drain: requests already admitted finish first; new ones are held meanwhile.
            # Open streams (terminals, WebSockets) can last forever: give up after a bound.
            drain_deadline = time.monotonic() + self.policy.drain_timeout
            while self.active or self.streams:
                if self._cancel_suspend or time.monotonic() > drain_deadline:
                    self._cancel_suspend = True
                    break
                await asyncio.sleep(0.005)
            if self._cancel_suspend or self.entering:
                self.metrics.events["suspend_cancelled"] += 1
                self._set(Event.SUSPEND_ABORTED,
                          "requests still in flight, or one arrived before the snapshot")
                return
            try:
                await self.machine.suspend()
            except Exception as exc:
                await self._suspend_failed(exc)
                return
            ms = (time.monotonic() - started) * 1000
            self.metrics.events["suspend"] += 1
            self.metrics.suspend_seconds.observe(ms / 1000)
            self._set(Event.SUSPENDED, "snapshot written; VMM exited", vmm=None,
                      suspend_count=self.rec.suspend_count + 1, last_suspend_ms=round(ms, 1))
        finally:
            self._op = None
        if self.entering:  # requests arrived while the snapshot was being written
            self._start_restore(cause="a request arrived during the suspend")

    async def _suspend_failed(self, exc: Exception) -> None:
        log.warning("suspend of %s failed: %s", self.id, exc)
        try:
            await self.machine.abort_suspend()
        except Exception as resume_exc:
            self._set(Event.SUSPEND_FAILED, f"suspend failed ({exc}); VM lost ({resume_exc})",
                      failure=str(exc), vmm=None)
        else:
            self._set(Event.SUSPEND_ABORTED, f"suspend failed, VM resumed: {exc}")

    # -- destroy -----------------------------------------------------------------------

    async def destroy(self, cause: str) -> None:
        """Wait for any operation, then destroy. Held requests then see 404."""
        while self._op is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._op)
        self.rec = self.registry.transition(self.id, Event.DESTROY, cause, vmm=None)
        await self.machine.destroy()

    async def wait_op(self) -> None:
        """Wait for the current operation (API suspend/resume wait for completion)."""
        op = self._op
        if op is not None:
            await asyncio.shield(op)

    # -- helpers -------------------------------------------------------------------------

    def _set(self, event: Event, cause: str, **updates: Any) -> None:
        self.rec = self.registry.transition(self.id, event, cause, **updates)

    def _update(self, **updates: Any) -> SandboxRecord:
        # On every request's end: write, but do not read the row back.
        self.registry.update(self.id, **updates)
        return dataclasses.replace(self.rec, **updates)
