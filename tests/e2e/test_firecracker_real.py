"""The Firecracker driver with the real ``firecracker`` binary and a real guest.

Runs only where ``firecracker_usable()`` says so (the pinned release on PATH, a
normal KVM host; see docs/bare-metal.md) and the guest kernel and python
template are built; otherwise skipped with the one-line reason. Boots the
python template's rootfs with images/firecracker's vmlinux, waits for the guest
agent over virtio-net, then suspends (pause, snapshot, kill) and wakes (new
process, snapshot load) and checks the agent answers again. Lifecycle through
the gateway (exec, suspend/wake on idle) is covered by the gateway's e2e suite
once it runs with ``vmm = "firecracker"``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_firecracker_kernel import (
    AGENT_MARKER,
    CMDLINE,
    agent_health,
    firecracker_kernel,
    tap_namespace,
    template_rootfs,
    wait_for_text,
)
from vmctl.driver import pid_alive
from vmctl.drivers.fc_api import FirecrackerAPI
from vmctl.drivers.firecracker import FirecrackerDriver, copy_sparse, firecracker_usable
from vmctl.spec import Accel, VMSpec

USABLE, WHY = firecracker_usable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not USABLE, reason=WHY)]


def _spec(root: Path, name: str, kernel: Path, disk: Path, ns: str) -> VMSpec:
    return VMSpec(vm_id=name, workdir=root / name, kernel=kernel, disk=disk,
                  mem_file=root / name / "unused", cmdline=CMDLINE, mem_mib=512, vcpus=2,
                  netns=ns, accel=Accel.KVM)


async def _state(driver: FirecrackerDriver) -> str:
    api = FirecrackerAPI(driver.control_socket)  # type: ignore[arg-type]
    try:
        return (await api.get("/"))["state"]
    finally:
        await api.aclose()


async def test_boot_snapshot_restore_with_real_firecracker(tmp_path: Path) -> None:
    kernel, template = firecracker_kernel(), template_rootfs("python")
    disk = tmp_path / "disk.ext4"
    await copy_sparse(template, disk)
    with tap_namespace() as ns:
        first = FirecrackerDriver()
        started = time.monotonic()
        await first.boot(_spec(tmp_path, "boot", kernel, disk, ns))
        try:
            wait_for_text(tmp_path / "boot" / "console.log", AGENT_MARKER, 60)
            agent_health(ns, 30)
            booted = time.monotonic() - started
            snap = await first.snapshot(tmp_path / "snap")
            assert await _state(first) == "Paused"
        finally:
            pid = first.pid
            await first.destroy()
        assert pid is not None and not pid_alive(pid)

        second = FirecrackerDriver()
        started = time.monotonic()
        await second.restore(snap, _spec(tmp_path, "wake", kernel, tmp_path / "wake.ext4", ns))
        try:
            assert await _state(second) == "Running"
            agent_health(ns, 30)
            woke = time.monotonic() - started
            await second.pause()
            await second.resume()
            agent_health(ns, 30)
        finally:
            pid = second.pid
            await second.destroy()
        assert pid is not None and not pid_alive(pid)
    print(f"cold boot to agent: {booted:.2f}s; restore to agent: {woke:.3f}s")
