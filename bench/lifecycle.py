"""Lifecycle benchmark: cold boot vs restore, create via API, exec overhead.

Prints p50/p95 for: cold boot to agent-ready (driver level), restore of a
golden snapshot to agent-ready (a sandbox create without the API), wake of a
suspended sandbox to agent-ready, create via the API, and the exec round trip
of `true` through the API minus the agent's own measured run time; then the
ratio cold boot / restore. Run: `make bench` or `.venv/bin/python bench/lifecycle.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import tempfile
import time
from pathlib import Path

from _common import IMAGES_DIR, private_daemon, report

from images.catalog import load_template
from vmctl import disks, network
from vmctl.agent_client import AgentClient
from vmctl.backend import VMConfig, select
from vmctl.golden import ensure_golden
from vmctl.machine import Machine, MachinePlan
from vmctl.spec import VMSpec

NET = network.NetworkConfig(pool="169.254.32.0/19")


async def cold_boots(image, backend, n: int) -> list[float]:
    out = []
    for i in range(n):
        with tempfile.TemporaryDirectory(prefix="agentbox-bench-cold-") as tmp:
            root = Path(tmp)
            slot = network.slot_for(i, f"benchcold{i}", NET)
            await disks.create_overlay(root / "disk.qcow2", image.rootfs, backing_format="raw")
            await network.create(slot, NET)
            driver = backend.new_driver()
            spec = VMSpec(vm_id=f"cold{i}", workdir=root / "vm", kernel=image.kernel,
                          initrd=image.initrd, cmdline=image.cmdline, disk=root / "disk.qcow2",
                          mem_file=root / "memory", mem_mib=image.mem_mib, netns=slot.netns,
                          vcpus=backend.config.vcpus, accel=backend.accel)
            agent = None
            try:
                t = time.monotonic()
                await driver.boot(spec)
                agent = AgentClient(slot.guest_addr)
                await agent.wait_ready(120)
                out.append((time.monotonic() - t) * 1000)
            finally:
                if agent:
                    await agent.aclose()
                await driver.destroy()
                await network.destroy(slot)
    return out


async def restores(golden, backend, n: int) -> tuple[list[float], list[float], list[float]]:
    creates, wakes, suspends = [], [], []
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-restore-"))
    try:
        for i in range(n):
            slot = network.slot_for(100 + i, f"benchrst{i}", NET)
            m = Machine(MachinePlan(f"rst{i}", base / f"m{i}", slot, golden), backend)
            try:
                t = time.monotonic()
                await m.create()
                creates.append((time.monotonic() - t) * 1000)
                t = time.monotonic()
                await m.suspend()
                suspends.append((time.monotonic() - t) * 1000)
                wakes.append(await m.wake())
            finally:
                await m.destroy()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return creates, wakes, suspends


def api_figures(n_create: int, n_exec: int) -> tuple[list[float], list[float]]:
    creates, overheads = [], []
    with private_daemon() as d, d.client() as c:
        ids = []
        for _ in range(n_create):
            t = time.monotonic()
            r = c.post("/v1/sandboxes", json={})
            creates.append((time.monotonic() - t) * 1000)
            r.raise_for_status()
            ids.append(r.json()["id"])
        sid = ids[0]
        for _ in range(5):  # warm the connection pools
            c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
        for _ in range(n_exec):
            t = time.monotonic()
            r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
            total = (time.monotonic() - t) * 1000
            overheads.append(total - r.json()["duration_ms"])
    return creates, overheads


async def driver_figures(n_cold: int, n_restore: int):
    image = load_template("python", IMAGES_DIR)
    if image is None:
        raise SystemExit("python template not built: run `make images`")
    backend = await select(VMConfig(network=NET), image.kernel)
    print(f"backend: {backend.driver_name}/{backend.accel.value} ({backend.reason})")
    golden = await ensure_golden(image, backend)
    cold = await cold_boots(image, backend, n_cold)
    creates, wakes, suspends = await restores(golden, backend, n_restore)
    return cold, creates, wakes, suspends


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cold", type=int, default=3)
    ap.add_argument("--restores", type=int, default=20)
    ap.add_argument("--api-creates", type=int, default=10)
    ap.add_argument("--execs", type=int, default=50)
    args = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, "
          f"{len(__import__('os').sched_getaffinity(0))} cpus, {platform.release()}")
    cold, creates, wakes, suspends = asyncio.run(driver_figures(args.cold, args.restores))
    cold_p50 = report("cold boot -> agent ready", cold)
    create_p50 = report("golden restore -> agent ready (create, no API)", creates)
    wake_p50 = report("suspended sandbox wake -> agent ready", wakes)
    report("suspend (snapshot + VMM exit)", suspends)
    api_creates, overheads = api_figures(args.api_creates, args.execs)
    report("create via API (POST /v1/sandboxes)", api_creates)
    report("exec `true` via API minus agent run time", overheads)
    print(f"ratio cold boot / golden restore (p50): {cold_p50 / create_p50:.1f}x")
    print(f"ratio cold boot / wake (p50):           {cold_p50 / wake_p50:.1f}x")


if __name__ == "__main__":
    main()
