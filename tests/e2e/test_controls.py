"""Per-sandbox controls with real VMs (issue 13, parts 3-6): lifetimes (ttl and
auto_delete_after, also across a daemon killed before the deadline and restarted after it),
list filters and paging (API, SDK, CLI), usage metering (a measured awake time in, matching
seconds out, across a daemon restart too), and a sandbox's own metrics and logs."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.conftest import REPO, _free_port, start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e
SCAN_SLACK = 15.0  # the expiry scan runs once a second; destroying a VM takes a few on TCG


def create(api: httpx.Client, **body) -> dict:
    r = api.post("/v1/sandboxes", json={"template": "python", **body})
    assert r.status_code == 201, r.text
    return r.json()


def wait_gone(api: httpx.Client, sid: str, deadline: float) -> float:
    """Poll until GET says 404; returns when it was first seen gone."""
    while time.time() < deadline:
        r = api.get(f"/v1/sandboxes/{sid}")
        if r.status_code == 404:
            return time.time()
        assert r.status_code == 200, r.text
        time.sleep(0.5)
    raise AssertionError(f"sandbox {sid} still exists: {api.get(f'/v1/sandboxes/{sid}').text}")


# -- lifetimes ----------------------------------------------------------------------------------

def test_a_ttl_sandbox_is_destroyed_after_its_ttl_and_patch_extends_it(api):
    sb = create(api, ttl=30)
    sid = sb["id"]
    try:
        assert sb["expires_at"] == pytest.approx(sb["created_at"] + 30, abs=1)
        assert vmm_pids_for(sid), "no VMM for a running sandbox"
        before = time.time()
        r = api.patch(f"/v1/sandboxes/{sid}", json={"ttl": 20})  # 20 s from now
        assert r.status_code == 200, r.text
        expires = r.json()["expires_at"]
        assert expires == pytest.approx(before + 20, abs=2)
        assert api.get(f"/v1/sandboxes/{sid}").json()["expires_at"] == expires
        time.sleep(max(0.0, expires - time.time() - 3))
        assert api.get(f"/v1/sandboxes/{sid}").status_code == 200, "destroyed before its ttl"
        gone = wait_gone(api, sid, expires + SCAN_SLACK)
        assert gone >= expires
        assert vmm_pids_for(sid) == [], "the VMM of an expired sandbox is still running"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_auto_delete_after_deletes_a_suspended_sandbox_and_metrics_and_logs(api):
    sb = create(api, auto_delete_after=8, idle_timeout=0)
    sid, p = sb["id"], f"/v1/sandboxes/{sb['id']}"
    try:
        assert sb["auto_delete_after"] == 8 and sb["delete_at"] is None  # awake: no deadline
        marker = "console-marker-" + secrets.token_hex(4)
        r = api.post(p + "/execute", json={
            "command": f"echo {marker} > /dev/console; python3 -c 'sum(range(3*10**6))'"})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        _check_metrics_and_logs(api, p, marker)
        time.sleep(12)  # awake longer than auto_delete_after: awake time does not count
        assert api.get(p).status_code == 200
        r = api.post(p + "/suspend")
        assert r.status_code == 200, r.text
        suspended_at = time.time()
        info = api.get(p).json()
        assert info["state"] == "suspended"
        assert info["delete_at"] == pytest.approx(suspended_at + 8, abs=3)
        m = api.get(p + "/metrics").json()  # read on the host: does not wake it
        assert m["state"] == "suspended" and m["cpu_seconds"] is None and m["disk_bytes"] > 0
        assert api.get(p).json()["state"] == "suspended"
        gone = wait_gone(api, sid, info["delete_at"] + SCAN_SLACK)
        assert gone >= info["delete_at"] - 0.5
    finally:
        api.delete(p)


def _check_metrics_and_logs(api: httpx.Client, p: str, marker: str) -> None:
    m = api.get(p + "/metrics")
    assert m.status_code == 200, m.text
    m = m.json()
    assert m["state"] == "running" and m["vmm_pid"] in vmm_pids_for(m["sandbox_id"])
    assert m["cpu_seconds"] > 0.5, m  # booting/restoring and 3M additions under TCG
    assert 64 << 20 < m["memory_bytes"] < 4 << 30, m
    assert m["disk_bytes"] > 1 << 20, m
    time.sleep(1)
    again = api.get(p + "/metrics").json()
    assert again["cpu_seconds"] >= m["cpu_seconds"]
    r = api.get(p + "/logs", params={"tail": 50})
    assert r.status_code == 200, r.text
    logs = r.json()
    assert any(marker in line for line in logs["console"]), logs["console"][-10:]
    assert len(logs["console"]) <= 50
    assert [e["event"] for e in logs["events"]][:2] == ["insert", "created"]
    assert api.get(p + "/logs", params={"tail": "99999"}).status_code == 400
    assert api.get(p + "/logs", params={"tail": 0}).json()["console"] == []


# -- listing ----------------------------------------------------------------------------------

def test_list_filters_and_paging_return_exactly_the_right_sets(api, daemon):
    run = secrets.token_hex(4)
    made = [create(api, metadata={"run": run, "user": user, "n": n})
            for n, user in enumerate(("alice", "bob", "alice"))]
    ids = [s["id"] for s in made]
    try:
        assert api.post(f"/v1/sandboxes/{ids[1]}/suspend").status_code == 200

        def listed(**params) -> list[str]:
            r = api.get("/v1/sandboxes", params={"metadata.run": run, **params})
            assert r.status_code == 200, r.text
            return [s["id"] for s in r.json()["sandboxes"]]

        assert listed() == ids  # oldest first
        assert listed(**{"metadata.user": "alice"}) == [ids[0], ids[2]]
        assert listed(**{"metadata.user": "alice", "metadata.n": "2"}) == [ids[2]]
        assert listed(state="suspended") == [ids[1]]
        assert listed(state="running") == [ids[0], ids[2]]
        assert listed(state="running,suspended", template="python") == ids
        assert listed(template="python-datascience") == []
        assert listed(**{"metadata.user": "carol"}) == []
        # paging: one at a time, stable order, no repeats, the last page says so
        seen, cursor = [], None
        for _ in range(5):
            params = {"metadata.run": run, "limit": 1} | ({"cursor": cursor} if cursor else {})
            page = api.get("/v1/sandboxes", params=params).json()
            seen += [s["id"] for s in page["sandboxes"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids
        page = api.get("/v1/sandboxes", params={"metadata.run": run, "limit": 2}).json()
        assert [s["id"] for s in page["sandboxes"]] == ids[:2] and page["next_cursor"]
        assert api.get("/v1/sandboxes", params={"cursor": "garbage!"}).status_code == 400
        assert api.get("/v1/sandboxes", params={"limit": 0}).status_code == 400
        assert api.get("/v1/sandboxes", params={"state": "sleepy"}).status_code == 400
        _sdk_and_cli_list(daemon, run, ids)
    finally:
        for sid in ids:
            api.delete(f"/v1/sandboxes/{sid}")


def _sdk_and_cli_list(daemon, run: str, ids: list[str]) -> None:
    from agentbox import AgentBox

    with AgentBox(api_key=daemon.admin_key, base_url=daemon.url) as box:
        assert [s.id for s in box.list(metadata={"run": run})] == ids
        assert [s.id for s in box.list(metadata={"run": run, "user": "alice"})] == [ids[0],
                                                                                    ids[2]]
        assert [s.id for s in box.list(state="suspended", metadata={"run": run})] == [ids[1]]
        assert [s.id for s in box.list(metadata={"run": run, "n": 1})] == [ids[1]]
        assert [s.id for s in box.list(metadata={"run": run}, limit=2)] == ids[:2]
        assert [s.id for s in box.iter_sandboxes(metadata={"run": run}, page_size=1)] == ids
        page = box.list_page(metadata={"run": run}, limit=2)
        assert page.next_cursor and len(page.sandboxes) == 2
    env = {**os.environ, "AGENTBOX_URL": daemon.url, "AGENTBOX_API_KEY": daemon.admin_key,
           "PYTHONPATH": f"{REPO}/sdk/python"}
    out = subprocess.run([sys.executable, "-m", "agentbox", "ls", "--json", "--state",
                          "running", "--metadata", f"run={run}", "--metadata", "user=alice"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [s["id"] for s in json.loads(out.stdout)] == [ids[0], ids[2]]


# -- across a daemon restart: ttl and usage ---------------------------------------------------

def test_ttl_and_usage_survive_a_daemon_killed_and_restarted(tmp_path, images_built):
    data, port = tmp_path / "restart", _free_port()
    d = start_daemon(data, port=port)
    ids: list[str] = []
    try:
        with d.client() as c:
            short = create(c, ttl=45)
            short_from = time.time()
            ids.append(short["id"])
            metered = create(c, idle_timeout=0)
            awake_from = time.time()  # it was recorded RUNNING just before this answer
            ids.append(metered["id"])
        time.sleep(3)  # a few heartbeats
        d.proc.send_signal(signal.SIGKILL)  # before the ttl; its VMMs keep running
        d.proc.wait()
        killed_at = time.time()
        assert vmm_pids_for(short["id"]), "the VMM should outlive the daemon"
        for pid in vmm_pids_for(short["id"]):  # ...but this one dies while nobody watches
            os.kill(pid, signal.SIGKILL)
        time.sleep(max(0.0, short["expires_at"] - time.time() + 3))  # the ttl passes while down
        d = start_daemon(data, port=port)
        with d.client() as c:
            wait_gone(c, short["id"], time.time() + 30 + SCAN_SLACK)
            assert vmm_pids_for(short["id"]) == []
            time.sleep(5)
            awake_to = time.time()
            assert c.post(f"/v1/sandboxes/{metered['id']}/suspend").status_code == 200
            _check_usage(c, d, metered["id"], awake_to - awake_from)
            # found dead by recovery: charged up to the killed daemon's last heartbeat, not
            # for the downtime (> 45 s)
            usage = c.get("/v1/usage").json()
            dead = {s["sandbox_id"]: s for k in usage["keys"] for s in k["sandboxes"]}[short["id"]]
            print(f"usage: crashed sandbox awake {killed_at - short_from:.2f}s until the daemon "
                  f"was killed, {dead['awake_seconds']:.2f}s metered")
            assert dead["awake_seconds"] == pytest.approx(killed_at - short_from, abs=3)
            assert dead["destroyed"] == 1
    finally:
        _cleanup(d, data, port, ids)


def _check_usage(c: httpx.Client, d, sid: str, awake: float) -> None:
    assert awake > 45
    time.sleep(4)  # suspended a while; the snapshot gets measured
    usage = c.get("/v1/usage").json()
    mine = {s["sandbox_id"]: s for k in usage["keys"] for s in k["sandboxes"]}[sid]
    assert mine["awake_seconds"] == pytest.approx(awake, rel=0.05), (mine, awake)
    print(f"\nusage: awake {awake:.2f}s measured by the client, {mine['awake_seconds']:.2f}s "
          f"metered ({(mine['awake_seconds'] / awake - 1) * 100:+.2f}%)")
    template = next(t for t in c.get("/v1/templates").json()["templates"]
                    if t["name"] == "python")
    assert mine["gib_seconds"] == pytest.approx(mine["awake_seconds"] * template["mem_mib"]
                                                / 1024, rel=1e-3)
    assert mine["vcpu_seconds"] >= mine["awake_seconds"]
    assert mine["created"] == 1 and mine["destroyed"] == 0 and mine["restores"] == 0
    assert mine["suspended_seconds"] > 2 and mine["snapshot_gib_hours"] > 0
    # a window before it existed holds nothing; the key's total holds both sandboxes
    early = c.get("/v1/usage", params={"from": 0, "to": 1000}).json()
    assert all(k["awake_seconds"] == 0 for k in early["keys"])
    key = usage["keys"][0]
    assert key["created"] == 2 and key["destroyed"] == 1
    text = c.get("/metrics").text
    assert f'agentbox_usage_vcpu_seconds_total{{key="{key["key"]}"}}' in text
    assert c.get("/v1/usage", params={"from": "x"}).status_code == 400


def _cleanup(d, data, port: int, ids: list[str]) -> None:
    if d.proc.poll() is not None:
        d = start_daemon(data, port=port)
    try:
        with d.client() as c:
            for sid in ids:
                c.delete(f"/v1/sandboxes/{sid}")
    finally:
        stop_daemon(d)
        leftovers = vmm_pids_for(str(data))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"VMM processes left behind: {leftovers}"
