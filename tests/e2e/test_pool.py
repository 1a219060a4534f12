"""The warm pool with real VMs (issue 12, part 1): a create claims a pooled, paused VM; two
pooled sandboxes of two tenants share no identity; the pool refills; the daemon removes its
members when it stops. Its own daemon, with ``[pool] size = 2`` (the suite's has none)."""

from __future__ import annotations

import os
import signal
import sqlite3
import time

import httpx
import pytest

from gateway.sandbox.warm_pool import POOL_TENANT
from tests.e2e.conftest import CONFIG, start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e

SIZE = 2


@pytest.fixture(scope="module")
def pooled(images_built, tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    config = root / "agentbox-pool.toml"
    text = CONFIG.read_text()
    assert "[pool]\nsize = 0" in text
    templates = 'templates = ["python", "python-datascience"]'
    assert templates in text  # one template here: SIZE VMs in the pool, not twice that
    config.write_text(text.replace("[pool]\nsize = 0", f"[pool]\nsize = {SIZE}")
                      .replace(templates, 'templates = ["python"]'))
    d = start_daemon(root / "data", config=config)
    try:
        yield d
    finally:
        try:
            with d.client() as c:
                for key in c.get("/v1/keys").json()["keys"]:
                    for sb in c.get("/v1/sandboxes", params={"tenant": key["id"]}).json()[
                            "sandboxes"]:
                        c.delete(f"/v1/sandboxes/{sb['id']}", params={"tenant": key["id"]})
        finally:
            stop_daemon(d)  # SIGTERM: the daemon destroys its pool members
            leftovers = vmm_pids_for(str(root / "data"))
            for pid in leftovers:
                os.kill(pid, signal.SIGKILL)
            assert not leftovers, f"VMM processes left behind (pool members?): {leftovers}"


def members(d, state: str = "paused") -> list[str]:
    db = sqlite3.connect(f"file:{d.data_dir / 'registry.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT id FROM sandboxes WHERE tenant = ? AND state = ? "
                          "AND template = 'python'",
                          (POOL_TENANT, state)).fetchall()
    finally:
        db.close()
    return sorted(r[0] for r in rows)


def ready(d) -> int:
    with d.client() as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith('agentbox_pool_ready{template="python"} '):
                return int(line.split()[-1])
    raise AssertionError("no agentbox_pool_ready gauge")


def wait_full(d, timeout: float = 240.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready(d) >= SIZE:
            got = members(d)
            assert len(got) == SIZE, got
            return got
        time.sleep(0.5)
    raise AssertionError(f"pool not refilled: {members(d)} {d.log_tail(2000)}")


def sh(c: httpx.Client, sid: str, command: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": command})
    assert r.status_code == 200, r.text
    return r.json()["stdout"].strip()


def test_create_claims_a_pooled_vm_and_the_pool_refills(pooled):
    before = wait_full(pooled)
    for sid in before:
        assert len(vmm_pids_for(sid)) == 1  # restored, paused, VMM alive
    with pooled.client() as admin:
        key = admin.post("/v1/keys", json={"name": "pool-e2e"}).json()
        with pooled.client(key["key"]) as other:
            ra = admin.post("/v1/sandboxes", json={"metadata": {"who": "admin"}})
            rb = other.post("/v1/sandboxes", json={"idle_timeout": 0})
            assert ra.status_code == 201 and rb.status_code == 201, (ra.text, rb.text)
            a, b = ra.json(), rb.json()
            assert ra.headers.get("X-AgentBox-Pool") == "claimed", ra.headers
            assert rb.headers.get("X-AgentBox-Pool") == "claimed", rb.headers
            assert {a["id"], b["id"]} == set(before)  # the pooled VMs, claimed
            assert a["state"] == b["state"] == "running" and a["metadata"] == {"who": "admin"}
            # Now the tenants' own: invisible to the other, counted for their tenant only.
            assert other.get(f"/v1/sandboxes/{a['id']}").status_code == 404
            assert [s["id"] for s in other.get("/v1/sandboxes").json()["sandboxes"]] == [b["id"]]
            # No shared identity: fresh entropy (CRNG reseeded) and a current clock each.
            probe = "python3 -c 'import os, random; print(os.urandom(16).hex(), " \
                    "random.getrandbits(64))'; cat /proc/sys/kernel/random/boot_id"
            out_a, out_b = sh(admin, a["id"], probe), sh(other, b["id"], probe)
            print("identity a:", out_a.replace("\n", " "), "| b:", out_b.replace("\n", " "))
            assert out_a.split("\n")[0] != out_b.split("\n")[0]
            assert abs(float(sh(admin, a["id"], "date +%s.%N")) - time.time()) < 2.0
            after = wait_full(pooled)
            assert not set(after) & set(before), "the pool refilled with new VMs"
            # With the pool empty of this template's members... a create still works.
            t = time.monotonic()
            rc = other.post("/v1/sandboxes", json={})
            assert rc.status_code == 201 and rc.headers.get("X-AgentBox-Pool") == "claimed"
            print(f"claimed create: {(time.monotonic() - t) * 1000:.0f} ms")
            assert sh(other, rc.json()["id"], "echo ok") == "ok"


def test_a_killed_daemon_readopts_its_pool_members(pooled, tmp_path):
    before = wait_full(pooled)
    pids = {sid: vmm_pids_for(sid) for sid in before}
    pooled.proc.send_signal(signal.SIGKILL)
    pooled.proc.wait(30)
    port = int(pooled.url.rsplit(":", 1)[1])
    config = pooled.proc.args[pooled.proc.args.index("--config") + 1]
    d = start_daemon(pooled.data_dir, port=port, config=config)
    pooled.proc = d.proc  # the fixture stops this one
    assert wait_full(d) == before, "the same members, re-adopted (not replaced)"
    assert {sid: vmm_pids_for(sid) for sid in before} == pids
    with d.client() as c:
        r = c.post("/v1/sandboxes", json={})
        assert r.status_code == 201 and r.headers.get("X-AgentBox-Pool") == "claimed"
        assert r.json()["id"] in before
        assert sh(c, r.json()["id"], "echo ok") == "ok"
