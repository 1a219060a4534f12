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

Each round runs every arm twice: back-to-back (the next call as soon as the last answer is
in) and with ``--gap`` seconds of think time before each call (as an agent between tool
calls), which is when the zygote has a spare child forked ahead of need.

With ``--vcpus 1,2`` one sandbox of each vCPU count is measured in the same rounds (the
order of the sandboxes alternating), each against its own run_code.

usage: .venv/bin/python bench/execute.py [--rounds 5] [-n 20] [--gap 0.2] [--template python]
       [--vcpus 1,2]
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


def call(c: httpx.Client, sid: str, arm: str, gap: float = 0.0) -> float:
    path, body = ARMS[arm]
    time.sleep(gap)
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
    ap.add_argument("--gap", type=float, default=0.2, help="think time (s) in the gap rows")
    ap.add_argument("--template", default="python")
    ap.add_argument("--vcpus", default="",
                    help="comma-separated vCPU counts: one sandbox of each, interleaved "
                         "(default: one sandbox of the server's default shape)")
    args = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {platform.release()}")
    modes = {"back-to-back": 0.0, f"gap {args.gap * 1000:.0f} ms": args.gap}
    asked = [int(v) for v in args.vcpus.split(",") if v] or [None]
    with private_daemon() as d, d.client() as c:
        sids: dict[str, str] = {}
        for vcpus in asked:
            body: dict[str, object] = {"template": args.template, "idle_timeout": 0}
            if vcpus is not None:
                body["vcpus"] = vcpus
            r = c.post("/v1/sandboxes", json=body, timeout=600)  # a new shape builds its golden
            r.raise_for_status()
            sids[f"{r.json()['vcpus']} vCPU"] = r.json()["id"]
        for sid in sids.values():
            for arm in ARMS:  # warm: connection pools, TCG translation of each path
                for _ in range(3):
                    call(c, sid, arm)
        names, shapes = list(ARMS), list(sids)
        keys = [(mode, shape, arm) for mode in modes for shape in shapes for arm in names]
        per_round: dict[tuple[str, str, str], list[float]] = {k: [] for k in keys}
        every: dict[tuple[str, str, str], list[float]] = {k: [] for k in keys}
        for rnd in range(args.rounds):
            order = names[rnd % 3:] + names[:rnd % 3]
            for mode in (list(modes) if rnd % 2 == 0 else list(modes)[::-1]):
                for shape in (shapes if rnd % 2 == 0 else shapes[::-1]):
                    for arm in order:
                        times = [call(c, sids[shape], arm, modes[mode]) for _ in range(args.n)]
                        k = (mode, shape, arm)
                        per_round[k].append(statistics.median(times))
                        every[k] += times
                        print(f"round {rnd} {mode:<13} {shape} {arm:<9} "
                              f"p50 {per_round[k][-1]:7.1f} ms", flush=True)
        for sid in sids.values():
            c.delete(f"/v1/sandboxes/{sid}")
    for mode in modes:
        for shape in shapes:
            print(f"\n{mode}, {shape}\n{'arm':<9} {'p50 ms (all calls)':>19} {'p95':>8} "
                  f"{'round medians min-max':>24}")
            for arm in ARMS:
                meds, allc = per_round[mode, shape, arm], every[mode, shape, arm]
                print(f"{arm:<9} {statistics.median(allc):>19.1f} {pct(allc, 95):>8.1f} "
                      f"{min(meds):>15.1f}-{max(meds):<8.1f}")
            ratio = [e / r for e, r in zip(per_round[mode, shape, "execute"],
                                           per_round[mode, shape, "run_code"], strict=True)]
            speedup = [p / e for p, e in zip(per_round[mode, shape, "python3"],
                                             per_round[mode, shape, "execute"], strict=True)]
            print(f"execute/run_code per round: median {statistics.median(ratio):.2f} "
                  f"(min {min(ratio):.2f}, max {max(ratio):.2f}); goal <= 2")
            print(f"python3/execute per round:  median {statistics.median(speedup):.2f} "
                  f"(min {min(speedup):.2f}, max {max(speedup):.2f})")

if __name__ == "__main__":
    main()
