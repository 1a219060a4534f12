"""A dead host's suspended sandboxes answering from another host: the phases, from the kill.

Each round starts a real 3-member etcd and a fleet of 3 real daemons (tests/cluster/
fleet_env.py: one per host network namespace, real SeaweedFS, real TCG VMs) with a short
lease TTL and reaper grace (``--ttl``, ``--reap-after``). On h0: ``-n`` python sandboxes,
each with a file of random bytes (``--file-kib``), suspended; we wait until each etcd record
names its uploaded snapshot. Then h0's daemon and VMMs are SIGKILLed (``Fleet.kill``: a host
losing power; its etcd member lives on, as in fleet_env) and, from the kill, we poll:

* gone     - h0's host record no longer in etcd (its lease expired: ~TTL)
* moved    - the sandbox's record names another host (the reaper, ``reap_after`` after the
             leader saw h0 gone, at its next pass: on the delete or every 3 s)
* fetch    - the new host's ``.adopt-{id}.fetching`` directory seen / renamed (file polled
             every 20 ms: the download and its SHA256 checks)
* adopted  - ``GET /v1/sandboxes/{id}`` on the record's host answers 200 (fetch, rewrite,
             slot, namespace, registered SUSPENDED)
* answered - an ``execute`` of ``sha256sum`` of the file, sent in turn through h1 and h2
             once the sandbox is adopted, answers 200 with the file's digest (the wake;
             ``X-AgentBox-Wake-Ms`` is the daemon's own wake figure)

Each sandbox is polled by its own thread (every 50 ms). Snapshot sizes come from the shipped
indexes in the object store. The config waits (TTL, reap_after) are additive, so what the
defaults (lease_ttl 5, reap_after 60) give is computed, not measured.

usage: .venv/bin/python bench/failover.py [--rounds 2] [-n 3] [--ttl 2] [--reap-after 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import REPO  # noqa: F401  (puts the repo on sys.path)

from tests.cluster.etcd_env import EtcdCluster, sweep_stale_namespaces
from tests.cluster.fleet_env import BUCKET, Fleet, Host, skip_reason

DEFAULT_TTL, DEFAULT_REAP_AFTER, PASS_EVERY = 5, 60, 3.0
POLL = 0.05


class FailoverFleet(Fleet):
    reap_after: float = 3.0

    def config_for(self, host: Host) -> dict[str, dict[str, Any]]:
        config = super().config_for(host)
        config["cluster"]["reap_after"] = self.reap_after
        return config


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def shipped_sizes(fleet: Fleet, location: str) -> dict[str, int]:
    from gateway.cluster.objstore import ObjectStore
    from gateway.cluster.shipping import INDEX, Index, parse_location
    from tests.cluster.weed_env import CREDS

    async def read() -> dict[str, int]:
        store = ObjectStore(fleet.objstore_endpoint, BUCKET, CREDS, timeout=10)
        try:
            prefix, _ = parse_location(location)
            index = Index.decode(await store.get_bytes(f"{prefix}/{INDEX}", 1 << 20))
            return {f.name: f.size for f in index.files}
        finally:
            await store.aclose()
    return fleet.loop.run(read(), timeout=30)


def reaper_leader(fleet: Fleet) -> str:
    """The live host whose log most recently said it leads the reaper ('' if none)."""
    latest, name = "", ""
    for h in fleet.hosts:
        if not h.alive() or not h.log_path.exists():
            continue
        text = h.log_path.read_text(errors="replace")
        text = text[text.rfind("===== start"):]
        for line in text.splitlines():
            if f"reaper: {h.name} leads" in line and line[:23] >= latest:
                latest, name = line[:23], h.name
    return name


def host_loads(fleet: Fleet) -> str:
    """Each live host's published load (what the reaper's placement reads)."""
    from gateway.cluster.etcd import EtcdClient
    from gateway.cluster.keys import Keys
    from gateway.cluster.records import HostRecord

    async def read() -> str:
        client = EtcdClient(fleet.etcd.endpoints, attempt_timeout=0.5)
        try:
            out = []
            for h in fleet.hosts:
                kv = await client.get(Keys(f"/{fleet.prefix}").host(h.name))
                if kv is not None:
                    r = HostRecord.decode(kv.value)
                    out.append(f"{h.name} free {r.free_mib} MiB / {r.free_vcpus} of "
                               f"{r.total_vcpus} vCPUs")
            return "; ".join(out)
        finally:
            await client.aclose()
    return fleet.loop.run(read(), timeout=30)


def prepare(fleet: Fleet, n: int, file_kib: int) -> list[dict[str, Any]]:
    api = fleet.client("h0")
    boxes = []
    for _ in range(n):
        began = time.monotonic()
        sid = fleet.create_on("h0")
        payload = os.urandom(file_kib * 1024)
        r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/kept.bin"},
                    content=payload)
        assert r.status_code == 201, r.text
        r = api.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
        boxes.append({"id": sid, "digest": hashlib.sha256(payload).hexdigest(),
                      "suspended_at": time.monotonic(),
                      "create_suspend_s": time.monotonic() - began})
        print(f"  {sid}: created, {file_kib} KiB written, suspended in "
              f"{boxes[-1]['create_suspend_s']:.1f} s", flush=True)
    for box in boxes:
        found: list[Any] = []
        fleet.wait_for(lambda b=box, f=found: bool(f.append(fleet.record(b["id"]))
                                                   or (f[-1] and f[-1].snapshot)),
                       180, f"{box['id']}'s snapshot named in its record", every=0.2)
        box["location"] = found[-1].snapshot
        box["gen"] = found[-1].gen
        box["shape"] = f"{found[-1].memory_mib} MiB / {found[-1].vcpus} vCPUs"
        box["named_after_suspend_s"] = time.monotonic() - box["suspended_at"]
        box["sizes"] = shipped_sizes(fleet, box["location"])
        print(f"  {box['id']}: snapshot named {box['named_after_suspend_s']:.1f} s after its "
              f"suspend, {sum(box['sizes'].values()) / 2**20:.1f} MiB in "
              f"{len(box['sizes'])} files; shape {box['shape']}", flush=True)
    return boxes


def watch_fetch(fleet: Fleet, box: dict[str, Any], t0: float, stop: threading.Event) -> None:
    """When the ``.fetching`` dir of ``box`` appears and goes on any surviving host."""
    paths = [h.data_dir / "sandboxes" / f".adopt-{box['id']}.fetching" for h in fleet.hosts[1:]]
    while not stop.is_set():
        seen = any(p.exists() for p in paths)
        now = time.monotonic() - t0
        if seen and "fetch_start" not in box:
            box["fetch_start"] = now
        if not seen and "fetch_start" in box and "fetch_end" not in box:
            box["fetch_end"] = now
            return
        time.sleep(0.02)


def follow(fleet: Fleet, box: dict[str, Any], t0: float, deadline: float) -> None:
    """Poll one sandbox from the kill until it answers (or ``deadline``)."""
    clients = {h.name: fleet.client(h, timeout=120) for h in fleet.hosts[1:]}
    turn, refusals = 0, 0
    while time.monotonic() < deadline:
        now = time.monotonic() - t0
        try:
            if "moved" not in box:
                rec = fleet.record(box["id"])
                if rec is not None and rec.host != "h0":
                    box["moved"], box["to"] = now, rec.host
                    box["moved_gen"], box["moved_state"] = rec.gen, rec.state.value
            elif "adopted" not in box:
                r = clients[box["to"]].get(f"/v1/sandboxes/{box['id']}")
                if r.status_code == 200:
                    box["adopted"], box["adopted_state"] = now, r.json()["state"]
            else:
                via = list(clients)[turn % len(clients)]
                turn += 1
                sent = time.monotonic()
                r = clients[via].post(f"/v1/sandboxes/{box['id']}/execute",
                                      json={"command": "sha256sum /root/kept.bin"})
                if r.status_code == 200:
                    box["answered"], box["via"] = time.monotonic() - t0, via
                    box["exec_s"] = time.monotonic() - sent
                    box["wake_ms"] = float(r.headers.get("X-AgentBox-Wake-Ms", "-1"))
                    box["intact"] = r.json()["stdout"].split()[:1] == [box["digest"]]
                    box["refusals"] = refusals
                    return
                refusals += 1
                box.setdefault("first_refusal", f"{r.status_code} {r.text[:160]}")
        except Exception as exc:
            box.setdefault("poll_errors", []).append(f"{now:.2f}: {exc!r}"[:200])
        time.sleep(POLL)


def one_round(index: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    etcd = EtcdCluster(tmp / f"etcd{index}")
    fleet: FailoverFleet | None = None
    out: dict[str, Any] = {"load_start": load()}
    try:
        etcd.start()
        fleet = FailoverFleet(etcd, tmp / f"fleet{index}", size=3, ttl=args.ttl)
        fleet.reap_after = args.reap_after
        out["fleet_up_s"] = fleet.start()
        print(f"round {index}: 3 daemons + SeaweedFS up in {out['fleet_up_s']:.1f} s, "
              f"load {load()}", flush=True)
        boxes = prepare(fleet, args.n, args.file_kib)
        h0 = fleet.host("h0")
        out["leader_before"] = reaper_leader(fleet)
        print(f"  hosts as published: {host_loads(fleet)}", flush=True)
        out["load_kill"] = load()
        stop = threading.Event()
        t0 = time.monotonic()
        vmms = fleet.kill(h0)
        out["killed_s"] = time.monotonic() - t0
        out["vmms_killed"] = len(vmms)
        deadline = t0 + args.timeout
        threads = [threading.Thread(target=follow, args=(fleet, b, t0, deadline))
                   for b in boxes]
        threads += [threading.Thread(target=watch_fetch, args=(fleet, b, t0, stop), daemon=True)
                    for b in boxes]
        for t in threads:
            t.start()
        while time.monotonic() < deadline:
            if not fleet.host_record(h0):
                out["gone"] = time.monotonic() - t0
                break
            time.sleep(POLL)
        for t in threads[:len(boxes)]:
            t.join()
        stop.set()
        out["leader_after"] = reaper_leader(fleet)
        out["load_end"] = load()
        out["boxes"] = boxes
        for b in boxes:
            print(f"  {b['id']}: " + ", ".join(
                f"{k} {b[k]:.2f}" if isinstance(b.get(k), float) else f"{k} {b.get(k)}"
                for k in ("moved", "to", "moved_state", "fetch_start", "fetch_end", "adopted",
                          "answered", "via", "wake_ms", "intact", "refusals")), flush=True)
            if b.get("first_refusal"):
                print(f"    first refusal: {b['first_refusal']}")
            if b.get("poll_errors"):
                print(f"    poll errors: {b['poll_errors'][:3]}")
        print(f"  h0 killed ({out['vmms_killed']} VMMs) in {out['killed_s']:.2f} s; "
              f"its record gone {out.get('gone', float('nan')):.2f} s; reaper led by "
              f"{out['leader_before'] or '?'} before the kill, {out['leader_after'] or '?'} "
              f"after; load at kill {out['load_kill']}, at end {out['load_end']}", flush=True)
    except BaseException:
        if fleet is not None:
            print(fleet.logs(6000))
        raise
    finally:
        if fleet is not None:
            left = fleet.close()
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for h in fleet.hosts:
                    if h.log_path.exists():
                        shutil.copy(h.log_path, args.keep_logs / f"round{index}-{h.name}.log")
            if left:  # h0 was killed and not restarted: its sandboxes' namespaces stay
                print(f"  swept at the end (fleet.close): {left}")
        etcd.close()
    return out


def spread(values: list[float], unit: str = "s", fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return (f"{fmt.format(statistics.median(values))} {unit} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))}, n={len(values)})")


def summary(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    boxes = [b for r in rounds for b in r.get("boxes", [])]
    done = [b for b in boxes if "answered" in b]
    print(f"\n{len(done)}/{len(boxes)} sandboxes answered from another host "
          f"({sum(bool(b.get('intact')) for b in done)} with the file intact); "
          f"lease_ttl {args.ttl} s, reap_after {args.reap_after} s, {len(rounds)} rounds")
    gone = [r["gone"] for r in rounds if "gone" in r]
    moved_ok = sum(b.get("moved_state") == "suspended" and b.get("moved_gen") == b["gen"] + 1
                   for b in boxes)
    print(f"{moved_ok}/{len(boxes)} records moved SUSPENDED with gen + 1")

    def col(key: str) -> list[float]:
        return [b[key] for b in boxes if isinstance(b.get(key), float)]
    moved_after_gone = [b["moved"] - r["gone"] for r in rounds for b in r.get("boxes", [])
                        if "moved" in b and "gone" in r]
    adopt = [b["adopted"] - b["moved"] for b in boxes if "adopted" in b and "moved" in b]
    answer = [b["answered"] - b["adopted"] for b in boxes if "answered" in b and "adopted" in b]
    fetch = [b["fetch_end"] - b["fetch_start"] for b in boxes
             if "fetch_end" in b and "fetch_start" in b]
    print("from the kill (median (min-max)):")
    print(f"  h0's record gone (lease TTL)            {spread(gone)}")
    print(f"  record moved by the reaper              {spread(col('moved'))}")
    print(f"    of which after the record went       {spread(moved_after_gone)}")
    print(f"  adopted on its new host                 {spread(col('adopted'))}")
    print(f"    of which after the move              {spread(adopt)}")
    print(f"    of which the fetch (.fetching seen)  {spread(fetch)}")
    print(f"  first answer (execute through h1/h2)    {spread(col('answered'))}")
    print(f"    of which after adoption              {spread(answer)}")
    print(f"    the daemon's wake (X-AgentBox-Wake-Ms) {spread(col('wake_ms'), 'ms', '{:.0f}')}")
    sizes = [sum(b["sizes"].values()) for b in boxes if b.get("sizes")]
    if sizes:
        files: dict[str, list[int]] = {}
        for b in boxes:
            for name, size in b.get("sizes", {}).items():
                files.setdefault(name, []).append(size)
        print(f"snapshot shipped per sandbox: {spread([s / 2**20 for s in sizes], 'MiB', '{:.1f}')}"
              f" = {statistics.median(sizes)} bytes median")
        for name, v in sorted(files.items(), key=lambda kv: -max(kv[1])):
            print(f"  {name:<24} {statistics.median(v):>12.0f} bytes (median)")
        rates = [sum(b["sizes"].values()) / 2**20 / (b["fetch_end"] - b["fetch_start"])
                 for b in boxes if b.get("sizes") and "fetch_end" in b and "fetch_start" in b
                 and b["fetch_end"] > b["fetch_start"]]
        whole = [sum(b["sizes"].values()) / 2**20 / (b["adopted"] - b["moved"])
                 for b in boxes if b.get("sizes") and "adopted" in b and "moved" in b]
        print(f"fetch throughput (bytes / .fetching window): {spread(rates, 'MiB/s', '{:.1f}')}")
        print(f"bytes / (adopted - moved), whole adoption:   {spread(whole, 'MiB/s', '{:.1f}')}")
    named = col("named_after_suspend_s")
    print(f"suspend -> snapshot named in the record (before the kill): {spread(named)}")
    if col("answered") and gone:
        med = statistics.median(col("answered"))
        waits = args.ttl + args.reap_after
        rest = med - waits
        print(f"\nwith the defaults (lease_ttl {DEFAULT_TTL}, reap_after {DEFAULT_REAP_AFTER}), "
              f"arithmetic, not measured: the config waits are additive, so the median first "
              f"answer {med:.1f} s = {waits:g} s of waits (TTL {args.ttl} + reap_after "
              f"{args.reap_after:g}) + {rest:.1f} s of the rest (lease slack, reaper pass, "
              f"adoption, wake) becomes ~{DEFAULT_TTL} + {DEFAULT_REAP_AFTER} + {rest:.1f} = "
              f"{DEFAULT_TTL + DEFAULT_REAP_AFTER + rest:.1f} s (the reaper's pass every "
              f"{PASS_EVERY:g} s can add up to {PASS_EVERY:g} s more or less of it)")
    print("load (1/5/15 min): " + "; ".join(
        f"round {i}: start {r.get('load_start')}, kill {r.get('load_kill')}, end "
        f"{r.get('load_end')}" for i, r in enumerate(rounds)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=3, help="suspended sandboxes on h0")
    ap.add_argument("--ttl", type=int, default=2, help="lease_ttl (s)")
    ap.add_argument("--reap-after", type=float, default=3.0, help="reap_after (s)")
    ap.add_argument("--file-kib", type=int, default=1024)
    ap.add_argument("--keep-logs", type=Path, help="copy each round's daemon logs here")
    ap.add_argument("--timeout", type=float, default=120, help="per round, from the kill")
    args = ap.parse_args()
    reason = skip_reason()
    if reason:
        raise SystemExit(f"cannot run a fleet here: {reason}")
    sweep_stale_namespaces()
    began = time.monotonic()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="abfailover-") as tmp:
        for i in range(args.rounds):
            rounds.append(one_round(i, args, Path(tmp)))
    summary(rounds, args)
    print(f"whole run {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
