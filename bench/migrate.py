"""Live migration of a running sandbox between two Machines (vmctl/migrate.py): the pause
and the whole move, stop-and-copy (what QEMU 7.2 under TCG gets) vs live RAM copy.

Each round creates a sandbox from the cached python golden (2 vCPUs, 512 MiB) on "host A",
starts a ticker process (a timestamp every 10 ms) and a 4 MiB file, keeps network traffic
going through the guest (agent health every 10 ms), and moves it to "host B" (another
Backend: own data dir, cgroup parent and namespace prefix; the streams cross TCP on
loopback through both daemons' relays, as between hosts). Modes alternate. Per move:

- vCPUs stopped: the source's QMP ``STOP`` to the destination's ``RESUME`` (wall clock);
- agent re-initialised: ``STOP`` to the guest's clock set again on the destination;
- guest tick gap: the largest gap between the ticker's timestamps (its clock stands still
  while stopped and is set when it runs again, so the jump is the pause as it lived it);
- total: prepare (destination VMM up) + mirror + RAM + commit;
- whether the guest came up whole: the ticker still counting with its secret, the file's
  SHA-256, and the destination's VMM alive. Live copy under TCG before QEMU 9.0 is expected
  to fail some of these (vmctl/drivers/qemu.py, ``live_ram_safe``).

Run as root: ``.venv/bin/python bench/migrate.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import test_migrate as t
from vmctl import migrate
from vmctl.backend import Backend, VMConfig
from vmctl.network import NetworkConfig
from vmctl.spec import Accel


async def one(hosts: list[t.Host], index: int, live: bool) -> dict[str, float | bool]:
    a, b = hosts
    src, dst = a.machine(f"bm{index:04d}", 1 + 2 * (index % 100)), \
        b.machine(f"bm{index:04d}", 2 + 2 * (index % 100))
    try:
        await src.create()
        pid, digest = await t.start_workload(src)
        since = time.time()
        started = time.monotonic()
        incoming = await migrate.Incoming.open(dst, src.disk_bytes(), "127.0.0.1")
        traffic = asyncio.create_task(t.chatter(src))
        try:
            stats = await migrate.migrate(src, incoming, live=live)
        except Exception as exc:
            return {"ok": False, "error": str(exc)[:200]}  # type: ignore[dict-item]
        finally:
            traffic.cancel()
        total = (time.monotonic() - started) * 1000
        resumed = getattr(dst.driver, "resumed_at", None)
        stopped = (resumed - stats.stopped_at) * 1000 if resumed and stats.stopped_at else -1
        await asyncio.sleep(1.0)
        ok = dst.driver is not None and dst.driver.alive()
        gap = -1.0
        if ok:
            try:
                alive = (await t.sh(dst, f"kill -0 {pid} && echo alive", 30)).strip()
                same = (await t.sh(dst, "sha256sum /root/before.bin", 30)).split()[0] == digest
                _, consecutive, secrets, gap_s, _ = (await t.sh(
                    dst, f"python3 /root/check.py {since}", 30)).split()
                gap = float(gap_s)
                ok = alive == "alive" and same and consecutive == "True" and secrets == "1"
            except Exception:
                ok = False
        return {"ok": ok, "stopped_ms": stopped, "reinit_ms": stats.paused_ms or -1,
                "gap_ms": gap, "total_ms": total, "ram_mib": stats.ram_bytes / 2**20}
    finally:
        await src.destroy()
        await dst.destroy()


async def main(rounds: int) -> None:
    found = sorted(t.IMAGES_DIR.glob(f"python/*/{t.SHAPE}/manifest.json"))
    if not found:
        sys.exit(f"no cached python golden {t.SHAPE}")
    from vmctl.golden import load_golden_dir
    t.GOLDEN = load_golden_dir(found[-1].parent)
    base = Path(tempfile.mkdtemp(prefix="bench-migrate-", dir=t.IMAGES_DIR.parent))
    hosts = []
    for name in ("bma", "bmb"):
        cfg = VMConfig(vmm="qemu", accel="tcg", compact_after=-1, ram_spares=0,
                       network=NetworkConfig(pool=t.POOL, netns_prefix=f"{name}-"))
        (base / name).mkdir()
        hosts.append(t.Host(name, Backend("qemu", Accel.TCG, "bench", cfg).for_daemon(
            base / name), base / name))
    results: dict[str, list[dict]] = {"stop-and-copy": [], "live": []}
    try:
        for i in range(rounds):
            for mode in ("stop-and-copy", "live"):
                r = await one(hosts, 2 * i + (mode == "live"), live=mode == "live")
                results[mode].append(r)
                print(f"round {i} {mode}: {r}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    for mode, rows in results.items():
        good = [r for r in rows if r.get("ok")]
        print(f"{mode}: {len(good)}/{len(rows)} came up whole")
        for key in ("stopped_ms", "reinit_ms", "gap_ms", "total_ms", "ram_mib"):
            values = [float(r[key]) for r in good if float(r[key]) >= 0]
            if values:
                print(f"  {key:11s} median {statistics.median(values):8.0f}  "
                      f"min {min(values):8.0f}  max {max(values):8.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args().rounds))
