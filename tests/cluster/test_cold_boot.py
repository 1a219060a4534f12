"""A dead host's running sandboxes (issue 23): real daemons in host namespaces
(tests/cluster/fleet_env.py), real etcd, real SeaweedFS, real TCG VMs.

On host A a sandbox gets a file, is suspended (its snapshot shipped), woken by a request
and given a second file and a background process; a second sandbox on A is never
suspended. A is killed (daemon and VMMs, as a host losing power). The reaper moves both
records FAILED to the survivor B with the reason. B registers the first one FAILED with
its last shipped disk only, and a request through B cold-boots that disk: the file written
before the suspend is there byte for byte, the one written after is not (its memory and
what it wrote since the last suspend died with A), the process is gone. The second one is
registered FAILED with nothing: a request is answered 410 ``sandbox_lost`` at once. A
then comes back: it destroys its stale copies and forwards requests for them to B; a
DELETE through A removes the lost one on B (its record too).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from tests.cluster.fleet_env import Fleet
from tests.cluster.test_adoption import REAP_AFTER, _ok, fleet2  # noqa: F401 - the fixture


def _wait_record(fleet: Fleet, sid: str, check: Any, timeout: float, what: str) -> Any:
    seen: list[Any] = []
    fleet.wait_for(lambda: bool(seen.append(fleet.record(sid)) or check(seen[-1])), timeout,
                   what)
    return seen[-1]


def test_a_dead_hosts_running_sandbox_cold_boots_elsewhere_from_its_last_disk(
        fleet2: Fleet) -> None:  # noqa: F811 - the imported fixture
    fleet = fleet2
    sid = _ok(fleet.client("h0").post("/v1/sandboxes", json={"template": "python"}))["id"]
    a = fleet.owner(sid)
    b = next(h for h in fleet.hosts if h is not a)
    on_a, on_b = fleet.client(a), fleet.client(b)
    before = os.urandom(256 << 10)
    assert on_a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/before.bin"},
                    content=before).status_code == 201
    assert _ok(on_a.post(f"/v1/sandboxes/{sid}/suspend"))["state"] == "suspended"
    shipped = _wait_record(fleet, sid, lambda r: bool(r.snapshot), 180, "snapshot shipped")
    assert shipped.tenant and shipped.template == "python" and shipped.snapshot_at > 0

    # Woken on A and written to again: this is what A's death takes with it.
    after = os.urandom(4096)
    assert on_a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/after.bin"},
                    content=after).status_code == 201
    bg = _ok(on_a.post(f"/v1/sandboxes/{sid}/execute", json={
        "command": "setsid sleep 99999 >/dev/null 2>&1 & echo $!; sync"}))["stdout"].strip()
    assert fleet.record(sid).snapshot == shipped.snapshot  # a wake keeps the last upload
    # Never suspended (the hop header keeps the create on A).
    bare = _ok(on_a.post("/v1/sandboxes", json={"template": "python"},
                         headers={"X-AgentBox-Forwarded": "test"}))["id"]
    bare_rec = _wait_record(fleet, bare, lambda r: r is not None and r.state.value == "running",
                            60, "the second sandbox published")
    assert bare_rec.host == a.name and bare_rec.tenant and not bare_rec.snapshot

    killed_at = time.monotonic()
    fleet.kill(a)
    moved = _wait_record(fleet, sid, lambda r: r.host == b.name, 90,
                         "the reaper moves the running sandbox")
    moved_after = time.monotonic() - killed_at
    assert (moved.state.value, moved.gen, moved.snapshot) == ("failed", shipped.gen + 1,
                                                              shipped.snapshot)
    assert f"host {a.name} died; it was running: its memory is lost; its disk is as of " \
           "its last suspend at" in moved.reason, moved.reason
    lost = _wait_record(fleet, bare, lambda r: r.host == b.name, 60,
                        "the reaper moves the never-suspended sandbox")
    assert lost.state.value == "failed" and lost.snapshot == ""
    assert "nothing of it was uploaded: everything is lost" in lost.reason, lost.reason

    # B registers it FAILED with its last disk; a request through B cold-boots that disk.
    fleet.wait_for(lambda: on_b.get(f"/v1/sandboxes/{sid}").status_code == 200, 120,
                   f"{b.name} registers {sid}")
    info = on_b.get(f"/v1/sandboxes/{sid}").json()
    assert info["state"] == "failed" and "its memory is lost" in info["failure"], info
    root_b = b.data_dir / "sandboxes" / sid
    assert sorted(p.name for p in root_b.iterdir()) == ["disk.qcow2"]
    r = on_b.post(f"/v1/sandboxes/{sid}/execute", json={
        "command": f"sha256sum /root/before.bin; ls /root/after.bin 2>&1; "
                   f"kill -0 {bg} 2>/dev/null && echo alive || echo gone"})
    answered_after = time.monotonic() - killed_at
    assert r.status_code == 200, r.text
    out = r.json()["stdout"]
    assert hashlib.sha256(before).hexdigest() in out, out
    assert "No such file" in out and out.rstrip().endswith("gone"), out
    got = on_b.get(f"/v1/sandboxes/{sid}/files/root/before.bin")
    assert got.status_code == 200 and got.content == before
    assert on_b.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    assert fleet.record(sid).host == b.name

    # The never-suspended one: FAILED on B with nothing; a clear 410 at once; DELETE works.
    fleet.wait_for(lambda: on_b.get(f"/v1/sandboxes/{bare}").status_code == 200, 60,
                   f"{b.name} registers {bare}")
    info = on_b.get(f"/v1/sandboxes/{bare}").json()
    assert info["state"] == "failed" and "everything is lost" in info["failure"], info
    started = time.monotonic()
    r = on_b.post(f"/v1/sandboxes/{bare}/execute", json={"command": "true"})
    lost_ms = (time.monotonic() - started) * 1000
    assert r.status_code == 410 and r.json()["error"]["code"] == "sandbox_lost", r.text
    assert "delete it" in r.json()["error"]["message"]
    assert on_b.get(f"/v1/sandboxes/{bare}").json()["state"] == "failed"

    # A comes back: both records are B's now (gen went up), so A destroys its stale copies
    # and forwards requests for them to B; a DELETE through A frees the lost one on B.
    fleet.restart(a)
    for gone in (sid, bare):
        fleet.wait_for(lambda g=gone: not (a.data_dir / "sandboxes" / g).exists(), 60,
                       f"{a.name} drops its copy of {gone}")
    on_a = fleet.client(a)
    r = on_a.post(f"/v1/sandboxes/{sid}/execute", json={"command": "cat /root/before.bin | wc -c"})
    assert r.status_code == 200 and r.json()["stdout"].strip() == str(len(before)), r.text
    assert on_a.post(f"/v1/sandboxes/{bare}/execute", json={"command": "true"}).status_code \
        == 410
    assert on_a.delete(f"/v1/sandboxes/{bare}").status_code == 204
    assert on_b.get(f"/v1/sandboxes/{bare}").status_code == 404
    fleet.wait_for(lambda: fleet.record(bare) is None, 30, "the deleted one's record goes")
    assert not (b.data_dir / "sandboxes" / bare).exists()
    assert on_b.delete(f"/v1/sandboxes/{sid}").status_code == 204
    fleet.wait_for(lambda: fleet.record(sid) is None, 30, "the record goes")
    print(f"\n[coldboot] {a.name} killed -> records moved to {b.name} {moved_after:.1f} s "
          f"(lease TTL {fleet.ttl} s + reap_after {REAP_AFTER} s) -> first request "
          f"answered from the cold-booted disk {answered_after:.1f} s after the kill; "
          f"the lost one answered 410 in {lost_ms:.0f} ms")
