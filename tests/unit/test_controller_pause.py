"""The controller's pause and unpause operations against a fake machine (no VMs)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sandbox.controller import WakePolicy
from gateway.sandbox.states import State
from gateway.store.registry import Registry
from tests.unit.test_controller import FakeMachine, make, one_request


class PausingMachine(FakeMachine):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.pauses = self.unpauses = self.stops = 0
        self.fail_unpause = False

    async def pause(self):
        self.pauses += 1
        await asyncio.sleep(0.01)
        self.paused, self.running = True, False

    async def unpause(self):
        self.unpauses += 1
        await asyncio.sleep(0.01)
        if self.fail_unpause:
            raise RuntimeError("agent silent")
        self.paused, self.running = False, True
        return 10.0

    async def stop_vmm(self):
        self.stops += 1
        self.running = False

    async def cold_boot(self):
        self.paused = False
        return await super().cold_boot()


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    yield reg
    reg.close()


async def paused_controller(registry, m):
    ctl, _ = make(registry, state=State.RUNNING, machine=m,
                  policy=WakePolicy(suspend_after_pause=60))
    await asyncio.shield(ctl.start_pause("test"))
    assert ctl.state is State.PAUSED and m.paused
    assert registry.get("sb1").state is State.PAUSED
    return ctl


async def test_concurrent_requests_to_a_paused_sandbox_share_one_unpause(registry):
    m = PausingMachine()
    ctl = await paused_controller(registry, m)
    wakes = await asyncio.gather(*(one_request(ctl) for _ in range(20)))
    assert m.unpauses == 1 and all(w.woke for w in wakes) and m.wakes == 0
    assert ctl.state is State.RUNNING and registry.get("sb1").state is State.RUNNING
    assert ctl.metrics.events["unpause"] == 1 and ctl.metrics.unpause_seconds.n == 1
    assert [t["event"] for t in registry.transitions("sb1")][-2:] == ["pause", "unpause"]
    ctl.close()


async def test_a_failed_unpause_kills_the_vmm_and_the_request_cold_boots(registry):
    m = PausingMachine()
    ctl = await paused_controller(registry, m)
    m.fail_unpause = True
    await one_request(ctl)  # answered, after a cold boot of the disk
    assert m.stops == 1 and m.cold_boots == 1 and ctl.state is State.RUNNING
    events = [t["event"] for t in registry.transitions("sb1")]
    assert events[-4:] == ["unpause", "crashed", "wake", "restored"]
    ctl.close()


async def test_suspend_of_a_paused_sandbox(registry):
    m = PausingMachine()
    ctl = await paused_controller(registry, m)
    m.running = True  # the real machine continues a paused VM before its snapshot
    await asyncio.shield(ctl.start_suspend("paused for 60s"))
    assert ctl.state is State.SUSPENDED and m.suspends == 1
    ctl.close()


class SlowPausingMachine(PausingMachine):
    async def pause(self):
        self.pauses += 1
        await asyncio.sleep(0.2)  # a VM whose vCPUs take a while to stop
        self.paused, self.running = True, False

    async def suspend(self):
        self.running = True  # the real machine continues a paused VM before its snapshot
        await super().suspend()


@pytest.mark.parametrize("mid_pause", [False, True])
async def test_make_room_snapshots_a_paused_sandbox_even_while_its_pause_is_under_way(
        registry, mid_pause):
    """At max_awake, make_room snapshots the tenant's paused sandbox. The pause is recorded
    when it begins, so a create can arrive while the VM is still being stopped: it waits
    for that pause and then takes the sandbox's room (it used to give up: 409)."""
    from types import SimpleNamespace

    from gateway.tenancy import quotas
    from gateway.sandbox.metrics import Metrics
    from gateway.sandbox.service import SandboxService

    m = SlowPausingMachine()
    ctl, _ = make(registry, state=State.RUNNING, machine=m,
                  policy=WakePolicy(suspend_after_pause=60))
    pausing = ctl.start_pause("idle")
    assert registry.get("sb1").state is State.PAUSED and ctl.core.op is not None
    if not mid_pause:
        await asyncio.shield(pausing)
    svc = SimpleNamespace(_controllers={"sb1": ctl}, metrics=Metrics())
    svc.limits = lambda tenant: quotas.Limits(max_awake=1)
    svc.tenant_usage = lambda tenant: quotas.usage_of(r.state for r in registry.list(tenant))
    svc._paused = SandboxService._paused.__get__(svc)
    svc._suspend_paused = SandboxService._suspend_paused.__get__(svc)
    await asyncio.wait_for(SandboxService.make_room(svc, "t"), 5)
    assert registry.get("sb1").state is State.SUSPENDED
    assert m.pauses == 1 and m.suspends == 1
    ctl.close()
