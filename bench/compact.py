"""Compact snapshots (issue 12, part 4): what a suspended sandbox holds on disk, how much of
its memory file differs from the golden snapshot's, and what a wake costs with the identical
chunks punched out (``vmctl.compact``) and refilled before the VMM maps the file.

One raw VM (vmctl ``Machine``, no daemon): created, a few commands run, then rounds that
interleave A (suspend, wake as today) and B (suspend, compact, refill + wake). Sizes are
allocated blocks (``st_blocks``). Goal: <= 40 MiB per suspended sandbox, wake <= 1.2x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import IMAGES_DIR, report

from guest.protocol import ExecRequest
from images.catalog import load_template
from vmctl import compact, network
from vmctl.backend import VMConfig, select
from vmctl.golden import ensure_golden
from vmctl.machine import Machine, MachinePlan

NET = network.NetworkConfig(pool="169.254.32.0/19")
COMMANDS = ["echo hello > /root/a.txt", "ls -la / /root", "python3 -c 'print(sum(range(10**5)))'",
            "cat /etc/os-release", "df -h"]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def allocated(path: Path) -> int:
    if path.is_file():
        return os.stat(path).st_blocks * 512
    return sum(os.stat(p).st_blocks * 512 for p in path.rglob("*") if p.is_file())


async def run(rounds: int, root: Path | None) -> None:
    image = load_template("python", IMAGES_DIR)
    backend = await select(VMConfig(network=NET), image.kernel)
    golden = await ensure_golden(image, backend)
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-compact-", dir=root))
    m = Machine(MachinePlan("compactbench", base / "m", network.slot_for(202, "compactbench",
                                                                          NET), golden), backend)
    mem, gold = m.spec.mem_file, golden.snapshot.memory
    plain, compacted, refills, sizes = [], [], [], []
    try:
        await m.create()
        for cmd in COMMANDS:
            await m.require_agent().execute(ExecRequest(command=cmd))
        await m.suspend()
        await asyncio.sleep(1)
        total, memory = allocated(m.plan.root), allocated(mem)
        same = sum(b - a for a, b in compact.identical_ranges(mem, gold))
        same4k = sum(b - a for a, b in compact.identical_ranges(mem, gold, chunk=4096))
        print(f"suspended sandbox: {mib(total)} on disk, memory file {mib(memory)} allocated; "
              f"equal to the golden's: {mib(same)} (64 KiB chunks), {mib(same4k)} (4 KiB)")
        print(f"  -> compacted memory file: {mib(memory - same)} (64 KiB), "
              f"{mib(memory - same4k)} (4 KiB); golden memory {mib(allocated(gold))}")
        for _ in range(rounds):
            t = time.monotonic()
            await m.wake()
            plain.append((time.monotonic() - t) * 1000)
            await m.require_agent().execute(ExecRequest(command="true"))
            await m.suspend()
            await m._stop_seal()
            rf = m.snapshot_dir / compact.RANGES_FILE
            await asyncio.to_thread(compact.compact, mem, gold, rf)
            sizes.append(allocated(m.plan.root))
            t = time.monotonic()
            await asyncio.to_thread(compact.refill, mem, rf)
            refills.append((time.monotonic() - t) * 1000)
            # The refill rewrote the file: bring the manifest's size/mtime check up to date.
            _touch_manifest(m)
            await m.wake()
            compacted.append((time.monotonic() - t) * 1000)
            await m.require_agent().execute(ExecRequest(command="true"))
            await m.suspend()
    finally:
        await m.destroy()
        shutil.rmtree(base, ignore_errors=True)
    a = report("wake, memory file as today", plain)
    report("refill of the punched chunks", refills)
    b = report("refill + wake, compacted memory file", compacted)
    report("suspended sandbox on disk, compacted (MiB)", [s / 2**20 for s in sizes], "MiB")
    print(f"wake compacted / as today (p50): {b / a:.2f}x (goal <= 1.2x)")


def _touch_manifest(m: Machine) -> None:
    from vmctl import store

    snap, _ = store.load(m.snapshot_dir, verify=False)
    store.write_manifest(m.snapshot_dir, snap, hash_roles=m.backend.layout.suspend_hashed,
                         stat_roles=m.backend.layout.suspend_stat_checked)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", type=Path, default=None, help="where the VM's files go")
    args = ap.parse_args()
    asyncio.run(run(args.rounds, args.root))
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
