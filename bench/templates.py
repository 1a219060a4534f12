"""User templates: create from a user template vs from a built-in one, snapshot time, fork of 4.

One private daemon (python template). A source sandbox gets some state (a 20 MiB file, a
background process, an interpreter variable), then:

* snapshot: ``POST /snapshot`` wall time and the source's pause (``paused_ms``), n times;
* create: rounds alternate which goes first (A/B, then B/A): ``POST /v1/sandboxes`` from
  the built-in ``python`` and from the user template, each followed by one ``execute
  true`` (so both are measured to a working sandbox), then deleted;
* fork: ``POST /fork {"count": 4}`` wall time (one capture + four restores), m times.

Prints medians and spread, and the user/built-in create ratio.
Run: ``.venv/bin/python bench/templates.py [-n ROUNDS] [--forks M]``.
"""

from __future__ import annotations

import argparse
import time

from _common import private_daemon, report

SLOW = 900


def _ms(t: float) -> float:
    return (time.monotonic() - t) * 1000


def create_and_use(client, template: str) -> float:  # type: ignore[no-untyped-def]
    t = time.monotonic()
    r = client.post("/v1/sandboxes", json={"template": template}, timeout=SLOW)
    r.raise_for_status()
    sid = r.json()["id"]
    try:
        client.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"}).raise_for_status()
        return _ms(t)
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=8, help="create rounds (each A and B)")
    parser.add_argument("--snapshots", type=int, default=3)
    parser.add_argument("--forks", type=int, default=2, help="fork-of-4 repetitions")
    args = parser.parse_args()
    with private_daemon() as daemon, daemon.client() as c:
        r = c.post("/v1/sandboxes", json={"template": "python"}, timeout=SLOW)
        r.raise_for_status()
        src = r.json()["id"]
        c.post(f"/v1/sandboxes/{src}/execute", json={
            "command": "head -c 20M /dev/urandom > /root/blob"}).raise_for_status()
        c.post(f"/v1/sandboxes/{src}/commands", json={"command": "sleep 99999",
                                                       "background": True}).raise_for_status()
        c.post(f"/v1/sandboxes/{src}/run_code",
               json={"code": "big = list(range(200_000))"}).raise_for_status()

        snap_wall, paused = [], []
        for i in range(args.snapshots):
            t = time.monotonic()
            r = c.post(f"/v1/sandboxes/{src}/snapshot", json={"template": f"bench-{i}"},
                       timeout=SLOW)
            r.raise_for_status()
            snap_wall.append(_ms(t))
            paused.append(r.json()["paused_ms"])
            if i:
                c.delete(f"/v1/templates/bench-{i}").raise_for_status()

        builtin, user = [], []
        for i in range(args.n):
            order = [("python", builtin), ("bench-0", user)]
            for template, out in order if i % 2 == 0 else order[::-1]:
                out.append(create_and_use(c, template))

        forks = []
        for _ in range(args.forks):
            t = time.monotonic()
            r = c.post(f"/v1/sandboxes/{src}/fork", json={"count": 4}, timeout=SLOW)
            r.raise_for_status()
            forks.append(_ms(t))
            for sb in r.json()["sandboxes"]:
                c.delete(f"/v1/sandboxes/{sb['id']}")

    report("snapshot: POST /snapshot wall", snap_wall)
    report("snapshot: source paused (paused_ms)", paused)
    b = report("create + first exec, built-in python", builtin)
    u = report("create + first exec, user template", user)
    report("fork of 4: POST /fork wall", forks)
    print(f"user / built-in create (p50): {u / b:.2f}")


if __name__ == "__main__":
    main()
