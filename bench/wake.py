"""Wake-on-request benchmark.

1. The same work measured raw and through the gateway: raw = vmctl
   ``Machine.wake`` to agent-ready plus the first ``exec true`` (under TCG the
   first guest work after a restore re-translates code, so it is included on
   both sides); gateway = one ``execute`` request that wakes the sandbox.
   Ratio goal <= 1.05.
2. 200 concurrent requests (file reads) to a sleeping sandbox: restores
   counted, requests lost, p50/p99 latency.
3. Suspend duration and snapshot size on disk vs guest RAM.
4. Wake from PAUSED (``cont`` + clock fix) vs wake from a snapshot, A/B interleaved in one
   run, raw (``Machine.unpause`` vs ``Machine.wake``, each + first ``exec true``) and
   through the gateway (``X-AgentBox-Wake-Ms`` of the ``execute`` that woke it; the pause
   by the idle timer, the snapshot by ``POST /suspend``). Goal: pause p50 <= 20 ms and
   >= 10x faster than a snapshot. ``--only-pause`` runs just this part.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from _common import IMAGES_DIR, pct, private_daemon, report

from guest.protocol import ExecRequest
from images.catalog import load_template
from vmctl import network
from vmctl.backend import VMConfig, select
from vmctl.golden import ensure_golden
from vmctl.machine import Machine, MachinePlan

NET = network.NetworkConfig(pool="169.254.32.0/19")


async def raw_wakes(n: int) -> tuple[list[float], list[float], int, int, int, int]:
    image = load_template("python", IMAGES_DIR)
    backend = await select(VMConfig(network=NET), image.kernel)
    golden = await ensure_golden(image, backend)
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-wake-"))
    m = Machine(MachinePlan("wakebench", base / "m", network.slot_for(200, "wakebench", NET),
                            golden), backend)
    wakes, suspends = [], []
    try:
        await m.create()
        for _ in range(n):
            t = time.monotonic()
            await m.suspend()
            suspends.append((time.monotonic() - t) * 1000)
            t = time.monotonic()
            await m.wake()
            await m.require_agent().execute(ExecRequest(command="true"))
            wakes.append((time.monotonic() - t) * 1000)
        await m.suspend()
        disk = _du(m.plan.root)
        mem = _du(m.plan.root / "memory")
        state = (m.snapshot_dir / "vmstate").stat().st_size
    finally:
        await m.destroy()
        shutil.rmtree(base, ignore_errors=True)
    return wakes, suspends, disk, mem, state, image.mem_mib


async def raw_pause_vs_snapshot(rounds: int) -> tuple[list[float], list[float], list[float]]:
    """A/B interleaved on one VM: pause + unpause, then suspend + wake, each round (and an
    exec on the awake VM, the part of both figures that is not the wake)."""
    image = load_template("python", IMAGES_DIR)
    backend = await select(VMConfig(network=NET), image.kernel)
    golden = await ensure_golden(image, backend)
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-pause-"))
    m = Machine(MachinePlan("pausebench", base / "m", network.slot_for(201, "pausebench", NET),
                            golden), backend)
    paused, restored, awake = [], [], []
    try:
        await m.create()
        for _ in range(3):  # warm the exec path
            await m.require_agent().execute(ExecRequest(command="true"))
        for _ in range(rounds):
            t = time.monotonic()
            await m.require_agent().execute(ExecRequest(command="true"))
            awake.append((time.monotonic() - t) * 1000)
            await m.pause()
            await asyncio.sleep(0.2)
            t = time.monotonic()
            await m.unpause()
            await m.require_agent().execute(ExecRequest(command="true"))
            paused.append((time.monotonic() - t) * 1000)
            await m.suspend()
            t = time.monotonic()
            await m.wake()
            await m.require_agent().execute(ExecRequest(command="true"))
            restored.append((time.monotonic() - t) * 1000)
    finally:
        await m.destroy()
        shutil.rmtree(base, ignore_errors=True)
    return paused, restored, awake


def gateway_pause_vs_snapshot(d, rounds: int) -> tuple[list[float], list[float],
                                                       list[float], list[float]]:
    """A/B interleaved on one sandbox (idle_timeout 1 s): wait for the idle timer to pause
    it, wake it with an execute; then POST /suspend and wake it with an execute."""
    hdr_p, hdr_s, tot_p, tot_s = [], [], [], []
    with d.client() as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout": 1}).json()["id"]
        for _ in range(3):
            c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
        for _ in range(rounds):
            deadline = time.monotonic() + 30
            while c.get(f"/v1/sandboxes/{sid}").json()["state"] != "paused":
                assert time.monotonic() < deadline, "never paused"
                time.sleep(0.05)
            for hdrs, tots in ((hdr_p, tot_p), (hdr_s, tot_s)):
                t = time.monotonic()
                r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
                tots.append((time.monotonic() - t) * 1000)
                assert r.status_code == 200, r.text
                hdrs.append(float(r.headers.get("X-AgentBox-Wake-Ms", 0)))
                if hdrs is hdr_p:
                    c.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
        c.delete(f"/v1/sandboxes/{sid}")
    return hdr_p, hdr_s, tot_p, tot_s


def pause_section(rounds: int) -> None:
    paused, restored, awake = asyncio.run(raw_pause_vs_snapshot(rounds))
    report("raw: exec `true` on the awake VM", awake)
    a = report("raw: unpause + first exec `true`", paused)
    b = report("raw: wake from snapshot + first exec `true`", restored)
    print(f"raw snapshot / pause (p50): {b / a:.1f}x (goal >= 10x)")
    with private_daemon(("suspend_after_pause = 0", "suspend_after_pause = 600")) as d:
        hp, hs, tp, ts = gateway_pause_vs_snapshot(d, rounds)
    a = report("gateway: wake from pause (X-AgentBox-Wake-Ms)", hp)
    b = report("gateway: wake from snapshot (X-AgentBox-Wake-Ms)", hs)
    report("gateway: execute `true` that woke it from pause", tp)
    report("gateway: execute `true` that woke it from snapshot", ts)
    print(f"gateway snapshot / pause wake (p50): {b / a:.1f}x (goal >= 10x, pause <= 20 ms)")


def _du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", "--apparent-size", str(path)], capture_output=True,
                         text=True).stdout
    real = subprocess.run(["du", "-sB1", str(path)], capture_output=True, text=True).stdout
    return int(real.split()[0]) if real else int(out.split()[0])


def gateway_wakes(d, n: int) -> tuple[list[float], list[float], list[float]]:
    with d.client() as c:
        sid = c.post("/v1/sandboxes", json={}).json()["id"]
        awake, woken, headers = [], [], []
        for _ in range(5):
            c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
        for _ in range(n):
            t = time.monotonic()
            r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
            assert r.status_code == 200, r.text
            awake.append((time.monotonic() - t) * 1000)
            c.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
            t = time.monotonic()
            r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
            woken.append((time.monotonic() - t) * 1000)
            headers.append(float(r.headers["X-AgentBox-Wake-Ms"]))
        return awake, woken, headers


async def herd(d, n: int) -> tuple[list[float], int, int]:
    headers = {"Authorization": f"Bearer {d.admin_key}"}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=d.url, headers=headers, timeout=120,
                                 limits=limits) as c:
        sid = (await c.post("/v1/sandboxes", json={})).json()["id"]
        (await c.post(f"/v1/sandboxes/{sid}/suspend")).raise_for_status()

        async def one() -> float | None:
            t = time.monotonic()
            try:
                r = await c.get(f"/v1/sandboxes/{sid}/files/etc/hostname")
            except httpx.HTTPError:
                return None
            return (time.monotonic() - t) * 1000 if r.status_code == 200 else None

        results = await asyncio.gather(*(one() for _ in range(n)))
        restores = (await c.get(f"/v1/sandboxes/{sid}")).json()["restore_count"]
    ok = [r for r in results if r is not None]
    return ok, n - len(ok), restores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--herd", type=int, default=200)
    ap.add_argument("--pause-rounds", type=int, default=10)
    ap.add_argument("--only-pause", action="store_true")
    args = ap.parse_args()
    pause_section(args.pause_rounds)
    if args.only_pause:
        return
    wakes, suspends, disk, mem, state, mem_mib = asyncio.run(raw_wakes(args.n))
    raw = report("raw: Machine.wake + first exec `true`", wakes)
    report("suspend (snapshot + VMM exit)", suspends)
    with private_daemon() as d:
        awake, woken, hdr = gateway_wakes(d, args.n)
        report("exec `true`, sandbox awake", awake)
        through = report("gateway: execute `true` that woke the sandbox", woken)
        report("  of which wake (X-AgentBox-Wake-Ms header)", hdr)
        print(f"ratio gateway-triggered / raw (p50): {through / raw:.2f} (goal <= 1.05)")
        ok, lost, restores = asyncio.run(herd(d, args.herd))
        print(f"{args.herd} concurrent requests to a sleeping sandbox: restores={restores} "
              f"lost={lost} p50={statistics.median(ok):.0f} ms p99={pct(ok, 99):.0f} ms")
    print(f"suspended sandbox on disk: {disk / 2**20:.1f} MiB total "
          f"(memory file {mem / 2**20:.1f} MiB allocated, device state {state / 1024:.0f} KiB) "
          f"vs guest RAM {mem_mib} MiB")
    print(f"machine: {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
