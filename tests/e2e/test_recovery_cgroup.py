"""Start-up recovery kills a VMM a previous daemon left that it does not adopt, and removes
that VMM's cgroup with it (issue 24: the kill step left the cgroup behind until the next
restart, because the start-up sweep runs while the VMM still lives in it).

The daemon is SIGKILLed at the fault point ``suspend.written``: the sandbox's snapshot is
complete but its VMM still runs. The registry says SUSPENDING, so the next daemon's
recovery finds a live VMM and a usable snapshot, records the sandbox SUSPENDED and must
kill the VMM (``RECOVERY`` in gateway/sandbox/core.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import _free_port, start_daemon, stop_daemon, vmm_pids_for
from vmctl import cgroup
from vmctl.driver import pid_alive

pytestmark = pytest.mark.e2e


def _cgroup_dirs(pid: int, sid: str) -> list[Path]:
    """The VMM's own cgroup directories (one per v1 controller, or the v2 one)."""
    hierarchy = cgroup.Hierarchy.detect()
    groups = dict(line.split(":", 2)[1:] for line in
                  Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    keys = [""] if hierarchy is not None and hierarchy.version == 2 else list(cgroup.CONTROLLERS)
    paths = [groups.get(k, "") for k in keys]
    if hierarchy is None or not all(p.endswith(f"/{sid}") for p in paths):
        pytest.skip("VMMs run without a cgroup of their own here (confinement off)")
    root = hierarchy.root
    return [root / p.lstrip("/") if hierarchy.version == 2 else root / k / p.lstrip("/")
            for k, p in zip(keys, paths, strict=True)]


def _crash_during_suspend(d, data: Path, port: int, sid: str):  # type: ignore[no-untyped-def]
    """Restart the daemon armed at ``suspend.written`` and suspend: it dies there."""
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    armed = start_daemon(data, port=port, env={"AGENTBOX_FAULTS": "suspend.written=1"})
    with armed.client() as c:
        try:
            c.post(f"/v1/sandboxes/{sid}/suspend")
        except httpx.HTTPError:
            pass
    assert armed.proc.wait(60) == -signal.SIGKILL, "the daemon did not die at suspend.written"


def test_recovery_kill_removes_the_killed_vmms_cgroup(tmp_path, images_built):
    data, port = tmp_path / "data", _free_port()
    d = start_daemon(data, port=port)
    sid = ""
    try:
        with d.client() as c:
            r = c.post("/v1/sandboxes", json={"template": "python"})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
        [pid] = vmm_pids_for(sid)
        dirs = _cgroup_dirs(pid, sid)
        assert all(p.is_dir() for p in dirs), dirs

        _crash_during_suspend(d, data, port, sid)
        assert pid_alive(pid), "the suspended VMM must outlive the daemon killed mid-suspend"
        assert all(p.is_dir() for p in dirs)

        d = start_daemon(data, port=port)  # recovery runs before it answers /healthz
        with d.client() as c:
            assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "suspended"
        deadline = time.monotonic() + 5  # a killed VMM is reaped by init
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pid) and vmm_pids_for(sid) == []
        left = [p for p in dirs if p.exists()]
        assert not left, f"recovery killed the VMM but left its cgroup: {left}"
    finally:
        if d.proc.poll() is not None:
            d = start_daemon(data, port=port)
        try:
            if sid:
                with d.client() as c:
                    c.delete(f"/v1/sandboxes/{sid}")
        finally:
            stop_daemon(d)
            for leftover in vmm_pids_for(str(data)):
                os.kill(leftover, signal.SIGKILL)
