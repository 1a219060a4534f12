"""Machine's overlapped wake: the VMM start and the snapshot work (a worker thread) race;
whatever fails first, the thread is waited for and an unusable snapshot is what is reported."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vmctl.errors import SnapshotError
from vmctl.machine import Machine, RestoreError


def _machine(work, start_from) -> Machine:  # type: ignore[no-untyped-def]
    plan = SimpleNamespace(vm_id="m1", root=Path("/nonexistent/m1"))
    m = Machine(plan, SimpleNamespace())  # type: ignore[arg-type]
    m._ready_snapshot = work  # type: ignore[method-assign]
    m._start_from = start_from  # type: ignore[method-assign]
    return m


async def test_a_vmm_that_fails_first_still_hears_of_an_unusable_snapshot() -> None:
    done = threading.Event()

    def work(prepared, started):  # type: ignore[no-untyped-def]
        time.sleep(0.2)  # still rebuilding when the VMM gives up
        done.set()
        raise SnapshotError("snapshot memory diff is missing")

    async def start_from(source, consumes=None):  # type: ignore[no-untyped-def]
        raise RestoreError("qemu: QEMU did not come up", guest_started=False)

    with pytest.raises(RestoreError, match="diff is missing") as info:
        await _machine(work, start_from)._start_overlapped(None, 0.0)
    assert info.value.snapshot_unusable and not info.value.guest_started
    assert done.is_set()  # the thread writing the memory file had finished


async def test_the_vmm_gets_the_snapshot_once_the_work_is_done() -> None:
    order: list[str] = []

    def work(prepared, started):  # type: ignore[no-untyped-def]
        time.sleep(0.1)
        order.append("work done")
        return "snap"

    async def start_from(source, consumes=None):  # type: ignore[no-untyped-def]
        order.append("vmm up")  # before the work is done: that is the overlap
        assert await source() == "snap"
        order.append("loaded")

    await _machine(work, start_from)._start_overlapped(None, 0.0)
    assert order == ["vmm up", "work done", "loaded"]


async def test_a_cancelled_wake_waits_for_the_thread_before_it_ends() -> None:
    done = threading.Event()

    def work(prepared, started):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        done.set()
        return "snap"

    async def start_from(source, consumes=None):  # type: ignore[no-untyped-def]
        await source()

    task = asyncio.ensure_future(_machine(work, start_from)._start_overlapped(None, 0.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done.is_set()
