"""What VMM confinement costs: create and wake p50, confined vs unconfined, in one run.

Two private daemons serve the python template, one with ``[confine] enabled = true``
(the default) and one with it off, each with its own network pool. Rounds alternate
A/B/A/B: in each round each daemon creates a sandbox (API round trip), suspends it,
wakes it with an execute (``X-AgentBox-Wake-Ms`` and the wall time of that request),
and deletes it. Prints medians, spread and the confined/unconfined ratios.

Run: ``.venv/bin/python bench/confinement.py [-n ROUNDS]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import report, start_daemon, stop_daemon

CONFIG = """
[sandbox]
templates = ["python"]
idle_timeout = 0

[network]
pool = "{pool}"

[confine]
enabled = {enabled}
"""

MODES = {"confined": ("169.254.8.0/22", "true"), "unconfined": ("169.254.12.0/22", "false")}


def one_round(client) -> dict[str, float]:  # type: ignore[no-untyped-def]
    t = time.monotonic()
    r = client.post("/v1/sandboxes", json={"template": "python"})
    create_ms = (time.monotonic() - t) * 1000
    r.raise_for_status()
    sid = r.json()["id"]
    try:
        client.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
        t = time.monotonic()
        r = client.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
        wake_wall = (time.monotonic() - t) * 1000
        r.raise_for_status()
        return {"create": create_ms, "wake": float(r.headers["X-AgentBox-Wake-Ms"]),
                "wake_request": wake_wall}
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=10, help="rounds (each A then B)")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="agentbox-bench-confine-") as tmp:
        daemons = {}
        try:
            for mode, (pool, enabled) in MODES.items():
                cfg = Path(tmp) / f"{mode}.toml"
                cfg.write_text(CONFIG.format(pool=pool, enabled=enabled))
                daemons[mode] = start_daemon(Path(tmp) / mode, config=cfg)
            clients = {m: d.client() for m, d in daemons.items()}
            for client in clients.values():  # warm-up, not counted
                one_round(client)
            for _ in range(args.n):
                for mode, client in clients.items():
                    for name, value in one_round(client).items():
                        results[mode].setdefault(name, []).append(value)
        finally:
            for d in daemons.values():
                stop_daemon(d)
    medians = {}
    for mode, series in results.items():
        for name, values in series.items():
            medians[mode, name] = report(f"{mode:<10} {name}", values)
    for name in results["confined"]:
        ratio = medians["confined", name] / medians["unconfined", name]
        spread = statistics.pstdev(results["confined"][name]) / medians["confined", name]
        print(f"ratio confined/unconfined {name:<14} {ratio:5.2f}  (confined spread {spread:.0%})")


if __name__ == "__main__":
    main()
