"""Idle suspend, wake on request, and crash safety with real VMs (issue 3)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.conftest import vmm_pids_for

pytestmark = pytest.mark.e2e


def execute(api, sid, **body):
    r = api.post(f"/v1/sandboxes/{sid}/execute", json=body)
    assert r.status_code == 200, r.text
    return r


def wait_state(api, sid, state, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = api.get(f"/v1/sandboxes/{sid}").json()
        if got["state"] == state:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{sid} did not reach {state}: {got}")


def test_idle_suspend_and_wake_preserve_everything(api, sandbox):
    sid = sandbox["id"]
    execute(api, sid, command="echo kept > /root/state.txt")
    pid = execute(api, sid, command="setsid sleep 99999 >/dev/null 2>&1 & echo $!").json()
    bg_pid = pid["stdout"].strip()
    r = api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "x = 41\nimport random"})
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert api.patch(f"/v1/sandboxes/{sid}", json={"idle_timeout": 1}).json()["idle_timeout"] == 1

    for cycle in range(20):
        info = wait_state(api, sid, "suspended")
        assert vmm_pids_for(sid) == [], f"cycle {cycle}: VMM still running while suspended"
        assert info["suspend_count"] == cycle + 1
        r = execute(api, sid, command=f"cat /root/state.txt; kill -0 {bg_pid} && echo alive")
        assert r.json()["stdout"] == "kept\nalive\n", (cycle, r.json())
        assert float(r.headers["X-AgentBox-Wake-Ms"]) > 0
        code = api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "x += 1\nx"}).json()
        assert code["results"][0]["text/plain"] == str(42 + cycle), code
    info = api.get(f"/v1/sandboxes/{sid}").json()
    assert info["restore_count"] == 20 and info["last_restore_ms"] > 0
    assert info["last_suspend_ms"] > 0


def test_wake_corrects_the_guest_clock(api, sandbox):
    sid = sandbox["id"]
    api.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
    time.sleep(3)
    guest = float(execute(api, sid, command="date +%s.%N").json()["stdout"])
    assert abs(guest - time.time()) < 2.0


def test_explicit_suspend_resume_and_requests_while_suspended(api, sandbox):
    sid = sandbox["id"]
    r = api.post(f"/v1/sandboxes/{sid}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended"
    assert vmm_pids_for(sid) == []
    # GET does not wake it; a file read does.
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "suspended"
    r = api.get(f"/v1/sandboxes/{sid}/files/etc/hostname")
    assert r.status_code == 200 and "X-AgentBox-Wake-Ms" in r.headers
    api.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
    r = api.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running"
    assert len(vmm_pids_for(sid)) == 1


def test_concurrent_requests_to_a_sleeping_sandbox(api, daemon, sandbox):
    sid = sandbox["id"]
    api.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
    results: list[int] = []

    def one():
        with daemon.client() as c:
            results.append(c.post(f"/v1/sandboxes/{sid}/execute",
                                  json={"command": "echo ok"}).status_code)

    threads = [threading.Thread(target=one) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 30
    assert api.get(f"/v1/sandboxes/{sid}").json()["restore_count"] == 1
