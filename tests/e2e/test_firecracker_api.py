"""The daemon with ``vmm = "firecracker"``: create, exec, files, suspend, wake, destroy.

Runs only on a host where Firecracker can run (the pinned release on PATH, a
normal KVM, the guest kernel built: docs/bare-metal.md); elsewhere every test
is skipped with the one-line reason. The daemon is started with
agentbox-firecracker-test.toml, so its golden snapshot is built (or reused) as
``golden-firecracker-kvm-<mem>M`` next to the QEMU ones.

Beyond what the generic suites check (``make test-firecracker`` also runs them
against a Firecracker daemon), this checks the Firecracker file layout: a raw
disk per sandbox, no memory copy at create, and a suspend that keeps state,
memory and a hard link of the disk.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Daemon, start_daemon, stop_daemon, vmm_pids_for
from tests.e2e.firecracker_env import firecracker_skip_reason

FC_CONFIG = Path(__file__).with_name("agentbox-firecracker-test.toml")
REASON = firecracker_skip_reason(FC_CONFIG)
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fc(images_built, tmp_path_factory) -> Daemon:
    d = start_daemon(tmp_path_factory.mktemp("agentbox-fc") / "data", config=FC_CONFIG)
    yield d
    try:
        with d.client() as client:
            for sb in client.get("/v1/sandboxes").json()["sandboxes"]:
                client.delete(f"/v1/sandboxes/{sb['id']}")
    finally:
        stop_daemon(d)
    assert vmm_pids_for(str(d.data_dir)) == [], "Firecracker processes left behind"


@pytest.fixture
def api(fc: Daemon) -> httpx.Client:
    with fc.client() as client:
        yield client


def run(api: httpx.Client, sid: str, **body) -> httpx.Response:
    r = api.post(f"/v1/sandboxes/{sid}/execute", json=body)
    assert r.status_code == 200, r.text
    return r


def test_the_daemon_runs_firecracker(api: httpx.Client) -> None:
    health = api.get("/healthz").json()
    assert (health["vmm"], health["accel"]) == ("firecracker", "kvm"), health


def test_create_exec_suspend_wake_destroy(api: httpx.Client, fc: Daemon) -> None:
    started = time.monotonic()
    r = api.post("/v1/sandboxes", json={"template": "python"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    root = fc.data_dir / "sandboxes" / sid
    # Restored from the golden snapshot: the guest has been up longer than the sandbox.
    uptime = float(run(api, sid, command="cut -d' ' -f1 /proc/uptime").json()["stdout"])
    assert uptime > time.monotonic() - started + 1
    assert (root / "disk").is_file() and not (root / "memory").exists()
    assert not (root / "disk.qcow2").exists()
    assert len(vmm_pids_for(sid)) == 1

    run(api, sid, command="echo kept > /root/state.txt")
    bg = run(api, sid, command="setsid sleep 99999 >/dev/null 2>&1 & echo $!").json()
    bg_pid = bg["stdout"].strip()
    code = api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "x = 41"})
    assert code.status_code == 200 and code.json()["error"] is None, code.text

    for cycle in range(3):
        r = api.post(f"/v1/sandboxes/{sid}/suspend")
        assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
        assert vmm_pids_for(sid) == []
        snap = root / "snapshot"
        assert {"vmstate", "memory", "disk", "manifest.json"} <= {p.name for p in snap.iterdir()}
        assert (snap / "disk").samefile(root / "disk")
        r = run(api, sid, command=f"cat /root/state.txt; kill -0 {bg_pid} && echo alive")
        assert r.json()["stdout"] == "kept\nalive\n", (cycle, r.json())
        assert float(r.headers["X-AgentBox-Wake-Ms"]) > 0
        assert not snap.exists()
        value = api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "x += 1\nx"}).json()
        assert value["results"][0]["text/plain"] == str(42 + cycle), value
    guest = float(run(api, sid, command="date +%s.%N").json()["stdout"])
    assert abs(guest - time.time()) < 2.0

    assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert vmm_pids_for(sid) == [] and not root.exists()


def test_sandboxes_from_one_golden_snapshot_are_independent(api: httpx.Client) -> None:
    ids = [api.post("/v1/sandboxes", json={}).json()["id"] for _ in range(2)]
    try:
        for sid in ids:
            run(api, sid, command=f"echo {sid} > /root/me")
        for sid in ids:
            assert run(api, sid, command="cat /root/me").json()["stdout"] == f"{sid}\n"
        api.post(f"/v1/sandboxes/{ids[0]}/suspend").raise_for_status()
        assert run(api, ids[1], command="cat /root/me").json()["stdout"] == f"{ids[1]}\n"
        assert run(api, ids[0], command="cat /root/me").json()["stdout"] == f"{ids[0]}\n"
    finally:
        for sid in ids:
            api.delete(f"/v1/sandboxes/{sid}")
