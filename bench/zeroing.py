"""What zeroing freed guest pages (kernel ``init_on_free=1``) saves on disk and costs in time.

A page the guest frees keeps its old bytes unless the kernel zeroes it, so a compact
snapshot (``vmctl.memdiff``: the pages that differ from the golden) of a sandbox that ran a
few commands mostly stores *free* memory: the garbage that processes left behind. With
``init_on_free=1`` (images/inputs.py ``CMDLINE``) freed pages are zero, as the never-used
pages of the golden are, so they drop out of the diff. Under TCG the zeroing is cheap only
without ERMS (``vmctl.drivers.qemu.TCG_CPU``), so that is measured too.

Three arms in one run, each a golden of the ``python`` image: **default** (zeroed, TCG CPU
without ERMS), **zeroed, erms** (``-cpu max``) and **neither** (the settings before both;
built in temp dirs). Each round, for each arm (order rotated):
restore a sandbox from its golden (timed to agent ready), 10 ``exec true``,
10 back-to-back ``execute("print(1)")`` and 10 ``run_code("1+1")`` (the zygote and the warm
interpreter, where the kernel frees and zeroes pages), then the four commands
``bench/compact.py`` runs, suspend, compact (timed; disk after it), fill the spare RAM file
as the daemon does, wake (timed to the first ``exec true``), destroy.

    .venv/bin/python bench/zeroing.py [--rounds 5]
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

import vmctl.drivers.qemu as qemu

from _common import IMAGES_DIR, report

from gateway.sandbox.service import tree_bytes
from guest.protocol import ExecRequest, RunCodeRequest
from images.catalog import load_template
from vmctl import agent_interp, network, ramspare, store
from vmctl.backend import VMConfig, select
from vmctl.golden import ensure_golden
from vmctl.machine import Machine, MachinePlan

NET = network.NetworkConfig(pool="169.254.4.0/22")
MIB = 1 << 20
FLAG = "init_on_free=1"
ERMS_ROOTS: list[Path] = []  # machines and goldens under these boot with ERMS (-cpu max)


def _with_erms(argv_of):  # type: ignore[no-untyped-def]
    def argv(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = argv_of(spec, *args, **kwargs)
        if any(Path(spec.mem_file).is_relative_to(r) for r in ERMS_ROOTS):
            out[out.index(qemu.TCG_CPU)] = "max"
        return out
    return argv


qemu.qemu_argv = _with_erms(qemu.qemu_argv)
COMMANDS = ("echo hi > /root/a", "ls -la /", "python3 -c 'print(1)'", "pip --version")


async def timed(n: int, call) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t = time.monotonic()
        res = await call()
        out.append((time.monotonic() - t) * 1000)
        assert getattr(res, "exit_code", 0) == 0, res
    return out


async def one_round(arm: str, golden, backend, base: Path, slot: int,  # type: ignore[no-untyped-def]
                    figures: dict[str, list[float]]) -> None:
    root = base / arm / f"m{slot}"
    m = Machine(MachinePlan(f"zero{arm}{slot}", root, network.slot_for(slot, f"z{arm}", NET),
                            golden), backend)
    try:
        t = time.monotonic()
        await m.create()
        figures["create"].append((time.monotonic() - t) * 1000)
        agent = m.require_agent()
        figures["exec true"] += await timed(10, lambda: agent.execute(ExecRequest(command="true")))
        figures["execute print(1)"] += await timed(
            10, lambda: agent.execute(ExecRequest(code="print(1)")))
        figures["run_code 1+1"] += await timed(
            10, lambda: agent_interp.run_code(agent, RunCodeRequest(code="1+1")))
        for cmd in COMMANDS:
            await agent.execute(ExecRequest(command=cmd))
        await m.suspend()
        await m._stop_seal()
        t = time.monotonic()
        await asyncio.to_thread(store.compact_memory, m.snapshot_dir, golden.snapshot.memory,
                                threading.Event())
        figures["compaction"].append((time.monotonic() - t) * 1000)
        figures["disk"].append(tree_bytes(m.plan.root) / MIB)
        await asyncio.to_thread(ramspare.fill, m.spares_dir, golden.snapshot.memory, 1)
        t = time.monotonic()
        await m.wake()
        await m.require_agent().execute(ExecRequest(command="true"))
        figures["compact wake"].append((time.monotonic() - t) * 1000)
    finally:
        await m.destroy()


async def main(rounds: int) -> None:
    image = load_template("python", IMAGES_DIR)
    if FLAG not in image.cmdline.split():
        raise SystemExit(f"the python image's cmdline has no {FLAG}: {image.cmdline}")
    backend = await select(VMConfig(network=NET, compact_after=-1), image.kernel)
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-bench-zeroing-"))
    try:
        without = dataclasses.replace(image, dir=tmp / "neither" / "image", cmdline=" ".join(
            a for a in image.cmdline.split() if a != FLAG))
        erms = dataclasses.replace(image, dir=tmp / "zeroederms" / "image")
        for d in (without.dir, erms.dir):
            d.mkdir(parents=True)
        ERMS_ROOTS.extend([tmp / "neither", tmp / "zeroederms"])
        goldens = {"default": await ensure_golden(image, backend),
                   "zeroed erms": await ensure_golden(erms, backend),
                   "neither": await ensure_golden(without, backend)}
        figures = {arm: {k: [] for k in ("create", "exec true", "execute print(1)",
                                         "run_code 1+1", "compaction", "disk", "compact wake")}
                   for arm in goldens}
        arms = list(goldens)
        for r in range(rounds):
            for arm in arms[r % 3:] + arms[:r % 3]:
                await one_round(arm.replace(" ", ""), goldens[arm], backend, tmp,
                                1 + arms.index(arm), figures[arm])
            print(f"round {r + 1}/{rounds} done", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"backend: {backend.driver_name} accel={backend.accel.value}; {rounds} rounds, "
          "arms interleaved")
    med: dict[tuple[str, str], float] = {}
    for name in figures[arms[0]]:
        for arm in arms:
            unit = "MiB" if name == "disk" else "ms"
            med[arm, name] = report(f"{name}, {arm}", figures[arm][name], unit)
    for name in figures[arms[0]]:
        print(f"ratios to 'neither', {name} (medians): default "
              f"{med['default', name] / med['neither', name]:.2f}, zeroed erms "
              f"{med['zeroed erms', name] / med['neither', name]:.2f}")
    print("spread (pstdev): " + ", ".join(
        f"{name} {arm} {statistics.pstdev(figures[arm][name]):.1f}"
        for name in ("create", "execute print(1)", "compact wake") for arm in arms))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args().rounds))
