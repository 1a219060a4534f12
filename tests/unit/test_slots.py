"""gateway.sandbox.slots.Slots: the per-sandbox pacing slots (taken now, or awaited in order)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sandbox.slots import Slots


def test_try_take_takes_free_slots_only():
    slots = Slots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take() and slots.full and slots.free == 0
    slots.release()
    assert not slots.full and slots.try_take()


def test_at_least_one_slot():
    with pytest.raises(ValueError):
        Slots(0)


async def test_waiters_are_served_in_order_and_try_take_does_not_jump_the_line():
    slots = Slots(1)
    assert slots.try_take()
    order: list[int] = []

    async def waiter(n: int) -> None:
        await slots.take()
        order.append(n)

    tasks = [asyncio.ensure_future(waiter(n)) for n in range(3)]
    await asyncio.sleep(0)
    assert slots.waiting == 3
    slots.release()  # handed to waiter 0, not to the pool
    assert not slots.try_take() and slots.free == 0
    await asyncio.sleep(0)
    for _ in range(2):
        slots.release()
        await asyncio.sleep(0)
    assert order == [0, 1, 2] and slots.waiting == 0
    slots.release()
    assert slots.free == 1
    await asyncio.gather(*tasks)


async def test_a_cancelled_waiter_leaves_the_line():
    slots = Slots(1)
    assert slots.try_take()
    task = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slots.waiting == 0
    slots.release()
    assert slots.free == 1


async def test_a_slot_handed_to_a_waiter_cancelled_before_it_ran_goes_to_the_next():
    slots = Slots(1)
    assert slots.try_take()
    first = asyncio.ensure_future(slots.take())
    second = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    slots.release()   # first's future gets the slot ...
    first.cancel()    # ... but first is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the slot went on to second
    assert slots.free == 0 and slots.waiting == 0
    slots.release()
    assert slots.free == 1
