"""Python ``execute`` (a fork of the guest's warm zygote) vs ``run_code`` on the same sandbox.

Three arms, interleaved in rounds (the order rotates each round), each call timed at the
client through the API of a private daemon:

* execute  - ``POST /execute {"code": "print(1)"}``: forked from the zygote
* run_code - ``POST /run_code {"code": "1+1"}``: the warm default interpreter context
* python3  - ``POST /execute {"code": "print(1)", "env": {"PYTHONHASHSEED": "random"}}``: a
  start-up variable, so the agent bypasses the zygote and starts a plain ``python3`` (the
  pre-zygote behaviour, measured in the same run as the baseline)

Reports per-arm medians and min-max of the per-round medians, the ratio execute/run_code
(goal <= 2) and python3/execute.

usage: .venv/bin/python bench/execute.py [--rounds 5] [-n 20] [--template python]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import httpx
from _common import pct, private_daemon

ARMS = {
    "execute": ("execute", {"code": "print(1)"}),
    "run_code": ("run_code", {"code": "1+1"}),
    "python3": ("execute", {"code": "print(1)", "env": {"PYTHONHASHSEED": "random"}}),
}


def call(c: httpx.Client, sid: str, arm: str) -> float:
    path, body = ARMS[arm]
    t = time.monotonic()
    r = c.post(f"/v1/sandboxes/{sid}/{path}", json=body)
    ms = (time.monotonic() - t) * 1000
    r.raise_for_status()
    data = r.json()
    if path == "execute":
        ok = data["stdout"] == "1\n" and data["exit_code"] == 0
    else:
        ok = data["error"] is None and data["results"][0]["text/plain"] == "2"
    if not ok:
        raise SystemExit(f"{arm}: unexpected answer {data}")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", type=int, default=20, help="calls per arm per round")
    ap.add_argument("--template", default="python")
    args = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {platform.release()}")
    with private_daemon() as d, d.client() as c:
        sid = c.post("/v1/sandboxes", json={"template": args.template,
                                             "idle_timeout": 0}).json()["id"]
        for arm in ARMS:  # warm: connection pools, TCG translation of each path
            for _ in range(3):
                call(c, sid, arm)
        names = list(ARMS)
        per_round: dict[str, list[float]] = {a: [] for a in ARMS}
        every: dict[str, list[float]] = {a: [] for a in ARMS}
        for rnd in range(args.rounds):
            order = names[rnd % 3:] + names[:rnd % 3]
            for arm in order:
                times = [call(c, sid, arm) for _ in range(args.n)]
                per_round[arm].append(statistics.median(times))
                every[arm] += times
                print(f"round {rnd} {arm:<9} p50 {per_round[arm][-1]:7.1f} ms", flush=True)
        c.delete(f"/v1/sandboxes/{sid}")
    print(f"\n{'arm':<9} {'p50 ms (all calls)':>19} {'p95':>8} {'round medians min-max':>24}")
    for arm in ARMS:
        meds = per_round[arm]
        print(f"{arm:<9} {statistics.median(every[arm]):>19.1f} {pct(every[arm], 95):>8.1f} "
              f"{min(meds):>15.1f}-{max(meds):<8.1f}")
    ratio = [e / r for e, r in zip(per_round["execute"], per_round["run_code"], strict=True)]
    speedup = [p / e for p, e in zip(per_round["python3"], per_round["execute"], strict=True)]
    print(f"execute/run_code per round: median {statistics.median(ratio):.2f} "
          f"(min {min(ratio):.2f}, max {max(ratio):.2f}); goal <= 2")
    print(f"python3/execute per round:  median {statistics.median(speedup):.2f} "
          f"(min {min(speedup):.2f}, max {max(speedup):.2f})")


if __name__ == "__main__":
    main()
