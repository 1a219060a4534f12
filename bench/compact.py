"""Compact memory snapshots and the early VMM start: what a wake pays, disk per sandbox.

One sandbox (vmctl ``Machine``, no gateway) that ran a few commands; each round runs five
wakes in one run, interleaved (the order alternates between rounds): whole and compact
snapshots, with ``vm.overlap_restore`` on (the VMM starts while the snapshot is rebuilt
and verified) or off, and for compact ones with a spare RAM file ready or not
(``vm.ram_spares``). whole = suspend, wake from the full memory file; compact = suspend,
compact the memory to its diff from the golden (``store.compact_memory``, as
``vm.compact_after`` does in the daemon, followed, for "spare", by the spare fill the
daemon does after it), wake (which rebuilds the file first). Each wake is timed to the first
``exec true`` answered, and to the moment QEMU is handed its device state (what the
overlap and the rebuild change, without the guest's noisy resume). Then a standby phase:
a QEMU started for the suspended sandbox and left waiting in ``-incoming defer`` (what a
pre-spawned VMM would be): its start time and its memory (RSS, PSS) while it waits.
Prints medians/spread and the disk figures.

    .venv/bin/python bench/compact.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import IMAGES_DIR, report

from gateway.sandbox.service import tree_bytes
from guest.protocol import ExecRequest
from images.catalog import load_template
from vmctl import network, ramspare, store
from vmctl.backend import VMConfig, select
from vmctl.drivers.qemu import QemuDriver
from vmctl.golden import ensure_golden
from vmctl.machine import Machine, MachinePlan
from vmctl.qmp import QMPClient

NET = network.NetworkConfig(pool="169.254.4.0/22")
MIB = 1 << 20
# (snapshot, vm.overlap_restore, a spare RAM file ready): five wakes per round.
KINDS = [("whole", True, False), ("whole", False, False), ("compact", True, True),
         ("compact", False, True), ("compact", True, False)]


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB."""
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status")
               if line.startswith("VmRSS:"))
    pss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup")
               if line.startswith("Pss:"))
    return rss, pss


class Timings:
    """The QEMU spawn (process start to QMP up), the snapshot work and, within it, the
    fsync of the rebuilt memory file, per wake."""

    def __init__(self, m: Machine) -> None:
        self.spawn: list[float] = []
        self.work: list[float] = []
        spawn, timings = QemuDriver._spawn, self

        async def timed_spawn(driver, *args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.monotonic()
            await spawn(driver, *args, **kwargs)
            timings.spawn.append((time.monotonic() - t) * 1000)

        QemuDriver._spawn = timed_spawn  # type: ignore[method-assign]
        self.incoming: list[float] = []  # when QEMU was handed the device state
        execute = QMPClient.execute

        async def noted(client, command, *args, **kwargs):  # type: ignore[no-untyped-def]
            if command == "migrate-incoming":
                timings.incoming.append(time.monotonic())
            return await execute(client, command, *args, **kwargs)

        QMPClient.execute = noted  # type: ignore[method-assign]
        ready = m._ready_snapshot

        def timed_ready(*args):  # type: ignore[no-untyped-def]
            t = time.monotonic()
            try:
                return ready(*args)
            finally:
                timings.work.append((time.monotonic() - t) * 1000)

        m._ready_snapshot = timed_ready  # type: ignore[method-assign]
        self.fsync: list[float] = []
        fsync = store._fsync

        def timed_fsync(path: Path) -> None:
            t = time.monotonic()
            fsync(path)
            if path.name == "memory":  # the rebuilt RAM file made durable
                timings.fsync.append((time.monotonic() - t) * 1000)

        store._fsync = timed_fsync


async def standby(m: Machine, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """Start a QEMU for the suspended sandbox, let it wait for its state, measure, kill."""
    start_ms, rss, pss = [], [], []

    class Measured(Exception):
        pass

    async def measure(driver, t: float):  # type: ignore[no-untyped-def]
        start_ms.append((time.monotonic() - t) * 1000)
        await asyncio.sleep(1.0)  # settled, as a standby VMM would be
        kib = memory_kib(driver.pid)
        rss.append(kib[0] / 1024)
        pss.append(kib[1] / 1024)
        raise Measured

    for _ in range(rounds):
        driver, t = m.backend.new_driver(), time.monotonic()
        try:
            await driver.restore_when_ready(m.spec, lambda d=driver, t=t: measure(d, t))
        except Exception as exc:
            assert isinstance(exc.__cause__, Measured), exc
        assert driver.pid is None
    return start_ms, rss, pss


async def main(rounds: int) -> None:
    image = load_template("python", IMAGES_DIR)
    backend = await select(VMConfig(network=NET, compact_after=-1), image.kernel)
    golden = await ensure_golden(image, backend)
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-compact-"))
    m = Machine(MachinePlan("compactbench", base / "m", network.slot_for(1, "cb", NET), golden),
                backend)
    timings = Timings(m)
    wake = {k: [] for k in KINDS}
    spawn = {k: [] for k in KINDS}
    to_load = {k: [] for k in KINDS}  # wake start -> device state handed to QEMU
    work = {k: [] for k in KINDS}
    disk = {"whole": [], "compact": []}
    compact_ms: list[float] = []
    fsync: dict[bool, list[float]] = {True: [], False: []}
    fill_ms: list[float] = []
    spares = m.plan.root.parent / ramspare.SPARES_DIR
    try:
        await m.create()
        agent = m.require_agent()
        for cmd in ("echo hi > /root/a", "ls -la /", "python3 -c 'print(1)'", "pip --version"):
            await agent.execute(ExecRequest(command=cmd))
        for r in range(rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                snapshot, overlap, spare = kind
                await m.suspend()
                await m._stop_seal()  # the seal would race the manual compaction below
                if snapshot == "compact":
                    t = time.monotonic()
                    await asyncio.to_thread(store.compact_memory, m.snapshot_dir,
                                            golden.snapshot.memory, threading.Event())
                    compact_ms.append((time.monotonic() - t) * 1000)
                    disk[snapshot].append(tree_bytes(m.plan.root) / MIB)
                    if spare:  # what the daemon does after a compaction, in the background
                        t = time.monotonic()
                        if await asyncio.to_thread(ramspare.fill, spares, golden.snapshot.memory,
                                                   1):
                            fill_ms.append((time.monotonic() - t) * 1000)
                else:
                    disk[snapshot].append(tree_bytes(m.plan.root) / MIB)
                m.backend = dataclasses.replace(backend, config=dataclasses.replace(
                    backend.config, overlap_restore=overlap, ram_spares=int(spare)))
                t = time.monotonic()
                await m.wake()
                await m.require_agent().execute(ExecRequest(command="true"))
                wake[kind].append((time.monotonic() - t) * 1000)
                to_load[kind].append((timings.incoming.pop() - t) * 1000)
                spawn[kind].append(timings.spawn.pop())
                work[kind].append(timings.work.pop())
                if snapshot == "compact":
                    fsync[spare].append(timings.fsync.pop())
        await m.suspend()
        await m._stop_seal()
        standby_ms, rss, pss = await standby(m, rounds)
    finally:
        await m.destroy()
        shutil.rmtree(base, ignore_errors=True)
    print(f"backend: {backend.driver_name} accel={backend.accel.value}; "
          f"golden RAM {golden.mem_mib} MiB; {rounds} rounds of {len(KINDS)} interleaved wakes")
    med = {}
    for kind in KINDS:
        med[kind] = report(f"wake, {label(kind)}", wake[kind])
    load_med = {k: report(f"  to the state load, {label(k)}", to_load[k]) for k in KINDS}
    for kind in KINDS:
        report(f"  QEMU spawn, {label(kind)}", spawn[kind])
    for kind in KINDS:
        report(f"  snapshot work, {label(kind)}", work[kind])
    report("  of which fsync of the rebuilt file, spare", fsync[True])
    report("  of which fsync of the rebuilt file, no spare", fsync[False])
    report("compaction (diff against the golden)", compact_ms)
    report("spare RAM file made (background, after it)", fill_ms)
    report("disk per suspended sandbox, whole", disk["whole"], "MiB")
    report("disk per suspended sandbox, compact", disk["compact"], "MiB")
    report("standby QEMU: start to waiting (-incoming defer)", standby_ms)
    report("standby QEMU: RSS while waiting", rss, "MiB")
    report("standby QEMU: PSS while waiting", pss, "MiB")
    for snap, spare in (("whole", False), ("compact", True)):
        on, off = med[(snap, True, spare)], med[(snap, False, spare)]
        lon, loff = load_med[(snap, True, spare)], load_med[(snap, False, spare)]
        print(f"{snap}: overlap saves {off - on:.0f} ms of {off:.0f} ms of the wake "
              f"({(off - on) / off:.0%}), {loff - lon:.0f} ms of the {loff:.0f} ms to the "
              "state load (medians)")
    whole = med[("whole", True, False)]
    for kind in KINDS[2:]:
        print(f"wake ratio compact/whole ({label(kind)} / whole, overlap; medians): "
              f"{med[kind] / whole:.2f}")
    print("spread (pstdev): " + ", ".join(
        f"{label(k)} {statistics.pstdev(wake[k]):.0f} ms" for k in KINDS))


def label(kind: tuple[str, bool, bool]) -> str:
    snapshot, overlap, spare = kind
    return f"{snapshot}, {'overlap' if overlap else 'sequential'}" + (
        (", spare" if spare else ", no spare") if snapshot == "compact" else "")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    asyncio.run(main(parser.parse_args().rounds))
