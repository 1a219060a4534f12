"""Crash safety under chaos, with real VMs (issue 9).

The daemon is killed at the real steps of a wake and a suspend (fault points in
``vmctl/faults.py``: the daemon SIGKILLs itself there), and at random instants;
VMMs are killed; snapshot files are corrupted. Afterwards every write the API
acknowledged reads back with the same SHA-256, every sandbox answers, and no VMM
or namespace is left over. ``CHAOS_SECONDS`` sets the random part's length
(``make chaos`` runs it for 30 minutes).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Daemon, _free_port, start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e

CHAOS_SECONDS = float(os.environ.get("CHAOS_SECONDS", "100"))


# -- helpers ---------------------------------------------------------------------------------

def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(c: httpx.Client, sid: str, ledger: dict, path: str, size: int = 200_000) -> None:
    data = os.urandom(size)
    r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=data)
    assert r.status_code == 201, r.text
    ledger[(sid, path)] = sha(data)


def check_ledger(c: httpx.Client, ledger: dict) -> None:
    for (sid, path), digest in ledger.items():
        r = c.get(f"/v1/sandboxes/{sid}/files{path}")
        assert r.status_code == 200, (sid, path, r.text)
        assert sha(r.content) == digest, f"acknowledged write {sid}:{path} changed"


def sh(c: httpx.Client, sid: str, command: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": command})
    assert r.status_code == 200, r.text
    return r.json()["stdout"]


def info(c: httpx.Client, sid: str) -> dict:
    return c.get(f"/v1/sandboxes/{sid}").json()


def kill_vmm(sid: str) -> None:
    for pid in vmm_pids_for(sid):
        os.kill(pid, signal.SIGKILL)


def transitions(data: Path, sid: str) -> list[tuple[str, str]]:
    db = sqlite3.connect(f"file:{data}/registry.sqlite?mode=ro", uri=True, timeout=5)
    try:
        return list(db.execute("SELECT event, cause FROM transitions WHERE sandbox_id = ? "
                               "ORDER BY seq", (sid,)))
    finally:
        db.close()


def crash_at(d: Daemon, data: Path, port: int, point: str, action) -> None:
    """Restart the daemon with ``point`` armed, run ``action``: the daemon dies there."""
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    armed = start_daemon(data, port=port, env={"AGENTBOX_FAULTS": f"{point}=1"})
    with armed.client() as c:
        try:
            action(c)
        except httpx.HTTPError:
            pass
    assert armed.proc.wait(60) == -signal.SIGKILL, f"the daemon did not die at {point}"


def keep_vm_logs(data: Path, ids: list[str], dest: Path) -> None:
    """Copy each sandbox's VMM and console logs out before cleanup deletes them (a failure
    is diagnosed from them: why a VMM died, what its guest printed)."""
    for sid in ids:
        for log in (data / "sandboxes" / sid / "vm").glob("*.log*"):
            (dest / sid).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, dest / sid / log.name)


def restart(data: Path, port: int, armed: bool, kills: Counter) -> Daemon:
    """Start the daemon again. Armed, it may die at a fault point during its own start-up
    (recovery finishing a restore reaches the restore points): that counts as a kill, and
    it is started again, until one start gets through."""
    while True:
        try:
            return start_daemon(data, port=port, env={"AGENTBOX_FAULTS": FAULTS if armed else ""})
        except RuntimeError as exc:
            if not armed or "daemon exited" not in str(exc):
                raise
            kills["at_fault_point_startup"] += 1


def assert_no_leftovers(data: Path, ids: list[str]) -> None:
    assert vmm_pids_for(str(data)) == [], "VMM processes left behind"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [sid for sid in ids if f"agentbox-{sid}" in namespaces], namespaces


def cleanup(d: Daemon, data: Path, ids: list[str]) -> None:
    if d.proc.poll() is not None:  # a failure left no daemon: start one to delete through
        d = start_daemon(data, port=int(d.url.rsplit(":", 1)[1]))
    try:
        with d.client() as c:
            for sid in ids:
                c.delete(f"/v1/sandboxes/{sid}")
    finally:
        stop_daemon(d)
        leftovers = vmm_pids_for(str(data))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)


# -- kills at the real steps -------------------------------------------------------------------

def test_kill_at_each_real_step_of_wake_and_suspend(tmp_path, images_built):
    data, port = tmp_path / "steps", _free_port()
    d = start_daemon(data, port=port)
    ledger: dict = {}
    ids: list[str] = []
    try:
        with d.client() as c:
            a, b = ids[:] = [c.post("/v1/sandboxes", json={"idle_timeout": 0}).json()["id"]
                             for _ in range(2)]
            for sid in ids:
                put(c, sid, ledger, "/root/one")
            bg_a = sh(c, a, "setsid sleep 100000 >/dev/null 2>&1 & echo $!").strip()
            bg_b = sh(c, b, "setsid sleep 100000 >/dev/null 2>&1 & echo $!").strip()
            c.post(f"/v1/sandboxes/{a}/suspend").raise_for_status()
        exec_a = lambda c: c.post(f"/v1/sandboxes/{a}/execute", json={"command": "true"})  # noqa: E731
        suspend_b = lambda c: c.post(f"/v1/sandboxes/{b}/suspend")  # noqa: E731

        # 1. Snapshot marked consumed, guest not yet running: the VMM is adopted and finished.
        crash_at(d, data, port, "restore.before_cont", exec_a)
        assert vmm_pids_for(a), "the restoring VMM must outlive the daemon"
        d = start_daemon(data, port=port)
        with d.client() as c:
            assert info(c, a)["state"] == "running"
            assert sh(c, a, f"kill -0 {bg_a} && echo alive") == "alive\n"  # memory kept
            check_ledger(c, ledger)
            put(c, a, ledger, "/root/two")
            c.post(f"/v1/sandboxes/{a}/suspend").raise_for_status()

        # 2. The reported bug: the guest ran from the snapshot, then daemon and VMM died.
        crash_at(d, data, port, "restore.resumed", exec_a)
        kill_vmm(a)
        d = start_daemon(data, port=port)
        with d.client() as c:
            got = info(c, a)
            assert got["state"] == "failed" and "/" not in got["failure"], got
            check_ledger(c, ledger)  # the first request cold-boots the disk
            assert sh(c, a, f"kill -0 {bg_a} 2>/dev/null || echo gone") == "gone\n"
            assert info(c, a)["state"] == "running"

        # 3. Killed while QEMU writes the snapshot: the paused VM is resumed.
        crash_at(d, data, port, "suspend.migrating", suspend_b)
        d = start_daemon(data, port=port)
        with d.client() as c:
            assert info(c, b)["state"] == "running"
            assert sh(c, b, f"kill -0 {bg_b} && echo alive") == "alive\n"
            check_ledger(c, ledger)
            put(c, b, ledger, "/root/three")

        # 4. Killed after the snapshot was complete, before the VMM stopped: suspended.
        crash_at(d, data, port, "suspend.written", suspend_b)
        d = start_daemon(data, port=port)
        with d.client() as c:
            assert info(c, b)["state"] == "suspended" and vmm_pids_for(b) == []
            assert sh(c, b, f"kill -0 {bg_b} && echo alive") == "alive\n"  # a real wake
            check_ledger(c, ledger)
            c.post(f"/v1/sandboxes/{a}/suspend").raise_for_status()

        # 5. Killed while QEMU loads the device state, VMM killed too: the snapshot is
        #    intact (the guest never ran), so the sandbox stays suspended and wakes normally.
        crash_at(d, data, port, "restore.loading", exec_a)
        kill_vmm(a)
        d = start_daemon(data, port=port)
        with d.client() as c:
            assert info(c, a)["state"] == "suspended"
            check_ledger(c, ledger)
            assert transitions(data, a)[-1] == ("restored", "restored snapshot")
    finally:
        cleanup(d, data, ids)
    assert_no_leftovers(data, ids)


# -- a VMM that dies, snapshots that rot --------------------------------------------------------

def test_vmm_killed_under_a_request_is_answered_at_once_then_cold_booted(api, daemon, sandbox):
    sid, ledger = sandbox["id"], {}
    put(api, sid, ledger, "/root/kept")
    result: dict = {}

    def long_exec():
        with daemon.client() as c:
            t0 = time.monotonic()
            r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "sleep 120"})
            result.update(status=r.status_code, body=r.json(), s=time.monotonic() - t0,
                          retry=r.headers.get("Retry-After"))

    t = threading.Thread(target=long_exec)
    t.start()
    time.sleep(2)
    kill_vmm(sid)
    t.join(30)
    assert result["status"] == 503 and result["body"]["error"]["code"] == "sandbox_crashed"
    assert result["retry"] and result["s"] < 10, result
    got = info(api, sid)
    assert got["state"] == "failed" and got["failure"] == "VMM exited unexpectedly"
    check_ledger(api, ledger)  # cold boot of its disk
    assert info(api, sid)["state"] == "running"


def _wait_sealed(snapshot: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        manifest = json.loads((snapshot / "manifest.json").read_text())
        if "sha256" in manifest["files"]["memory"]:
            return
        time.sleep(0.2)
    raise AssertionError("the memory file was never sealed")


def _flip(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    fd = os.open(path, os.O_RDWR)
    try:
        offset = os.lseek(fd, 64 << 20, os.SEEK_DATA)  # a page that holds data (sparse file)
        old = os.pread(fd, 64, offset)
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("silent", [False, True], ids=["written", "silent-bitrot"])
def test_corrupted_memory_file_is_detected_and_the_sandbox_cold_boots_with_its_files(
        api, daemon, sandbox, silent):
    sid, ledger = sandbox["id"], {}
    put(api, sid, ledger, "/root/kept")
    bg = sh(api, sid, "setsid sleep 100000 >/dev/null 2>&1 & echo $!").strip()
    api.post(f"/v1/sandboxes/{sid}/suspend").raise_for_status()
    root = daemon.data_dir / "sandboxes" / sid
    if silent:  # same size and mtime: only the SHA-256 (sealed after the suspend) can tell
        _wait_sealed(root / "snapshot")
    _flip(root / "memory", keep_mtime=silent)
    r = api.post(f"/v1/sandboxes/{sid}/execute",
                 json={"command": f"kill -0 {bg} 2>/dev/null || echo cold"})
    assert r.status_code == 200 and r.json()["stdout"] == "cold\n", r.text
    check_ledger(api, ledger)
    events = [e for e, _ in transitions(daemon.data_dir, sid)]
    assert events[-3:] == ["snapshot_lost", "wake", "restored"], events
    cause = transitions(daemon.data_dir, sid)[-3][1]
    assert ("SHA256" if silent else "changed since the snapshot") in cause, cause


# -- random chaos -------------------------------------------------------------------------------

FAULTS = ("restore.before_cont=0.3,restore.resumed=0.3,suspend.migrating=0.3,"
          "suspend.written=0.3,restore.loading=0.2")


class Chaos:
    """Workers issue random requests; the conductor kills things at random instants."""

    def __init__(self, data: Path, port: int, ids: list[str], seed: int) -> None:
        self.data, self.port, self.ids = data, port, ids
        self.rnd = random.Random(seed)
        self.ledger: dict = {}
        self.lock = threading.Lock()
        self.stats: Counter = Counter()
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.url = f"http://127.0.0.1:{port}"
        self.key = ""

    def worker(self, n: int) -> None:
        rnd = random.Random(n)
        while not self.stop.is_set():
            sid = rnd.choice(self.ids)
            op = rnd.choice(("upload", "upload", "read", "execute", "suspend"))
            try:
                with httpx.Client(base_url=self.url, timeout=60,
                                  headers={"Authorization": f"Bearer {self.key}"}) as c:
                    self._one(c, rnd, sid, op, n)
            except httpx.HTTPError:
                self.stats["connection_errors"] += 1  # the daemon is down: nothing acknowledged
                time.sleep(0.3)

    def _one(self, c: httpx.Client, rnd: random.Random, sid: str, op: str, n: int) -> None:
        self.stats["requests"] += 1
        if op == "upload":
            data = rnd.randbytes(rnd.choice((1_000, 100_000, 1_000_000)))
            path = f"/root/chaos-{n}-{self.stats['requests']}"
            r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=data)
            if r.status_code == 201:
                with self.lock:
                    self.ledger[(sid, path)] = sha(data)
        elif op == "read":
            with self.lock:
                mine = [k for k in self.ledger if k[0] == sid]
                key = rnd.choice(mine) if mine else None
                digest = self.ledger.get(key) if key else None
            if key is None:
                return
            r = c.get(f"/v1/sandboxes/{sid}/files{key[1]}")
            if r.status_code == 200 and sha(r.content) != digest:
                self.errors.append(f"LOST WRITE {key}")
        elif op == "execute":
            r = c.post(f"/v1/sandboxes/{sid}/execute", json={"command": "echo ok"})
            if r.status_code == 200 and r.json()["stdout"] != "ok\n":
                self.errors.append(f"bad execute answer {r.text}")
        else:
            r = c.post(f"/v1/sandboxes/{sid}/suspend")
        self._judge(r, op)

    def _judge(self, r: httpx.Response, op: str) -> None:
        self.stats[f"http_{r.status_code}"] += 1
        if r.status_code < 500 and r.status_code not in (400, 401, 404):
            return
        if r.status_code == 409 and op == "suspend":
            return
        if r.status_code == 503 and r.headers.get("Retry-After"):
            time.sleep(float(r.headers["Retry-After"]))  # a VM we killed: told to retry
            return
        self.errors.append(f"{op}: {r.status_code} {r.text[:300]}")


@pytest.mark.timeout(CHAOS_SECONDS + 900)  # the run itself, then restarts and checks
def test_random_chaos_loses_nothing(tmp_path, images_built):
    data, port = tmp_path / "chaos", _free_port()
    d = start_daemon(data, port=port)
    ids: list[str] = []
    kills = Counter()
    try:
        with d.client() as c:
            ids[:] = [c.post("/v1/sandboxes", json={"idle_timeout": 2}).json()["id"]
                      for _ in range(3)]
        chaos = Chaos(data, port, ids, seed=int(os.environ.get("CHAOS_SEED", "1")))
        chaos.key = d.admin_key
        workers = [threading.Thread(target=chaos.worker, args=(n,)) for n in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + CHAOS_SECONDS
        rnd = chaos.rnd
        try:
            while time.monotonic() < deadline:
                end = time.monotonic() + rnd.uniform(4, 10)
                while time.monotonic() < end and d.proc.poll() is None:
                    time.sleep(0.1)
                if d.proc.poll() is not None:  # died at an armed fault point
                    kills["at_fault_point"] += 1
                else:
                    action = rnd.choice(("kill_daemon", "kill_daemon", "kill_vmm"))
                    if action == "kill_vmm":
                        kills["vmm"] += 1
                        kill_vmm(rnd.choice(ids))
                        continue
                    kills["daemon_random"] += 1
                    d.proc.send_signal(signal.SIGKILL)
                    d.proc.wait()
                d = restart(data, port, rnd.random() < 0.5, kills)
        finally:
            chaos.stop.set()
            for w in workers:
                w.join(120)
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
        d = start_daemon(data, port=port)  # unarmed, for the final checks
        with d.client() as c:
            for sid in ids:
                assert sh(c, sid, "echo ok") == "ok\n"
            check_ledger(c, chaos.ledger)
            running = [sid for sid in ids if info(c, sid)["state"] == "running"]
            assert sorted(vmm_pids_for(str(data))) == sorted(
                p for sid in running for p in vmm_pids_for(sid)), "orphan VMMs"
            assert all(len(vmm_pids_for(sid)) == 1 for sid in running)
            restores = sum(info(c, sid)["restore_count"] for sid in ids)
            events = Counter(e for sid in ids for e, _ in transitions(data, sid))
        print(f"\nchaos {CHAOS_SECONDS:.0f}s: kills={dict(kills)} stats={dict(chaos.stats)} "
              f"acknowledged_writes={len(chaos.ledger)} restores={restores} "
              f"snapshot_lost={events['snapshot_lost']} crashed={events['crashed']} lost=0")
        assert chaos.errors == []
        assert sum(kills.values()) >= 3
    finally:
        keep_vm_logs(data, ids, tmp_path / "vm-logs")
        cleanup(d, data, ids)
    assert_no_leftovers(data, ids)
