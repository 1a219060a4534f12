"""Pause before snapshot with real VMs (issue 12, part 2): an idle sandbox is PAUSED (its VMM
alive, using no CPU), a request wakes it with its state, after the second timeout it is
snapshotted and its VMM is gone, and a daemon killed while a sandbox is paused re-adopts it.

Its own daemon: the suite's config snapshots idle sandboxes at once (suspend_after_pause = 0).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import CONFIG, start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e

PAUSED_FOR = 12  # suspend_after_pause of this daemon (s)
IDLE = 2  # the sandboxes' idle_timeout (s)
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def pausing(images_built, tmp_path_factory):
    root = tmp_path_factory.mktemp("pause")
    config = root / "agentbox-pause.toml"
    text = CONFIG.read_text()
    assert "suspend_after_pause = 0" in text
    config.write_text(text.replace("suspend_after_pause = 0",
                                   f"suspend_after_pause = {PAUSED_FOR}\nmax_paused = 1"))
    holder = {"config": config, "data": root / "data"}
    holder["daemon"] = start_daemon(holder["data"], config=config)
    yield holder
    d = holder["daemon"]
    try:
        if d.proc.poll() is None:
            with d.client() as c:
                for sb in c.get("/v1/sandboxes").json()["sandboxes"]:
                    c.delete(f"/v1/sandboxes/{sb['id']}")
    finally:
        stop_daemon(d)
        leftovers = vmm_pids_for(str(holder["data"]))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"VMM processes left behind: {leftovers}"


def wait_state(c: httpx.Client, sid: str, state: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    got: dict = {}
    while time.monotonic() < deadline:
        got = c.get(f"/v1/sandboxes/{sid}").json()
        if got["state"] == state:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{sid} did not reach {state}: {got}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime, all threads


def cpu_over(pid: int, seconds: float = 1.0) -> float:
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return cpu_seconds(pid) - before


def suspend_cause(data: Path, sid: str) -> str:
    db = sqlite3.connect(f"file:{data / 'registry.sqlite'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT cause FROM transitions WHERE sandbox_id = ? AND event = "
                         "'suspend' ORDER BY seq DESC LIMIT 1", (sid,)).fetchone()
    finally:
        db.close()
    return row[0] if row else ""


def run_code(c: httpx.Client, sid: str, code: str) -> httpx.Response:
    r = c.post(f"/v1/sandboxes/{sid}/run_code", json={"code": code})
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    return r


def value(r: httpx.Response) -> str:
    return r.json()["results"][0]["text/plain"]


def test_idle_pauses_then_wakes_with_state_then_snapshots(pausing):
    with pausing["daemon"].client() as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout": 0}).json()["id"]
        run_code(c, sid, "x = 41")
        [pid] = vmm_pids_for(sid)
        running_cpu = cpu_over(pid)
        assert c.patch(f"/v1/sandboxes/{sid}", json={"idle_timeout": IDLE}).status_code == 200
        wait_state(c, sid, "paused", timeout=30)
        assert vmm_pids_for(sid) == [pid], "the paused sandbox's VMM must stay"
        paused_cpu = cpu_over(pid)
        print(f"VMM CPU over 1 s: running idle {running_cpu:.3f} s, paused {paused_cpu:.3f} s")
        assert paused_cpu <= 3 * TICK_S, (paused_cpu, running_cpu)
        time.sleep(2)  # the guest clock stands still while paused: the wake fixes it

        r = run_code(c, sid, "x += 1\nx")
        assert value(r) == "42"
        wake_ms = float(r.headers["X-AgentBox-Wake-Ms"])
        assert 0 < wake_ms < 2000
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert vmm_pids_for(sid) == [pid]
        guest = float(c.post(f"/v1/sandboxes/{sid}/execute",
                             json={"command": "date +%s.%N"}).json()["stdout"])
        assert abs(guest - time.time()) < 2.0

        paused_at = wait_state(c, sid, "paused", timeout=30)
        info = wait_state(c, sid, "suspended", timeout=PAUSED_FOR + 60)
        assert info["suspend_count"] == 1 and paused_at["suspend_count"] == 0
        assert vmm_pids_for(sid) == [], "a snapshotted sandbox keeps no VMM"
        assert value(run_code(c, sid, "x += 1\nx")) == "43"  # restored from its snapshot
        events = [t for t in c.get("/metrics").text.splitlines() if "unpause" in t]
        assert any(line.startswith('agentbox_events_total{event="unpause"} ') for line in events)
        c.delete(f"/v1/sandboxes/{sid}")


def test_daemon_killed_while_paused_readopts_the_paused_vmm(pausing):
    d = pausing["daemon"]
    with d.client() as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout": IDLE}).json()["id"]
        run_code(c, sid, "y = 'kept'")
        wait_state(c, sid, "paused", timeout=30)
    [pid] = vmm_pids_for(sid)
    stop_daemon(d, signal.SIGKILL)
    port = int(d.url.rsplit(":", 1)[1])
    d = pausing["daemon"] = start_daemon(pausing["data"], port=port, config=pausing["config"])
    with d.client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
        assert vmm_pids_for(sid) == [pid], "re-adopted, not restarted"
        assert cpu_over(pid) <= 3 * TICK_S  # still stopped
        r = run_code(c, sid, "y")
        assert value(r) == "'kept'" and "X-AgentBox-Wake-Ms" in r.headers
        assert vmm_pids_for(sid) == [pid]
        c.delete(f"/v1/sandboxes/{sid}")


def test_more_paused_than_max_paused_snapshots_the_longest_paused(pausing):
    with pausing["daemon"].client() as c:
        older = c.post("/v1/sandboxes", json={"idle_timeout": IDLE}).json()["id"]
        wait_state(c, older, "paused", timeout=30)
        newer = c.post("/v1/sandboxes", json={"idle_timeout": IDLE}).json()["id"]
        wait_state(c, newer, "paused", timeout=30)
        # max_paused = 1: the host takes the older one's RAM back, long before PAUSED_FOR.
        info = wait_state(c, older, "suspended", timeout=PAUSED_FOR + 30)
        assert info["suspend_count"] == 1 and vmm_pids_for(older) == []
        assert suspend_cause(pausing["data"], older) == \
            "more than 1 sandboxes paused on this host", "not its own pause timer"
        assert c.get(f"/v1/sandboxes/{newer}").json()["state"] == "paused"
        for sid in (older, newer):
            c.delete(f"/v1/sandboxes/{sid}")


def test_a_tenant_at_max_awake_gets_room_from_its_paused_sandbox(pausing):
    d = pausing["daemon"]
    with d.client() as admin:
        key = admin.post("/v1/keys", json={"name": "pause-room",
                                           "limits": {"max_awake": 1}}).json()
        with d.client(key["key"]) as c:
            try:
                first = c.post("/v1/sandboxes", json={"idle_timeout": IDLE}).json()["id"]
                run_code(c, first, "z = 7")
                wait_state(c, first, "paused", timeout=30)
                # One awake (paused) of one allowed: the create snapshots the paused one
                # first, even while its pause is still stopping the VM.
                r = c.post("/v1/sandboxes", json={"idle_timeout": 0})
                assert r.status_code == 201, r.text
                assert c.get(f"/v1/sandboxes/{first}").json()["state"] == "suspended"
                assert vmm_pids_for(first) == []
                # And the suspended one cannot wake while the other is awake (the quota holds).
                blocked = c.post(f"/v1/sandboxes/{first}/run_code", json={"code": "z"})
                assert blocked.status_code == 409, blocked.text
                c.delete(f"/v1/sandboxes/{r.json()['id']}")
                assert value(run_code(c, first, "z")) == "7"
            finally:  # the module's teardown lists only the admin's sandboxes
                for sb in c.get("/v1/sandboxes").json()["sandboxes"]:
                    c.delete(f"/v1/sandboxes/{sb['id']}")
        admin.delete(f"/v1/keys/{key['id']}")


def restart(pausing, faults: str = "") -> None:
    d = pausing["daemon"]
    if d.proc.poll() is None:
        stop_daemon(d, signal.SIGKILL)
    port = int(d.url.rsplit(":", 1)[1])
    pausing["daemon"] = start_daemon(pausing["data"], port=port, config=pausing["config"],
                                     env={"AGENTBOX_FAULTS": faults})


def test_daemon_killed_mid_pause_and_mid_wake_recovers_the_vm(pausing):
    with pausing["daemon"].client() as c:
        sid = c.post("/v1/sandboxes", json={"idle_timeout": 0}).json()["id"]
        run_code(c, sid, "w = 'kept'")
        [pid] = vmm_pids_for(sid)
    # 1. Killed after PAUSED is recorded, before the vCPUs stop.
    restart(pausing, "pause.before_stop=1")
    with pausing["daemon"].client() as c:
        c.patch(f"/v1/sandboxes/{sid}", json={"idle_timeout": IDLE})
    assert pausing["daemon"].proc.wait(60) == -signal.SIGKILL, "did not die at the pause"
    restart(pausing)
    with pausing["daemon"].client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
        assert vmm_pids_for(sid) == [pid] and cpu_over(pid) <= 3 * TICK_S  # stopped now
    # 2. Killed after RUNNING is recorded for a wake, before the `cont`.
    restart(pausing, "unpause.before_cont=1")
    with pausing["daemon"].client() as c:
        with pytest.raises(httpx.HTTPError):
            c.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "w"})
    assert pausing["daemon"].proc.wait(60) == -signal.SIGKILL, "did not die at the wake"
    restart(pausing)
    with pausing["daemon"].client() as c:
        c.patch(f"/v1/sandboxes/{sid}", json={"idle_timeout": 0})
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert vmm_pids_for(sid) == [pid], "continued, not restarted"
        assert value(run_code(c, sid, "w")) == "'kept'"
        guest = float(c.post(f"/v1/sandboxes/{sid}/execute",
                             json={"command": "date +%s.%N"}).json()["stdout"])
        assert abs(guest - time.time()) < 2.0  # the recovery's cont fixed the clock too
        c.delete(f"/v1/sandboxes/{sid}")
