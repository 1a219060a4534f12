"""A dead host comes back after its moved sandbox was deleted on its new host (issue 23):
real daemons in host namespaces (tests/cluster/fleet_env.py), real etcd, real SeaweedFS,
one real TCG VM.

A sandbox on host A is suspended and shipped; A remembers (its registry's ``published``
table) that etcd held its record. A is killed (daemon and VMMs, a host losing power); the
reaper moves the record to B, which adopts it; the tenant deletes it through B (the record
goes). A restarts with its stale local copy and finds no record for it: because it had
published it, the absence means "deleted by its new owner", so A destroys the copy (VMM,
namespace, files; its row DESTROYED) and never publishes it again. Without that rule A
published it again and the deleted sandbox came back through every host (checked: with
the registry's memory unwired this test fails, A keeping its copy). The second test does
the same with A only cut off from the network, rejoining after the delete.
"""

from __future__ import annotations

import sqlite3
import time

from tests.cluster.fleet_env import Fleet
from tests.cluster.test_adoption import _ok, fleet2  # noqa: F401 - the fixture


def _row(db: str, sql: str, *args: str) -> tuple[object, ...] | None:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchone()
    finally:
        conn.close()


def test_a_sandbox_deleted_on_its_new_host_does_not_come_back_with_its_old_host(
        fleet2: Fleet) -> None:  # noqa: F811 - the imported fixture
    from vmctl.network import list_namespaces

    fleet = fleet2
    a, b = fleet.host("h0"), fleet.host("h1")
    sid = fleet.create_on(a)
    on_a, on_b = fleet.client(a), fleet.client(b)
    assert _ok(on_a.post(f"/v1/sandboxes/{sid}/suspend"))["state"] == "suspended"
    seen: list[object] = []
    fleet.wait_for(lambda: bool(seen.append(fleet.record(sid)) or seen[-1].snapshot), 180,
                   "snapshot shipped")
    db = str(a.data_dir / "registry.sqlite")
    assert _row(db, "SELECT 1 FROM published WHERE sandbox_id = ?", sid), \
        "A remembers that etcd held its record"
    root_a = a.data_dir / "sandboxes" / sid
    assert root_a.is_dir()

    # A loses power; the reaper moves the record to B, which adopts it; the tenant
    # deletes it through B: the record goes.
    fleet.kill(a)
    fleet.wait_for(lambda: (fleet.record(sid) or seen[0]).host == b.name, 120,
                   "the reaper moves the record to B")
    fleet.wait_for(lambda: on_b.get(f"/v1/sandboxes/{sid}").status_code == 200, 120,
                   "B adopts it")
    assert on_b.delete(f"/v1/sandboxes/{sid}").status_code == 204
    fleet.wait_for(lambda: fleet.record(sid) is None, 30, "the record is deleted")
    assert root_a.is_dir(), "A's stale copy is still on its disk while A is down"

    # A comes back: its copy is destroyed, never published again.
    began = time.monotonic()
    fleet.restart(a)
    fleet.wait_for(lambda: not root_a.exists(), 60, "A destroys its stale copy")
    print(f"\n[tomb] A restarted and dropped its copy of the deleted sandbox in "
          f"{time.monotonic() - began:.1f} s")
    time.sleep(3.0)  # a republish would have landed by now (the publisher writes at once)
    assert fleet.record(sid) is None
    for host in (a, b):
        r = fleet.client(host).get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 404, (host.name, r.status_code, r.text)
    listed = _ok(on_a.get("/v1/sandboxes"))
    items = listed["sandboxes"] if isinstance(listed, dict) else listed
    assert sid not in {s["id"] for s in items}
    assert _row(db, "SELECT state FROM sandboxes WHERE id = ?", sid) == ("destroyed",)
    cause = _row(db, "SELECT cause FROM transitions WHERE sandbox_id = ? ORDER BY seq DESC "
                 "LIMIT 1", sid)
    assert cause is not None and "deleted" in str(cause[0]), cause
    assert fleet.vmm_pids(a) == []
    assert list_namespaces(f"{fleet.prefix}{a.name}-") == []
    assert not root_a.exists()


def test_a_cut_off_host_that_rejoins_after_the_delete_does_not_bring_it_back(
        fleet2: Fleet) -> None:  # noqa: F811 - the imported fixture
    """The same while A is only cut off (its daemon and VMMs live on): A fences, the
    record moves to B and is deleted there, the link comes back, A rejoins (the same sync
    as a start-up) and its copy goes. Either of A's paths may destroy it first: the
    publisher's (its record is gone) or the adopter's (the watch resumes and replays the
    move); either way the record is never written again."""
    from vmctl.network import list_namespaces

    fleet = fleet2
    a, b = fleet.host("h0"), fleet.host("h1")
    sid = fleet.create_on(a)
    on_a, on_b = fleet.client(a), fleet.client(b)
    assert _ok(on_a.post(f"/v1/sandboxes/{sid}/suspend"))["state"] == "suspended"
    seen: list[object] = []
    fleet.wait_for(lambda: bool(seen.append(fleet.record(sid)) or seen[-1].snapshot), 180,
                   "snapshot shipped")
    root_a = a.data_dir / "sandboxes" / sid
    fleet.link(a, up=False)
    try:
        fleet.wait_for(lambda: (fleet.record(sid) or seen[0]).host == b.name, 120,
                       "the reaper moves the record to B")
        fleet.wait_for(lambda: on_b.get(f"/v1/sandboxes/{sid}").status_code == 200, 120,
                       "B adopts it")
        assert on_b.delete(f"/v1/sandboxes/{sid}").status_code == 204
        fleet.wait_for(lambda: fleet.record(sid) is None, 30, "the record is deleted")
        assert root_a.is_dir(), "A, cut off, still has its copy"
    finally:
        fleet.link(a, up=True)
    fleet.wait_for(lambda: fleet.host_record(a), 120, "A rejoins")
    fleet.wait_for(lambda: not root_a.exists(), 60, "A destroys its stale copy")
    time.sleep(3.0)
    assert fleet.record(sid) is None
    for host in (a, b):
        r = fleet.client(host).get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 404, (host.name, r.status_code, r.text)
    db = str(a.data_dir / "registry.sqlite")
    assert _row(db, "SELECT state FROM sandboxes WHERE id = ?", sid) == ("destroyed",)
    cause = _row(db, "SELECT cause FROM transitions WHERE sandbox_id = ? ORDER BY seq DESC "
                 "LIMIT 1", sid)
    print(f"\n[tomb] the cut host's copy went: {cause}")
    assert fleet.vmm_pids(a) == []
    assert list_namespaces(f"{fleet.prefix}{a.name}-") == []
