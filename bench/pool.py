"""Warm pool benchmark: ``POST /v1/sandboxes`` with the pool on vs off, in one run.

Two private daemons (one template, ``python``): A with ``[pool] size = 1``, B without a pool.
Rounds interleave A and B; before each measured create both daemons are quiet (A's pool is
full again, no refill running), and each created sandbox is deleted before the next round.
Reported: client-side create latency (p50, spread) for each, and the ratio of the medians.
Goal: pool create p50 <= 50 ms, >= 8x faster than without the pool.
"""

from __future__ import annotations

import argparse
import os
import time

from _common import private_daemon, report

ONE_TEMPLATE = ('templates = ["python", "python-datascience"]', 'templates = ["python"]')


def pool_ready(c) -> int:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith('agentbox_pool_ready{template="python"} '):
            return int(line.split()[-1])
    return 0


def wait_ready(c, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while pool_ready(c) < n:
        assert time.monotonic() < deadline, "the pool did not refill"
        time.sleep(0.1)
    time.sleep(0.5)  # the refilled member's restore is over; let the machine settle


def create(c, expect_pool: bool) -> float:
    t = time.monotonic()
    r = c.post("/v1/sandboxes", json={})
    ms = (time.monotonic() - t) * 1000
    assert r.status_code == 201, r.text
    assert (r.headers.get("X-AgentBox-Pool") == "claimed") is expect_pool, r.headers
    # The sandbox works (not measured): then it goes.
    assert c.post(f"/v1/sandboxes/{r.json()['id']}/execute",
                  json={"command": "true"}).status_code == 200
    c.delete(f"/v1/sandboxes/{r.json()['id']}")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    with private_daemon(ONE_TEMPLATE, ("[pool]\nsize = 0", "[pool]\nsize = 1")) as a, \
            private_daemon(ONE_TEMPLATE) as b, a.client() as ca, b.client() as cb:
        for c in (ca, cb):  # warm-up, not measured
            create(c, expect_pool=c is ca and pool_ready(ca) > 0)
        pooled, plain = [], []
        for _ in range(args.rounds):
            wait_ready(ca, 1)
            pooled.append(create(ca, expect_pool=True))
            wait_ready(ca, 1)
            plain.append(create(cb, expect_pool=False))
    p = report("create, pool on (claims a paused member)", pooled)
    q = report("create, pool off (restore from golden)", plain)
    print(f"pool off / pool on (p50): {q / p:.1f}x (goal >= 8x, pool on <= 50 ms)")
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
