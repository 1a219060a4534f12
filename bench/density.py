"""Density: N registered sandboxes (created, used, suspended, compacted) with K awake.

A private daemon (its own data dir and address pool, `vm.compact_after = 0`) creates N
sandboxes through the API, runs one command in each (it writes the sandbox's number to a
file) and suspends it, `--workers` at a time. Then it wakes K of them and keeps them awake,
and checks a sample of the sleeping ones answer with their own file. Prints disk per sandbox,
the host memory the awake ones take, and timings.

    .venv/bin/python bench/density.py -n 1000 --awake 50
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import IMAGES_DIR, REPO, report, start_daemon, stop_daemon

MIB = 1 << 20


def config(base: Path, n: int) -> Path:
    path = base / "density.toml"
    path.write_text(f"""
[server]
images_dir = "{IMAGES_DIR}"
[sandbox]
templates = ["python"]
idle_timeout = 0
max_sandboxes = {n + 50}
[vm]
compact_after = 0
[network]
pool = "169.254.192.0/19"
[pool]
size = 0
[tenancy]
max_sandboxes = 0
max_awake = 0
max_disk_mib = 0
rate = 0
address_rate = 0
""")
    return path


def du_mib(path: Path) -> float:
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable")


def ok(resp):
    if resp.status_code >= 300:
        raise RuntimeError(f"{resp.request.method} {resp.request.url}: {resp.status_code} "
                           f"{resp.text[:300]}")
    return resp.json()


def one(daemon, i: int) -> tuple[str, float]:
    with daemon.client() as c:
        t = time.monotonic()
        sid = ok(c.post("/v1/sandboxes", json={"template": "python", "metadata": {"n": i}}))["id"]
        ok(c.post(f"/v1/sandboxes/{sid}/execute", json={"command": f"echo {i} > /root/n"}))
        ok(c.post(f"/v1/sandboxes/{sid}/suspend"))
        return sid, (time.monotonic() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("--awake", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sample", type=int, default=20)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="agentbox-density-", dir="/var/tmp"))
    daemon = start_daemon(base / "data", config=config(base, args.n))
    sandboxes: dict[int, str] = {}
    try:
        mem_before = mem_available_mib()
        started = time.monotonic()
        cycle: list[float] = []
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            futures = {pool.submit(one, daemon, i): i for i in range(args.n)}
            for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                sid, ms = fut.result()
                sandboxes[futures[fut]] = sid
                cycle.append(ms)
                if done % 100 == 0 or done == args.n:
                    print(f"{done:5d} registered, {time.monotonic() - started:7.0f} s, data dir "
                          f"{du_mib(base / 'data'):8.0f} MiB", flush=True)
        time.sleep(5)  # the last compactions
        disk = du_mib(base / "data" / "sandboxes")
        report("create + execute + suspend, per sandbox", cycle)
        print(f"{args.n} suspended sandboxes: {disk:.0f} MiB on disk, "
              f"{disk / args.n:.1f} MiB each (compacted memory, disk layer, device state)")
        awake = random.Random(1).sample(sorted(sandboxes), args.awake)
        wakes = []
        with daemon.client() as c:
            for i in awake:
                t = time.monotonic()
                out = ok(c.post(f"/v1/sandboxes/{sandboxes[i]}/execute",
                                json={"command": "cat /root/n"}))
                wakes.append((time.monotonic() - t) * 1000)
                assert out["stdout"].strip() == str(i), out
            report(f"wake of {args.awake} (execute through the API)", wakes)
            used = mem_before - mem_available_mib()
            running = len(ok(c.get("/v1/sandboxes", params={"state": "running,paused",
                                                             "limit": 1000}))["sandboxes"])
            print(f"{running} awake: host memory in use +{used:.0f} MiB "
                  f"({used / max(running, 1):.0f} MiB each)")
            asleep = [i for i in sandboxes if i not in set(awake)]
            for i in random.Random(2).sample(asleep, min(args.sample, len(asleep))):
                out = ok(c.post(f"/v1/sandboxes/{sandboxes[i]}/execute",
                                json={"command": "cat /root/n"}))
                assert out["stdout"].strip() == str(i), out
            print(f"{args.sample} random sleeping sandboxes woke with their own file: ok")
            print(f"total {time.monotonic() - started:.0f} s; machine: "
                  f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} "
                  f"cores, repo {REPO}")
    finally:
        with daemon.client() as c:
            for sid in sandboxes.values():
                c.delete(f"/v1/sandboxes/{sid}")
        stop_daemon(daemon)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
