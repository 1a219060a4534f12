"""Wake-on-request and idle-suspend logic against a fake machine (no VMs, milliseconds)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
import time
from pathlib import Path

import pytest

from gateway.sandbox.controller import (
    HoldCounter,
    RestoreFailed,
    SandboxController,
    WakePolicy,
    WakeTimeout,
)
from gateway.sandbox.core import VMLost
from gateway.errors import Unavailable
from gateway.sandbox.states import Event, State
from gateway.store.registry import Registry, SandboxRecord
from vmctl.machine import RestoreError


class FakeMachine:
    """Implements the sandbox layer's port (``MachinePort``; test_machine_port.py checks it)."""

    def __init__(self, wake_s=0.02, suspend_s=0.02, cold_boot_s=0.0):
        self.wake_s, self.suspend_s, self.cold_boot_s = wake_s, suspend_s, cold_boot_s
        self.wakes = self.suspends = self.cold_boots = self.aborts = 0
        self.fail_next_wake: Exception | None = None
        self.running = True
        self.agent = None
        self.driver = None
        self.on_vmm_started = None
        self.plan = None  # the sandbox layer itself never reads it (routes do)
        self.snapshot_dir = Path("/nonexistent/snapshot")
        self.calls: list[tuple] = []  # recovery's steps, as (method, args...)

    async def create(self):
        self.running = True

    async def pause(self):
        self.running = False

    async def unpause(self):
        self.running = True
        return 0.0

    async def stop_vmm(self):
        self.running = False

    async def capture(self, dest, meta):
        return 0.0

    async def adopt(self, record):
        self.calls.append(("adopt", record))
        self.running = True

    async def adopt_paused(self, record):
        self.calls.append(("adopt_paused", record))

    async def ensure_running(self):
        self.calls.append(("ensure_running",))

    async def finish_restore(self):
        self.calls.append(("finish_restore",))

    async def kill_recorded(self, record):
        self.calls.append(("kill_recorded", record))
        self.running = False

    def require_agent(self):
        if self.agent is None:
            raise RuntimeError("no agent")
        return self.agent

    async def wake(self):
        self.wakes += 1
        await asyncio.sleep(self.wake_s)
        if self.fail_next_wake is not None:
            exc, self.fail_next_wake = self.fail_next_wake, None
            raise exc
        self.running = True
        return self.wake_s * 1000

    async def cold_boot(self):
        self.cold_boots += 1
        await asyncio.sleep(self.cold_boot_s)
        self.running = True
        return 1.0

    async def suspend(self):
        assert self.running
        self.suspends += 1
        await asyncio.sleep(self.suspend_s)
        self.running = False

    async def abort_suspend(self):
        self.aborts += 1

    async def destroy(self):
        self.calls.append(("destroy",))
        self.running = False

    def vmm_record(self):
        return None


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    yield reg
    reg.close()


def make(registry, state=State.SUSPENDED, policy=None, machine=None):
    now = time.time()
    rec = SandboxRecord(id="sb1", tenant="t", template="python", state=State.CREATING, slot=0,
                        root="/nonexistent", golden="/g", idle_timeout=60, host="h",
                        created_at=now, updated_at=now, last_activity=now)
    registry.insert_sandbox(rec)
    registry.transition("sb1", Event.CREATED)
    if state is State.SUSPENDED:
        registry.transition("sb1", Event.SUSPEND)
        registry.transition("sb1", Event.SUSPENDED)
    tasks = set()

    def spawn(coro, name):
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(lambda t: (tasks.discard(t), t.cancelled() or t.exception()))
        return t

    machine = machine or FakeMachine()
    machine.running = state is State.RUNNING
    ctl = SandboxController(registry.get("sb1"), machine, registry, policy or WakePolicy(),
                            HoldCounter(), spawn)
    return ctl, machine


async def one_request(ctl, hold=0.0):
    async with ctl.request() as wake:
        assert ctl.state is State.RUNNING and ctl.machine.running
        await asyncio.sleep(hold)
        return wake


async def test_200_concurrent_requests_one_restore(registry):
    ctl, m = make(registry)
    results = await asyncio.gather(*(one_request(ctl) for _ in range(200)))
    assert m.wakes == 1 and len(results) == 200
    assert all(w.woke for w in results) and ctl.state is State.RUNNING
    assert registry.get("sb1").restore_count == 1
    assert ctl.holds.held == 0 and ctl.entering == 0 and ctl.active == 0
    assert ctl.metrics.events["restore"] == 1 and ctl.metrics.restore_seconds.n == 1
    text = ctl.metrics.render(Counter(running=1), held=0)
    assert 'agentbox_events_total{event="restore"} 1' in text
    assert "agentbox_restore_seconds_count 1" in text


async def test_first_client_cancelling_does_not_cancel_restore(registry):
    ctl, m = make(registry, machine=FakeMachine(wake_s=0.1))
    first = asyncio.ensure_future(one_request(ctl))
    await asyncio.sleep(0.02)
    second = asyncio.ensure_future(one_request(ctl))
    first.cancel()
    await asyncio.sleep(0)
    assert (await second).woke
    assert first.cancelled() and m.wakes == 1 and ctl.state is State.RUNNING
    assert ctl.entering == 0 and ctl.holds.held == 0


async def test_restore_failure_reaches_every_waiter_and_is_not_cached(registry):
    ctl, m = make(registry)
    m.fail_next_wake = RestoreError("boom", guest_started=False)
    results = await asyncio.gather(*(one_request(ctl) for _ in range(20)),
                                   return_exceptions=True)
    assert all(isinstance(r, RestoreFailed) and "boom" in str(r) for r in results)
    assert ctl.state is State.SUSPENDED and m.wakes == 1
    assert (await one_request(ctl)).woke and m.wakes == 2 and ctl.state is State.RUNNING


async def test_failure_after_guest_started_falls_back_to_a_cold_boot_in_the_same_wake(registry):
    ctl, m = make(registry)
    m.fail_next_wake = RestoreError("agent silent", guest_started=True)
    results = await asyncio.gather(*(one_request(ctl) for _ in range(5)))
    assert all(w.woke for w in results)  # every waiter served, by the cold boot
    assert m.wakes == 1 and m.cold_boots == 1 and ctl.state is State.RUNNING
    events = [t["event"] for t in registry.transitions("sb1")]
    assert events[-4:] == ["wake", "snapshot_lost", "wake", "restored"]
    assert registry.get("sb1").failure is None


async def test_a_failed_cold_boot_is_not_retried_until_the_next_request(registry):
    class NoDisk(FakeMachine):
        async def cold_boot(self):
            self.cold_boots += 1
            await asyncio.sleep(0.01)
            raise RestoreError("disk gone", guest_started=True)

    ctl, m = make(registry, machine=NoDisk())
    m.fail_next_wake = RestoreError("corrupt", guest_started=False, snapshot_unusable=True)
    with pytest.raises(RestoreFailed):
        await one_request(ctl)
    assert ctl.state is State.FAILED and m.cold_boots == 1
    await asyncio.sleep(0.05)
    assert m.cold_boots == 1  # no loop
    with pytest.raises(RestoreFailed):
        await one_request(ctl)
    assert m.cold_boots == 2 and "disk gone" in registry.get("sb1").failure


async def test_a_vmm_killed_during_the_wake_is_503_with_retry_after_not_502(registry):
    class Killed(FakeMachine):
        async def cold_boot(self):
            self.cold_boots += 1
            await asyncio.sleep(0.01)
            if self.cold_boots == 1:  # killed from outside while its guest booted
                raise RestoreError("the VMM exited", guest_started=True, vmm_died=True)
            self.running = True
            return 1.0

    ctl, m = make(registry, machine=Killed())
    m.fail_next_wake = RestoreError("the VMM exited", guest_started=True, vmm_died=True)
    with pytest.raises(VMLost) as info:
        await one_request(ctl)
    assert info.value.status == 503 and info.value.headers["Retry-After"]
    assert ctl.state is State.FAILED
    assert (await one_request(ctl)).woke and m.cold_boots == 2  # the retry it was told to make


async def test_hold_queue_overflow_is_503_with_retry_after(registry):
    ctl, m = make(registry, policy=WakePolicy(max_waiters_per_sandbox=5),
                  machine=FakeMachine(wake_s=0.2))
    results = await asyncio.gather(*(one_request(ctl) for _ in range(10)),
                                   return_exceptions=True)
    rejected = [r for r in results if isinstance(r, Unavailable)]
    assert rejected and all(r.headers["Retry-After"] for r in rejected)
    assert all(r.code == "hold_queue_full" for r in rejected)
    assert len(rejected) + sum(1 for r in results if not isinstance(r, Exception)) == 10
    assert m.wakes == 1


async def test_pacing_queue_of_a_running_sandbox_is_bounded(registry):
    # RUNNING: nothing is held for a wake, but requests beyond max_concurrent_requests queue
    # for a slot. That queue is bounded too: the overflow is 503 at once, not held forever.
    ctl, m = make(registry, state=State.RUNNING,
                  policy=WakePolicy(max_concurrent_requests=2, max_waiters_per_sandbox=3))
    gate = asyncio.Event()

    async def busy():
        async with ctl.request():
            await gate.wait()

    tasks = [asyncio.ensure_future(busy()) for _ in range(5)]  # 2 in slots, 3 queued
    await asyncio.sleep(0.05)
    assert ctl.active == 5 and ctl.holds.held == 3
    with pytest.raises(Unavailable) as info:
        await asyncio.wait_for(one_request(ctl), 1.0)
    assert info.value.code == "hold_queue_full" and info.value.headers["Retry-After"]
    assert ctl.metrics.events["hold_rejected"] == 1
    gate.set()
    await asyncio.gather(*tasks)
    assert ctl.active == 0 and ctl.holds.held == 0
    await one_request(ctl)  # the queue drained: admitted again


async def test_cancelled_pacing_waiter_leaves_the_queue(registry):
    ctl, m = make(registry, state=State.RUNNING,
                  policy=WakePolicy(max_concurrent_requests=1, max_waiters_per_sandbox=1))
    gate = asyncio.Event()

    async def busy():
        async with ctl.request():
            await gate.wait()

    first = asyncio.ensure_future(busy())
    queued = asyncio.ensure_future(busy())
    await asyncio.sleep(0.02)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert ctl.holds.held == 0 and ctl.active == 1
    second = asyncio.ensure_future(busy())  # the freed queue place is usable
    await asyncio.sleep(0.02)
    gate.set()
    await asyncio.gather(first, second)


async def test_wake_deadline_is_504_and_waiters_are_dropped(registry):
    ctl, m = make(registry, policy=WakePolicy(wake_deadline=0.05),
                  machine=FakeMachine(wake_s=0.3))
    with pytest.raises(WakeTimeout):
        await one_request(ctl)
    assert ctl.holds.held == 0 and ctl.entering == 0
    await asyncio.sleep(0.3)  # the restore itself carries on and completes
    assert ctl.state is State.RUNNING


async def test_a_request_waits_for_a_cold_boot_by_the_cold_boot_deadline(registry):
    # The restore fails and hands over to a cold boot that outlasts wake_deadline: the held
    # requests are bounded by cold_boot_deadline instead (seen in CI: a crashed sandbox's
    # cold boot under TCG outlasted the 30 s wake deadline and answered 504).
    policy = WakePolicy(wake_deadline=0.1, cold_boot_deadline=2.0)
    ctl, m = make(registry, policy=policy, machine=FakeMachine(cold_boot_s=0.3))
    m.fail_next_wake = RestoreError("corrupt", guest_started=False, snapshot_unusable=True)
    results = await asyncio.gather(*(one_request(ctl) for _ in range(5)))
    assert all(w.woke and w.wake_ms >= 300 for w in results)
    assert m.cold_boots == 1 and ctl.state is State.RUNNING and ctl.holds.held == 0


async def test_a_cold_boot_past_its_deadline_is_504_naming_that_deadline(registry):
    policy = WakePolicy(wake_deadline=0.05, cold_boot_deadline=0.15)
    ctl, m = make(registry, policy=policy, machine=FakeMachine(cold_boot_s=0.5))
    m.fail_next_wake = RestoreError("corrupt", guest_started=False, snapshot_unusable=True)
    started = time.monotonic()
    with pytest.raises(WakeTimeout, match="within 0.15s"):
        await one_request(ctl)
    assert 0.14 <= time.monotonic() - started < 0.4
    assert ctl.holds.held == 0 and ctl.entering == 0


async def test_suspend_drains_inflight_requests(registry):
    ctl, m = make(registry, state=State.RUNNING)
    req = asyncio.ensure_future(one_request(ctl, hold=0.1))
    while ctl.core.active == 0:  # admitted (a fixed sleep raced on a loaded host)
        await asyncio.sleep(0.001)
    op = ctl.start_suspend("test")
    await asyncio.sleep(0.05)
    assert m.suspends == 0  # still draining: never suspend under a request
    await req
    await op
    assert m.suspends == 1 and ctl.state is State.SUSPENDED


async def test_request_during_drain_cancels_suspend(registry):
    ctl, m = make(registry, state=State.RUNNING)
    busy = asyncio.ensure_future(one_request(ctl, hold=0.05))
    await asyncio.sleep(0.01)
    op = ctl.start_suspend("test")
    late = asyncio.ensure_future(one_request(ctl))
    await asyncio.gather(busy, late, op)
    assert m.suspends == 0 and m.aborts == 0 and ctl.state is State.RUNNING
    log = [t["event"] for t in registry.transitions("sb1")]
    assert log[-2:] == ["suspend", "suspend_aborted"]


@pytest.mark.parametrize("seed", range(30))
async def test_request_racing_suspend_is_answered_exactly_once(registry, seed):
    rnd = random.Random(seed)
    ctl, m = make(registry, state=State.RUNNING,
                  machine=FakeMachine(wake_s=rnd.uniform(0, 0.02), suspend_s=rnd.uniform(0, 0.02)))
    answered = []

    async def req(i):
        await asyncio.sleep(rnd.uniform(0, 0.04))
        async with ctl.request():
            assert m.running
            answered.append(i)

    async def suspender():
        for _ in range(3):
            await asyncio.sleep(rnd.uniform(0, 0.02))
            if ctl.state is State.RUNNING and ctl._op is None:
                await ctl.start_suspend("race")

    await asyncio.gather(*(req(i) for i in range(20)), suspender())
    assert sorted(answered) == list(range(20))
    assert ctl.entering == 0 and ctl.active == 0 and ctl.holds.held == 0
    if ctl._op is not None:
        await ctl._op


async def test_suspend_failure_with_vm_alive_rolls_back(registry):
    class Broken(FakeMachine):
        async def suspend(self):
            raise RuntimeError("disk full")

    ctl, m = make(registry, state=State.RUNNING, machine=Broken())
    await ctl.start_suspend("test")
    assert ctl.state is State.RUNNING and m.aborts == 1


async def test_suspend_gives_up_on_streams_that_stay_open(registry):
    ctl, m = make(registry, state=State.RUNNING,
                  policy=WakePolicy(drain_timeout=0.05))
    opened, release = asyncio.Event(), asyncio.Event()

    async def terminal():
        async with ctl.stream():
            opened.set()
            await release.wait()

    t = asyncio.ensure_future(terminal())
    await opened.wait()
    await ctl.start_suspend("api")
    assert ctl.state is State.RUNNING and m.suspends == 0
    release.set()
    await t


class ProcessMachine(FakeMachine):
    """A fake machine whose "VMM" is a real process, so the pidfd watcher sees it die."""

    def __init__(self):
        super().__init__()
        self.proc = None

    async def _start_vmm(self):
        self.proc = await asyncio.create_subprocess_exec("sleep", "600")

    async def wake(self):
        await self._start_vmm()
        return await super().wake()

    async def cold_boot(self):
        await self._start_vmm()
        return await super().cold_boot()

    def vmm_record(self):
        class Rec:
            def __init__(self, pid):
                self.pid = pid
        return Rec(self.proc.pid) if self.proc else None

    async def kill_vmm(self):
        self.proc.kill()
        await self.proc.wait()


async def test_vmm_death_answers_inflight_requests_at_once_and_next_request_cold_boots(registry):
    from gateway.sandbox.controller import VMLost

    m = ProcessMachine()
    ctl, _ = make(registry, machine=m)
    started = asyncio.Event()

    async def long_request():
        async with ctl.request():
            started.set()
            await asyncio.sleep(300)  # e.g. a proxied request to a guest that stops answering

    req = asyncio.ensure_future(long_request())
    await started.wait()
    t0 = time.monotonic()
    await m.kill_vmm()
    with pytest.raises(VMLost) as err:
        await asyncio.wait_for(req, 5)
    assert time.monotonic() - t0 < 2 and err.value.headers["Retry-After"]
    assert ctl.state is State.FAILED and ctl.active == 0
    assert registry.get("sb1").failure == "VMM exited unexpectedly"
    assert [t["event"] for t in registry.transitions("sb1")][-1] == "crashed"
    await one_request(ctl)  # the next request cold-boots the disk
    assert m.cold_boots == 1 and ctl.state is State.RUNNING
    await m.kill_vmm()
    await asyncio.sleep(0.05)
    assert ctl.state is State.FAILED
    ctl.close()


async def test_a_suspend_stops_watching_before_the_vmm_exits_on_purpose(registry):
    m = ProcessMachine()
    ctl, _ = make(registry, machine=m)
    await one_request(ctl)

    async def suspend():  # the real machine's VMM exits as part of the suspend
        await m.kill_vmm()
    m.suspend = suspend
    await ctl.start_suspend("test")
    await asyncio.sleep(0.05)
    assert ctl.state is State.SUSPENDED
    assert "crashed" not in [t["event"] for t in registry.transitions("sb1")]


async def test_requests_write_nothing_to_disk_until_the_activity_flush(registry):
    ctl, m = make(registry, state=State.RUNNING)
    writes = []
    real_update = registry.update
    registry.update = lambda sid, **kw: (writes.append(kw), real_update(sid, **kw))
    before = registry.get("sb1").last_activity
    for _ in range(50):
        await one_request(ctl)
    assert writes == []  # the hot path does no registry write
    ctl.flush_activity()
    ctl.flush_activity()  # nothing new: no second write
    assert len(writes) == 1 and registry.get("sb1").last_activity > before
