"""A dead host's suspended sandbox wakes on another host (issue 23): real daemons in host
namespaces (tests/cluster/fleet_env.py), real etcd, real SeaweedFS, real TCG VMs.

A sandbox with a file, a background process and an interpreter variable is suspended on
host A (A's data dir); its snapshot is shipped and named in its record. A is killed (daemon
and VMMs, as a host losing power). The reaper (on the surviving host, which leads) moves
the record; that host adopts it (fetches the snapshot into its own data dir, rewrites it
onto its golden, registers it SUSPENDED), and a request through it wakes the sandbox with
the file byte for byte, the process alive and the variable's value. A second one, whose
snapshot is corrupted in the store, is refused by the fetch and registered FAILED with
nothing (410 sandbox_lost; DELETE works). Then A comes back: it finds its local copies'
records held by the other host and destroys those copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.etcd_env import EtcdCluster, sweep_stale_namespaces
from tests.cluster.fleet_env import Fleet, Host, skip_reason

REAP_AFTER = 3.0


class AdoptingFleet(Fleet):
    """The fleet with a short reaper grace (the default, 60 s, covers daemon restarts)."""

    def config_for(self, host: Host) -> dict[str, dict[str, Any]]:
        config = super().config_for(host)
        config["cluster"]["reap_after"] = REAP_AFTER
        return config


@pytest.fixture
def fleet2(tmp_path: Path) -> Iterator[Fleet]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    sweep_stale_namespaces()
    cluster = EtcdCluster(tmp_path / "etcd")
    fleet = None
    ok = False
    try:
        cluster.start()
        fleet = AdoptingFleet(cluster, tmp_path / "fleet", size=2)
        took = fleet.start()
        print(f"\n[adopt] 2 daemons + SeaweedFS up in {took:.1f} s")
        yield fleet
        ok = True
    except BaseException:
        if fleet is not None:
            print(fleet.logs(6000))
        raise
    finally:
        left = fleet.close() if fleet is not None else []
        cluster.close()
    if ok:
        assert not left, f"left behind: {left}"


async def _store_op(fleet: Fleet, op: str, key: str, data: bytes = b"") -> bytes:
    from gateway.cluster.objstore import ObjectStore
    from tests.cluster.fleet_env import BUCKET
    from tests.cluster.weed_env import CREDS

    store = ObjectStore(fleet.objstore_endpoint, BUCKET, CREDS, timeout=10)
    try:
        if op == "put":
            await store.put_bytes(key, data)
            return b""
        return await store.get_bytes(key, 1 << 20)
    finally:
        await store.aclose()


def _ok(r: Any) -> Any:
    assert r.status_code in (200, 201), r.text
    return r.json()


def test_a_dead_hosts_suspended_sandbox_wakes_on_another_host(fleet2: Fleet) -> None:
    fleet = fleet2
    api = fleet.client("h0")
    sid = _ok(api.post("/v1/sandboxes", json={"template": "python"}))["id"]
    a = fleet.owner(sid)
    b = next(h for h in fleet.hosts if h is not a)
    on_a = fleet.client(a)
    payload = os.urandom(1 << 20)
    assert on_a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/blob.bin"},
                    content=payload).status_code == 201
    bg = _ok(on_a.post(f"/v1/sandboxes/{sid}/execute", json={
        "command": "setsid sleep 99999 >/dev/null 2>&1 & echo $!"}))["stdout"].strip()
    secret = os.urandom(8).hex()
    r = _ok(on_a.post(f"/v1/sandboxes/{sid}/run_code", json={"code": f"kept = '{secret}'"}))
    assert r["error"] is None, r
    assert _ok(on_a.post(f"/v1/sandboxes/{sid}/suspend"))["state"] == "suspended"
    root_a = a.data_dir / "sandboxes" / sid
    assert (root_a / "snapshot" / "manifest.json").is_file()
    # A second sandbox on A (the hop header keeps the create there), suspended too: its
    # shipped device state will be corrupted in the store before A dies.
    bad = _ok(on_a.post("/v1/sandboxes", json={"template": "python"},
                        headers={"X-AgentBox-Forwarded": "test"}))["id"]
    assert fleet.record(bad) is None or fleet.owner(bad) is a
    assert _ok(on_a.post(f"/v1/sandboxes/{bad}/suspend"))["state"] == "suspended"

    # Shipped: the record names the snapshot, its base and shape (the reaper reads only it).
    shipped: list[Any] = []
    took = fleet.wait_for(lambda: bool(shipped.append(fleet.record(sid))
                                       or shipped[-1].snapshot), 120, "snapshot shipped")
    rec = shipped[-1]
    print(f"\n[adopt] suspended on {a.name}, shipped and named in {took:.1f} s")
    assert rec.host == a.name and rec.state.value == "suspended" and len(rec.base) == 64
    assert rec.memory_mib > 0 and rec.vcpus > 0
    bad_rec: list[Any] = []
    fleet.wait_for(lambda: bool(bad_rec.append(fleet.record(bad)) or bad_rec[-1].snapshot),
                   120, "the second snapshot shipped")
    prefix = bad_rec[-1].snapshot.partition("#")[0]
    fleet.loop.run(_store_op(fleet, "put", f"{prefix}/snapshot/vmstate", b"not the state"))

    # A dies: its daemon and VMMs killed; its lease expires; the reaper moves the record.
    killed_at = time.monotonic()
    fleet.kill(a)
    moved: list[Any] = []
    fleet.wait_for(lambda: bool(moved.append(fleet.record(sid)) or moved[-1].host == b.name),
                   60, "the reaper moves the record to the survivor")
    moved_after = time.monotonic() - killed_at
    assert moved[-1].gen == rec.gen + 1 and moved[-1].state.value == "suspended"
    assert moved[-1].snapshot == rec.snapshot

    # B adopts it: a SUSPENDED row of its own, files under B's data dir.
    on_b = fleet.client(b)
    fleet.wait_for(lambda: on_b.get(f"/v1/sandboxes/{sid}").status_code == 200, 120,
                   f"{b.name} adopts {sid}")
    adopted_after = time.monotonic() - killed_at
    info = on_b.get(f"/v1/sandboxes/{sid}").json()
    assert info["state"] == "suspended", info
    root_b = b.data_dir / "sandboxes" / sid
    assert (root_b / "snapshot" / "manifest.json").is_file() and root_b != root_a
    assert str(root_a) not in (root_b / "snapshot" / "manifest.json").read_text()

    # A request through B wakes it there: file byte for byte, process and variable alive.
    r = on_b.post(f"/v1/sandboxes/{sid}/execute",
                  json={"command": f"kill -0 {bg} && echo alive; sha256sum /root/blob.bin"})
    assert r.status_code == 200, r.text
    woke_ms = float(r.headers.get("X-AgentBox-Wake-Ms", "0"))
    out = r.json()["stdout"]
    assert out.startswith("alive\n"), out
    assert hashlib.sha256(payload).hexdigest() in out
    got = on_b.get(f"/v1/sandboxes/{sid}/files/root/blob.bin")
    assert got.status_code == 200 and got.content == payload
    code = _ok(on_b.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "kept"}))
    assert code["results"][0]["text/plain"] == repr(secret), code
    assert fleet.record(sid).host == b.name

    # The corrupted one: B's fetch refuses it; its record is FAILED on B with the reason,
    # and the snapshot stays in the store (its index is still there).
    failed: list[Any] = []
    fleet.wait_for(lambda: bool(failed.append(fleet.record(bad))
                                or failed[-1].state.value == "failed"), 60,
                   "the corrupted snapshot's adoption fails")
    assert failed[-1].host == b.name and "SHA256" in failed[-1].reason, failed[-1]
    assert failed[-1].snapshot == bad_rec[-1].snapshot
    assert fleet.loop.run(_store_op(fleet, "get", f"{prefix}/index.json"))
    # ... and registered on B FAILED with nothing (the owner sees why and can delete it):
    # a request is answered 410 sandbox_lost, nothing of the snapshot is on B's disk.
    fleet.wait_for(lambda: on_b.get(f"/v1/sandboxes/{bad}").status_code == 200, 60,
                   f"{b.name} registers the failed one")
    info = on_b.get(f"/v1/sandboxes/{bad}").json()
    assert info["state"] == "failed" and "SHA256" in info["failure"], info
    r = on_b.post(f"/v1/sandboxes/{bad}/execute", json={"command": "true"})
    assert r.status_code == 410 and r.json()["error"]["code"] == "sandbox_lost", r.text
    assert list((b.data_dir / "sandboxes").glob(f"*{bad}*")) == [b.data_dir / "sandboxes" / bad]
    assert not list((b.data_dir / "sandboxes" / bad).iterdir())
    print(f"[adopt] {bad}: {failed[-1].reason}")
    print(f"[adopt] {a.name} killed -> record moved to {b.name} {moved_after:.1f} s "
          f"(lease TTL {fleet.ttl} s + reap_after {REAP_AFTER} s) -> adopted "
          f"{adopted_after:.1f} s; first wake on {b.name} {woke_ms:.0f} ms")

    # A comes back: its local copy's record is B's (gen went up): the copy is destroyed,
    # never republished, and B keeps serving it.
    fleet.restart(a)
    fleet.wait_for(lambda: not root_a.exists(), 60, f"{a.name} drops its stale copy")
    fleet.wait_for(lambda: not (a.data_dir / "sandboxes" / bad).exists(), 60,
                   f"{a.name} drops its copy of the failed one")
    r = fleet.client(a).post(f"/v1/sandboxes/{sid}/execute", json={"command": "echo via-a"})
    assert r.status_code == 200 and r.json()["stdout"] == "via-a\n", r.text
    assert fleet.record(sid).host == b.name
    assert on_b.delete(f"/v1/sandboxes/{bad}").status_code == 204
    fleet.wait_for(lambda: fleet.record(bad) is None, 30, "the failed one's record goes")
    with contextlib.suppress(Exception):
        assert on_b.delete(f"/v1/sandboxes/{sid}").status_code == 204
