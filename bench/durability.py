"""What durable acknowledgements cost (issue 9): the guest's sync() per mutating request.

Inside one sandbox, interleaved rounds (A/B/A/B...): A = sync() with nothing dirty (what an
``execute`` that wrote nothing pays), B = write 1 MiB then sync() (what an upload of 1 MiB
pays on top of its write). Both are timed in the guest, so the figure is the added latency of
the acknowledgement alone. Also prints the end-to-end p50 of execute and a 1 KiB upload.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import private_daemon, report

PROBE = r"""
import json, os, time
clean, dirty = [], []
for i in range({n}):
    t = time.perf_counter(); os.sync(); clean.append((time.perf_counter() - t) * 1000)
    with open("/root/.bench-dirty", "wb") as f:
        f.write(os.urandom(1 << 20))
    t = time.perf_counter(); os.sync(); dirty.append((time.perf_counter() - t) * 1000)
print(json.dumps([clean, dirty]))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=20)
    args = p.parse_args()
    with private_daemon() as d, d.client() as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout": 0}).json()["id"]
        r = c.post(f"/v1/sandboxes/{sid}/execute",
                   json={"code": PROBE.format(n=args.n), "language": "python", "timeout": 600})
        clean, dirty = json.loads(r.json()["stdout"])
        report("guest sync(), nothing dirty (A)", clean)
        report("guest sync() after writing 1 MiB (B)", dirty)
        execs, uploads = [], []
        for _ in range(args.n):
            t = time.perf_counter()
            c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"}).raise_for_status()
            execs.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/small"},
                  content=b"x" * 1024).raise_for_status()
            uploads.append((time.perf_counter() - t) * 1000)
        report("execute 'true' end to end (includes sync)", execs)
        report("upload 1 KiB end to end (fsync + sync)", uploads)


if __name__ == "__main__":
    main()
