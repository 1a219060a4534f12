"""Routing cost in a fleet: a request to a real sandbox through a host that does not own it
vs the same request straight to its owner.

A fleet of real daemons (tests/cluster/fleet_env.py: one per host network namespace, real
etcd, SeaweedFS), one sandbox (TCG VM) on h0 running tests/e2e/preview_app.py. The client
(aiohttp, in the switch namespace) keeps one pooled keep-alive connection per target:

* direct - to h0, the owner
* via    - to h1, which forwards to h0 (gateway/preview/forward.py, its own pooled session)

Three cheap requests, each sequential (one in flight), measured as the client sees it:

* get     - ``GET /v1/sandboxes/{id}`` (the owner's registry, no guest in the path)
* exec    - ``POST /v1/sandboxes/{id}/execute`` of ``true`` (through the guest agent)
* preview - ``GET /count`` on ``8000-{id}.localhost`` (the preview proxy to the guest app)

Rounds interleave the targets (A/B then B/A), ``-n`` requests per target, kind and round
after a warm-up. Reports p50/p95 over all samples, per-round p50s (min-max), the ratio
via/direct of each round's p50s (median and min-max) and what the hop adds at p50.
``--fresh``: a new client connection per request instead (the figure test_routing.py
printed before: 2.1 vs 1.3 ms).

usage: .venv/bin/python bench/cluster.py [--rounds 6] [-n 40] [--kinds get,exec,preview]
       [--fresh]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from _common import REPO, pct

from tests.cluster.etcd_env import EtcdCluster, sweep_stale_namespaces
from tests.cluster.fleet_env import PORT, Fleet, running_fleet, skip_reason

APP = REPO / "tests" / "e2e" / "preview_app.py"
# The benchmark sends hundreds of requests a second with one key from one address.
NO_LIMITS = {"tenancy": {"rate": 1e6, "burst": 1_000_000, "address_rate": 0.0}}


def request_of(kind: str, sid: str, key: str, token: str) -> tuple[str, str, dict[str, str],
                                                                  Any]:
    auth = {"Authorization": f"Bearer {key}"}
    if kind == "get":
        return "GET", f"/v1/sandboxes/{sid}", auth, None
    if kind == "exec":
        return "POST", f"/v1/sandboxes/{sid}/execute", auth, {"command": "true"}
    if kind == "preview":
        return "GET", "/count", {"Host": f"8000-{sid}.localhost", "X-AgentBox-Token": token}, None
    raise ValueError(kind)


async def timed(session: aiohttp.ClientSession, base: str, req: tuple[str, str, dict[str, str],
                                                                      Any], n: int) -> list[float]:
    method, path, headers, body = req
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.request(method, base + path, headers=headers, json=body) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {path} via {base}: {resp.status} "
                                   f"{await resp.text()}")
        out.append((time.perf_counter() - t0) * 1000)
    return out


def prepare(fleet: Fleet) -> tuple[str, str]:
    sid = fleet.create_on("h0")
    api = fleet.client("h0")
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/preview_app.py"},
                content=APP.read_bytes())
    assert r.status_code == 201, r.text
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={
        "command": "python3 /root/preview_app.py 0.0.0.0 8000", "background": True})
    assert r.status_code == 201, r.text
    token = api.get(f"/v1/sandboxes/{sid}/preview").json()["preview_token"]
    fleet.wait_for(lambda: api.get("/count", headers={
        "Host": f"8000-{sid}.localhost", "X-AgentBox-Token": token}).status_code == 200, 60,
        "the guest app listens", every=0.3)
    return sid, token


async def run(fleet: Fleet, sid: str, token: str, kinds: list[str], rounds: int, n: int,
              fresh: bool) -> dict[str, dict[str, list[list[float]]]]:
    targets = {"direct": fleet.host("h0").url, "via": fleet.host("h1").url}
    sessions = {name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        limit=1, force_close=fresh)) for name in targets}
    samples: dict[str, dict[str, list[list[float]]]] = {
        k: {t: [] for t in targets} for k in kinds}
    try:
        for kind in kinds:  # warm-up: connections, the owner's pools, the guest
            req = request_of(kind, sid, fleet.admin_key, token)
            for name, base in targets.items():
                await timed(sessions[name], base, req, max(5, n // 4))
        for r in range(rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for kind in kinds:
                req = request_of(kind, sid, fleet.admin_key, token)
                for name in order:
                    samples[kind][name].append(await timed(sessions[name], targets[name],
                                                           req, n))
    finally:
        for s in sessions.values():
            await s.close()
    return samples


def show(samples: dict[str, dict[str, list[list[float]]]]) -> None:
    print(f"\n{'kind':<8} {'target':<7} {'n':>5} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'round p50s min-max':>20}")
    for kind, by_target in samples.items():
        for name, rounds in by_target.items():
            flat = [x for r in rounds for x in r]
            per = [statistics.median(r) for r in rounds]
            print(f"{kind:<8} {name:<7} {len(flat):>5} {statistics.median(flat):8.2f} "
                  f"{pct(flat, 95):8.2f} {min(per):9.2f} - {max(per):6.2f}")
    print(f"\n{'kind':<8} {'via/direct p50 (median of rounds, min-max)':<44} "
          f"{'added at p50':>12}")
    for kind, by_target in samples.items():
        ratios = [statistics.median(v) / statistics.median(d)
                  for v, d in zip(by_target["via"], by_target["direct"], strict=True)]
        added = [statistics.median(v) - statistics.median(d)
                 for v, d in zip(by_target["via"], by_target["direct"], strict=True)]
        print(f"{kind:<8} {statistics.median(ratios):5.2f}x ({min(ratios):.2f}-"
              f"{max(ratios):.2f}){'':<29} {statistics.median(added):9.2f} ms")


def owner_connections_from(fleet: Fleet, owner: str, via: str) -> int:
    """Established connections on the owner's gateway port whose peer is ``via``."""
    out = subprocess.run(["ip", "netns", "exec", fleet.host(owner).netns, "ss", "-Htn",
                          "state", "established", f"( sport = :{PORT} )"],
                         capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if f"{fleet.host(via).ip}:" in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-n", type=int, default=40, help="requests per target, kind and round")
    ap.add_argument("--kinds", default="get,exec,preview")
    ap.add_argument("--fresh", action="store_true", help="a new connection per request")
    args = ap.parse_args()
    reason = skip_reason()
    if reason:
        raise SystemExit(f"cannot run a fleet here: {reason}")
    kinds = args.kinds.split(",")
    sweep_stale_namespaces()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="abbench-") as tmp:
        etcd = EtcdCluster(Path(tmp) / "etcd")
        try:
            etcd.start()
            with running_fleet(etcd, Path(tmp) / "fleet", size=2, overrides=NO_LIMITS) as fleet:
                sid, token = prepare(fleet)
                samples = fleet.loop.run(run(fleet, sid, token, kinds, args.rounds, args.n,
                                             args.fresh), timeout=3600)
                pooled = owner_connections_from(fleet, "h0", "h1")
        finally:
            etcd.close()
    print(f"\nconnections: {'new per request' if args.fresh else 'pooled (keep-alive)'}; "
          f"{args.rounds} rounds x {args.n} per target and kind; load average "
          f"{load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print(f"TCP connections h1 -> h0:8080 open after the run (the forwarder's pool): {pooled}")
    show(samples)


if __name__ == "__main__":
    main()
