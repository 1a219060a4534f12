"""SandboxController.try_request: admission without waiting (gateway.preview.fastlane's entry)."""

from __future__ import annotations

import asyncio

from gateway.sandbox.controller import WakePolicy
from gateway.sandbox.core import VMLost
from gateway.sandbox.states import State
from tests.unit.test_controller import make, one_request, registry  # noqa: F401


async def test_admits_a_running_sandbox_through_the_core(registry):  # noqa: F811
    ctl, _ = make(registry, state=State.RUNNING)
    ctl._last_activity = None
    lease = ctl.try_request(lambda error: None)
    assert lease is not None and ctl.active == 1 and ctl.entering == 0
    assert lease.machine is ctl.machine
    lease.release()
    lease.release()  # idempotent
    assert ctl.active == 0 and ctl._last_activity is not None  # RequestLeft: the touch
    assert not ctl._pace.full and ctl._pace.free == WakePolicy().max_concurrent_requests


async def test_never_holds_or_wakes(registry):  # noqa: F811
    ctl, machine = make(registry)  # SUSPENDED
    assert ctl.try_request(lambda error: None) is None
    assert ctl.state is State.SUSPENDED and machine.wakes == 0
    assert ctl.active == 0 and ctl.entering == 0
    assert ctl._pace.free == WakePolicy().max_concurrent_requests  # the slot it tried: back


async def test_no_free_pacing_slot_declines_and_slots_are_shared(registry):  # noqa: F811
    ctl, _ = make(registry, state=State.RUNNING, policy=WakePolicy(max_concurrent_requests=2))
    a = ctl.try_request(lambda error: None)
    b = ctl.try_request(lambda error: None)
    assert a is not None and b is not None
    assert ctl.try_request(lambda error: None) is None and ctl.active == 2
    waiting = asyncio.ensure_future(one_request(ctl))  # an aiohttp-path request queues
    await asyncio.sleep(0.05)
    assert not waiting.done()
    a.release()
    await asyncio.wait_for(waiting, 2)
    b.release()
    assert ctl.active == 0 and ctl.entering == 0


async def test_a_lost_vm_aborts_leases(registry):  # noqa: F811
    ctl, _ = make(registry, state=State.RUNNING)
    seen = []
    lease = ctl.try_request(seen.append)
    assert lease is not None
    ctl._abort_requests(VMLost("gone"))
    assert [e.code for e in seen] == ["sandbox_crashed"] and ctl.active == 0
    lease.release()  # the holder's own release after the abort changes nothing
    assert ctl.active == 0
