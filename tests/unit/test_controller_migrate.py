"""A sandbox's move to another host as its controller runs it (gateway/sandbox/controller.py,
op MIGRATE): requests arriving meanwhile are held; after a move they are refused with
SandboxMoved (the routing middleware sends them on), after a failed move admitted here."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import OwnerUnavailable, SandboxMoved
from gateway.sandbox.controller import WakePolicy
from gateway.sandbox.states import State
from tests.unit.test_controller import FakeMachine, make, one_request, registry  # noqa: F401


async def test_held_requests_go_to_the_new_owner_after_the_move(registry) -> None:  # noqa: F811
    ctl, m = make(registry, state=State.RUNNING)
    release = asyncio.Event()

    async def move() -> None:
        await release.wait()

    outcome = ctl.start_migrate("host-b", move)
    held = [asyncio.ensure_future(one_request(ctl)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert not any(h.done() for h in held) and ctl.entering == 3
    release.set()
    await outcome
    results = await asyncio.gather(*held, return_exceptions=True)
    assert all(isinstance(r, SandboxMoved) and r.host == "host-b" and "sb1" in str(r)
               for r in results), results
    assert ctl.state is State.DESTROYED and ("destroy",) in m.calls
    assert registry.get("sb1").state is State.DESTROYED
    assert registry.transitions("sb1")[-1]["cause"] == "moved to host host-b"


async def test_a_request_in_flight_finishes_here_before_the_switch(registry) -> None:  # noqa: F811
    ctl, m = make(registry, state=State.RUNNING)
    started: list[float] = []

    async def move() -> None:
        started.append(asyncio.get_running_loop().time())

    busy = asyncio.ensure_future(one_request(ctl, hold=0.3))
    await asyncio.sleep(0.02)
    outcome = ctl.start_migrate("host-b", move)
    await outcome
    assert (await busy).woke is False  # answered from here, whole
    assert busy.done() and started and ctl.state is State.DESTROYED


async def test_an_endless_request_is_answered_not_resent_after_drain_timeout(
        registry) -> None:  # noqa: F811
    ctl, m = make(registry, state=State.RUNNING, policy=WakePolicy(drain_timeout=0.1))

    async def move() -> None:
        pass

    busy = asyncio.ensure_future(one_request(ctl, hold=5.0))
    await asyncio.sleep(0.02)
    await ctl.start_migrate("host-b", move)
    with pytest.raises(OwnerUnavailable) as err:
        await busy
    assert not isinstance(err.value, SandboxMoved)


class LiveDriver:
    pid = 4242

    def alive(self) -> bool:
        return True


async def test_a_failed_move_admits_the_held_requests_here_without_its_error(
        registry) -> None:  # noqa: F811
    ctl, m = make(registry, state=State.RUNNING)
    m.driver = LiveDriver()  # vmctl left the VM running here

    async def move() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("destination died")

    outcome = ctl.start_migrate("host-b", move)
    held = [asyncio.ensure_future(one_request(ctl)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="destination died"):
        await outcome
    results = await asyncio.gather(*held)
    assert len(results) == 3 and not any(w.woke and m.cold_boots for w in results)
    assert ctl.state is State.RUNNING and ctl.serving and m.cold_boots == 0
    assert [t["event"] for t in registry.transitions("sb1")][-1] == "created"  # nothing new
    assert ctl.metrics.events["migrate_failed"] == 1


async def test_a_move_that_lost_the_vm_fails_the_sandbox(registry) -> None:  # noqa: F811
    ctl, m = make(registry, state=State.RUNNING)  # m.driver is None: the VMM is gone

    async def move() -> None:
        raise RuntimeError("source VMM crashed")

    with pytest.raises(RuntimeError):
        await ctl.start_migrate("host-b", move)
    assert ctl.state is State.FAILED


async def test_a_waking_sandbox_does_not_move(registry) -> None:  # noqa: F811
    ctl, _ = make(registry, state=State.SUSPENDED)

    async def move() -> None:
        raise AssertionError("not expected")

    waking = asyncio.ensure_future(one_request(ctl))
    await asyncio.sleep(0)  # the request began its wake
    with pytest.raises(Exception, match="restor"):
        ctl.start_migrate("host-b", move)
    await waking


async def test_a_handed_over_suspended_sandbox_never_wakes_here(registry) -> None:  # noqa: F811
    """A drain hands a shipped SUSPENDED sandbox over (its record's compare-and-set as the
    op): requests arriving meanwhile are held, not woken here; after the record moved they
    are refused with SandboxMoved (forwarded), and the local copy is gone."""
    ctl, m = make(registry, state=State.SUSPENDED)
    release = asyncio.Event()

    async def record_move() -> None:
        await release.wait()

    outcome = ctl.start_migrate("host-b", record_move)
    held = [asyncio.ensure_future(one_request(ctl)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert not any(h.done() for h in held) and ctl.entering == 3
    assert m.wakes == 0 and ctl.state is State.SUSPENDED
    release.set()
    await outcome
    results = await asyncio.gather(*held, return_exceptions=True)
    assert all(isinstance(r, SandboxMoved) and r.host == "host-b" for r in results), results
    assert m.wakes == 0 and m.cold_boots == 0 and ("destroy",) in m.calls
    assert registry.get("sb1").state is State.DESTROYED
    assert registry.transitions("sb1")[-1]["cause"] == "moved to host host-b"


async def test_a_failed_handover_wakes_the_held_requests_here(registry) -> None:  # noqa: F811
    ctl, m = make(registry, state=State.SUSPENDED)

    async def record_move() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("its record changed")

    outcome = ctl.start_migrate("host-b", record_move)
    held = [asyncio.ensure_future(one_request(ctl)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="record changed"):
        await outcome
    results = await asyncio.gather(*held)
    assert len(results) == 3 and m.wakes == 1 and m.cold_boots == 0
    assert ctl.state is State.RUNNING and ("destroy",) not in m.calls
