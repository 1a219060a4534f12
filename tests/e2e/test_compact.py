"""Compact memory snapshots with real VMs (issue 12): a sleeping sandbox's memory is
stored as its diff from the golden, and a wake rebuilds it with everything intact, also
after the daemon was killed in the middle of compacting or of rebuilding."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.sandbox.service import tree_bytes
from tests.e2e.conftest import CONFIG, running_daemon, start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e

MIB = 1 << 20


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    text = CONFIG.read_text()
    assert "\n[vm]\n" in text and 'pool = "169.254.64.0/18"' in text
    path = tmp_path_factory.mktemp("compact") / "agentbox.toml"
    # Its own address pool: other test daemons on this host use the shared one.
    text = text.replace('pool = "169.254.64.0/18"', 'pool = "169.254.12.0/22"')
    path.write_text(text.replace("\n[vm]\n", "\n[vm]\ncompact_after = 0\n"))
    return path


def _ok(resp):
    assert resp.status_code < 300, resp.text
    return resp.json()


def _prepare(api) -> tuple[str, str, str]:
    """A sandbox with a file, a background process and an interpreter variable, asleep."""
    sid = _ok(api.post("/v1/sandboxes", json={"template": "python"}))["id"]
    blob = os.urandom(3 * MIB)
    _ok(api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/blob.bin"}, content=blob))
    pid = _ok(api.post(f"/v1/sandboxes/{sid}/execute", json={
        "command": "setsid sleep 99999 >/dev/null 2>&1 & echo $!"}))["stdout"].strip()
    out = _ok(api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "kept = 6 * 7"}))
    assert out["error"] is None, out
    _ok(api.post(f"/v1/sandboxes/{sid}/suspend"))
    return sid, hashlib.sha256(blob).hexdigest(), pid


def _wait_compact(root: Path, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        manifest = root / "snapshot" / "manifest.json"
        if manifest.exists():
            entry = json.loads(manifest.read_text())["files"]["memory"]
            if "diff" in entry and not (root / "memory").exists():
                return entry
        time.sleep(0.2)
    raise AssertionError(f"{root} was never compacted")


def _check_intact(api, sid: str, digest: str, pid: str) -> None:
    got = api.get(f"/v1/sandboxes/{sid}/files/root/blob.bin")
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == digest
    alive = _ok(api.post(f"/v1/sandboxes/{sid}/execute", json={"command": f"kill -0 {pid}"}))
    assert alive["exit_code"] == 0, alive
    out = _ok(api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": "print(kept)"}))
    assert out["stdout"] == "42\n" and out["error"] is None, out


def test_a_compacted_sandbox_wakes_with_everything(config, tmp_path) -> None:
    with running_daemon(tmp_path / "data", config=config) as d, d.client() as api:
        sid, digest, pid = _prepare(api)
        root = d.data_dir / "sandboxes" / sid
        entry = _wait_compact(root)
        assert entry["diff"]["size"] < 40 * MIB, entry
        assert tree_bytes(root) < 40 * MIB
        # After the compaction, a spare copy of the golden's memory (vm.ram_spares) ...
        spares = d.data_dir / "sandboxes" / ".ram-spares"
        deadline = time.monotonic() + 60
        while not list(spares.glob("*/*.ram")) and time.monotonic() < deadline:
            time.sleep(0.2)
        [spare] = spares.glob("*/*.ram")
        inode = spare.stat().st_ino
        _check_intact(api, sid, digest, pid)
        # ... became the sandbox's RAM file: the wake wrote only the diff into it.
        assert (root / "memory").stat().st_ino == inode and not list(spares.glob("*/*.ram"))
        assert not (root / "snapshot").exists()  # the wake consumed and dropped it
        # The wake refills it (machine.REFILL_DELAY later), for the next compact wake.
        deadline = time.monotonic() + 90
        while not list(spares.glob("*/*.ram")) and time.monotonic() < deadline:
            time.sleep(0.5)
        [refilled] = spares.glob("*/*.ram")
        assert refilled.stat().st_ino != inode
        # A second cycle: the rebuilt memory file is the sandbox's RAM again.
        _ok(api.post(f"/v1/sandboxes/{sid}/suspend"))
        _wait_compact(root)
        _check_intact(api, sid, digest, pid)


def _prepared_then_stopped(data: Path, config: Path,
                           compact: bool) -> tuple[str, str, str, Path, dict | None]:
    """A sandbox prepared (``_prepare``) by a daemon that is then stopped, with
    ``compact`` once its snapshot is compact: (sid, digest, pid, root, memory entry)."""
    plain = start_daemon(data, config=config)
    try:
        with plain.client() as api:
            sid, digest, pid = _prepare(api)
        root = data / "sandboxes" / sid
        entry = _wait_compact(root) if compact else None
    finally:
        stop_daemon(plain)
    return sid, digest, pid, root, entry


def _die_at(data: Path, config: Path, point: str,
            provoke: Callable[[httpx.Client], None]) -> None:
    """Start a daemon armed to kill itself at fault ``point``, ``provoke(api)`` it, and
    check that it died there."""
    armed = start_daemon(data, config=config, env={"AGENTBOX_FAULTS": f"{point}=1"})
    try:
        with armed.client() as api:
            provoke(api)
        armed.proc.wait(120)
        assert armed.proc.returncode == -signal.SIGKILL, armed.log_tail()
    finally:
        stop_daemon(armed)


def _wake_under_a_dying_daemon(api: httpx.Client, sid: str) -> None:
    with pytest.raises(httpx.TransportError):  # the daemon died under it
        api.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})


@pytest.mark.parametrize("point", ["compact.recorded", "expand.rebuilt"])
def test_daemon_killed_while_compacting_or_rebuilding(config, tmp_path, point) -> None:
    data = tmp_path / "data"
    sid, digest, pid, root, _ = _prepared_then_stopped(data, config,
                                                       compact=point == "expand.rebuilt")

    # The armed daemon dies at the point: while compacting (at start-up nothing compacts,
    # so arm it and suspend again) or while a wake rebuilds the memory.
    def provoke(api: httpx.Client) -> None:
        if point == "compact.recorded":
            _ok(api.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"}))
            _ok(api.post(f"/v1/sandboxes/{sid}/suspend"))
        else:
            _wake_under_a_dying_daemon(api, sid)

    _die_at(data, config, point, provoke)
    manifest = json.loads((root / "snapshot" / "manifest.json").read_text())
    assert "diff" in manifest["files"]["memory"]  # died in the middle, as intended
    with running_daemon(data, config=config) as d, d.client() as api:
        _check_intact(api, sid, digest, pid)
    assert not vmm_pids_for(str(data))


def test_daemon_killed_while_the_early_vmm_waits_for_the_rebuild(config, tmp_path) -> None:
    """A wake starts QEMU (-incoming defer) while it rebuilds the memory in place; the
    daemon dies in that window (``restore.waiting``: QEMU up and not yet recorded). The
    QEMU must not outlive the next start-up, and the memory file, rebuilt again from
    whatever the dead rebuild left, must be the suspended RAM byte for byte."""
    data = tmp_path / "data"
    sid, digest, pid, root, entry = _prepared_then_stopped(data, config, compact=True)
    sealed = entry["sha256"]  # the whole RAM file's, hashed at suspend
    _die_at(data, config, "restore.waiting", lambda api: _wake_under_a_dying_daemon(api, sid))
    orphans = vmm_pids_for(str(data))
    assert orphans, "the early QEMU should have been up when the daemon died"
    assert (root / "memory").exists()  # prepared at its final path before QEMU started
    recovering = start_daemon(data, config=config)  # (its sandboxes stay: no running_daemon)
    try:
        assert not vmm_pids_for(str(data)), "start-up recovery kills the unrecorded QEMU"
        with recovering.client() as api:
            assert _ok(api.get(f"/v1/sandboxes/{sid}"))["state"] == "suspended"
    finally:
        stop_daemon(recovering)
    snapshot = root / "snapshot"
    from vmctl import store  # as the next wake does: from scratch over what is there
    store.expand_memory(snapshot)
    assert "diff" not in json.loads((snapshot / "manifest.json").read_text())["files"]["memory"]
    assert hashlib.sha256((root / "memory").read_bytes()).hexdigest() == sealed
    with running_daemon(data, config=config) as d, d.client() as api:
        _check_intact(api, sid, digest, pid)
    assert not vmm_pids_for(str(data))
