"""Compact memory snapshots: disk per suspended sandbox, and what a wake pays for it.

One sandbox (vmctl ``Machine``, no gateway) that ran a few commands; rounds alternate
A/B in one run: A = suspend, wake from the full memory file; B = suspend, compact the
memory to its diff from the golden (``store.compact_memory``, as ``vm.compact_after``
does in the daemon), wake (which rebuilds the file first). Each wake is timed to the
first ``exec true`` answered. Prints medians/spread and the disk figures.

    .venv/bin/python bench/compact.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import IMAGES_DIR, report

from guest.protocol import ExecRequest
from images.catalog import load_template
from vmctl import network, store
from vmctl.backend import VMConfig, select
from vmctl.golden import ensure_golden
from vmctl.machine import Machine, MachinePlan

NET = network.NetworkConfig(pool="169.254.4.0/22")
MIB = 1 << 20


def allocated(root: Path) -> int:
    """Bytes the sandbox's own files hold (each inode once, not the VM chroot's links)."""
    seen, total = set(), 0
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        st = path.lstat()
        if path.is_relative_to(root / "vm") and st.st_nlink > 1 or st.st_ino in seen:
            continue
        seen.add(st.st_ino)
        total += st.st_blocks * 512
    return total


async def main(rounds: int) -> None:
    image = load_template("python", IMAGES_DIR)
    backend = await select(VMConfig(network=NET, compact_after=-1), image.kernel)
    golden = await ensure_golden(image, backend)
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-compact-"))
    m = Machine(MachinePlan("compactbench", base / "m", network.slot_for(1, "cb", NET), golden),
                backend)
    wake = {"full": [], "compact": []}
    disk = {"full": [], "compact": []}
    compact_ms: list[float] = []
    try:
        await m.create()
        agent = m.require_agent()
        for cmd in ("echo hi > /root/a", "ls -la /", "python3 -c 'print(1)'", "pip --version"):
            await agent.execute(ExecRequest(command=cmd))
        for i in range(2 * rounds):
            kind = "compact" if i % 2 else "full"
            await m.suspend()
            await m._stop_seal()  # the seal would race the manual compaction below
            if kind == "compact":
                t = time.monotonic()
                await asyncio.to_thread(store.compact_memory, m.snapshot_dir,
                                        golden.snapshot.memory, threading.Event())
                compact_ms.append((time.monotonic() - t) * 1000)
            disk[kind].append(allocated(m.plan.root) / MIB)
            t = time.monotonic()
            await m.wake()
            await m.require_agent().execute(ExecRequest(command="true"))
            wake[kind].append((time.monotonic() - t) * 1000)
    finally:
        await m.destroy()
        shutil.rmtree(base, ignore_errors=True)
    print(f"backend: {backend.driver_name} accel={backend.accel.value}; "
          f"golden RAM {golden.mem_mib} MiB; {rounds} A/B rounds")
    full, comp = report("wake from full memory file", wake["full"]), \
        report("wake from compact snapshot (rebuild + restore)", wake["compact"])
    report("compaction (diff against the golden)", compact_ms)
    report("disk per suspended sandbox, full", disk["full"], "MiB")
    report("disk per suspended sandbox, compact", disk["compact"], "MiB")
    print(f"wake ratio compact/full (medians): {comp / full:.2f}; "
          f"spread full {statistics.pstdev(wake['full']):.0f} ms, "
          f"compact {statistics.pstdev(wake['compact']):.0f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    asyncio.run(main(parser.parse_args().rounds))
