"""Per-sandbox shapes: what a create costs when its (vcpus, memory) has no golden snapshot
yet (the daemon builds one first) against a shape already cached, and what a bigger disk
adds (block_resize + online resize2fs after the restore).

Interleaved rounds, one private daemon; each round's "new shape" is a RAM size never used
before (its golden snapshot is removed at the end), so every such create really builds.

    .venv/bin/python bench/shapes.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import httpx
from _common import IMAGES_DIR, private_daemon, report


def create_ms(api: httpx.Client, **shape: int) -> float:
    start = time.monotonic()
    r = api.post("/v1/sandboxes", json={"template": "python", **shape})
    elapsed = (time.monotonic() - start) * 1000
    assert r.status_code == 201, r.text
    sb = r.json()
    api.delete(f"/v1/sandboxes/{sb['id']}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = 640 + 8 * (os.getpid() % 40)  # RAM sizes (640..960 MiB) no earlier run built
    figures: dict[str, list[float]] = {"new shape (golden build + create)": [],
                                       "cached shape (2 vCPU, 1 GiB)": [],
                                       "default shape": [], "default + 4 GiB disk": []}
    with private_daemon() as d, d.client() as api:
        api.timeout = httpx.Timeout(900)
        create_ms(api, vcpus=2, memory_mib=1024)  # make sure the cached shape is cached
        try:
            for i in range(args.rounds):
                figures["new shape (golden build + create)"].append(
                    create_ms(api, memory_mib=base + 8 * i))
                figures["cached shape (2 vCPU, 1 GiB)"].append(
                    create_ms(api, vcpus=2, memory_mib=1024))
                figures["default shape"].append(create_ms(api))
                figures["default + 4 GiB disk"].append(create_ms(api, disk_mib=4096))
        finally:
            for i in range(args.rounds):
                for golden in IMAGES_DIR.glob(f"python/*/golden-*-{base + 8 * i}M-r*"):
                    shutil.rmtree(golden, ignore_errors=True)
    for name, values in figures.items():
        report(name, values)


if __name__ == "__main__":
    main()
