"""The VMM boundary on real VMs: every QEMU is unprivileged, seccomp-filtered, chrooted
and in its own cgroup; one sandbox's uid cannot read another's files; a guest that
floods its console or bombs its own memory/CPU/pids leaves the host and the other
sandboxes alone (issue 10, part 1 and the hostile-guest rows of part 7)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import vmm_pids_for
from vmctl import cgroup

pytestmark = pytest.mark.e2e

CONSOLE_CAP = 65536  # tests/e2e/agentbox-test.toml: [vm] console_log_bytes


def run(api, sid, **body):
    r = api.post(f"/v1/sandboxes/{sid}/execute", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _vmm(sid: str) -> int:
    pids = vmm_pids_for(sid)
    assert len(pids) == 1, pids
    return pids[0]


def _rss_kib(pid: int) -> int:
    return int(_status(pid)["VmRSS"].split()[0])


@pytest.fixture
def two(api):
    ids = []
    for _ in range(2):
        r = api.post("/v1/sandboxes", json={"template": "python"})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    yield ids
    for sid in ids:
        api.delete(f"/v1/sandboxes/{sid}")


def test_each_vmm_is_unprivileged_seccomped_chrooted_and_in_its_own_cgroup(daemon, two):
    uids = set()
    for sid in two:
        pid = _vmm(sid)
        st = _status(pid)
        uid = int(st["Uid"].split()[0])
        assert uid != 0 and all(int(u) == uid for u in st["Uid"].split()), st["Uid"]
        assert all(int(g) == uid for g in st["Gid"].split()), st["Gid"]
        assert st["Seccomp"].strip() == "2"  # a filter, not just strict/none
        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0
        root = os.readlink(f"/proc/{pid}/root")
        assert root == str(daemon.data_dir / "sandboxes" / sid / "vm")
        owner = subprocess.run(["ip", "netns", "exec", f"agentbox-{sid}", "cat",
                                "/sys/class/net/tap0/owner"], capture_output=True, text=True)
        assert owner.stdout.strip() == str(uid), owner  # only its VMM may attach to the TAP
        uids.add(uid)
        groups = dict(line.split(":", 2)[1:] for line in
                      Path(f"/proc/{pid}/cgroup").read_text().splitlines())
        hierarchy = cgroup.Hierarchy.detect()
        assert hierarchy is not None
        key = "" if hierarchy.version == 2 else "memory"
        assert groups[key].endswith(f"/{sid}"), groups
        if hierarchy.version == 1:
            limit = Path(f"/sys/fs/cgroup/memory{groups['memory']}/memory.limit_in_bytes")
            pids_max = Path(f"/sys/fs/cgroup/pids{groups['pids']}/pids.max")
        else:
            limit = Path(f"/sys/fs/cgroup{groups['']}/memory.max")
            pids_max = Path(f"/sys/fs/cgroup{groups['']}/pids.max")
        # The python template's 512 MiB guest + the default 256 MiB overhead.
        assert int(limit.read_text()) == (512 + 256) << 20
        assert int(pids_max.read_text()) == 64
    assert len(uids) == 2, "two sandboxes share a uid"


def _read_as(uid: int, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           "head", "-c", "16", str(path)], capture_output=True)


def test_one_sandboxs_uid_cannot_read_anothers_memory_or_disk(daemon, two):
    a, b = two
    uid_a, uid_b = (int(_status(_vmm(s))["Uid"].split()[0]) for s in two)
    # Two layers: the sandbox directory is root's alone, and each file is its VMM's alone.
    # The second is checked through a link in a directory anyone may traverse.
    exposed = Path(tempfile.mkdtemp(dir="/tmp"))  # the data dir is under /tmp too
    exposed.chmod(0o711)
    try:
        for name in ("memory", "disk.qcow2"):
            target = daemon.data_dir / "sandboxes" / b / name
            assert target.stat().st_mode & 0o077 == 0, oct(target.stat().st_mode)
            assert target.stat().st_uid == uid_b
            denied = _read_as(uid_a, target)
            assert denied.returncode != 0 and b"Permission denied" in denied.stderr
            os.link(target, exposed / name)
            assert _read_as(uid_b, exposed / name).returncode == 0  # its own VMM's uid can
            denied = _read_as(uid_a, exposed / name)
            assert denied.returncode != 0 and b"Permission denied" in denied.stderr
    finally:
        shutil.rmtree(exposed)
    # Nor the daemon's own files.
    for name in ("admin.key",):
        assert _read_as(uid_a, daemon.data_dir / name).returncode != 0


def test_console_flood_is_capped_and_rotated(api, daemon, two):
    flooder, other = two
    flood = ("import os\nf = os.open('/dev/ttyS0', os.O_WRONLY)\n"
             "for i in range(64):\n    os.write(f, (b'%05d' % i) * 1638 + b'\\n')\n")
    r = run(api, flooder, code=flood, timeout=120)
    assert r["exit_code"] == 0, r
    assert run(api, other, command="echo alive")["stdout"] == "alive\n"
    vm = daemon.data_dir / "sandboxes" / flooder / "vm"
    log, rotated = vm / "console.log", vm / "console.log.1"
    def kept() -> bytes:  # the newest output: the new file, or the rotated one if it just turned
        return (rotated.read_bytes() if rotated.exists() else b"") + log.read_bytes()

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and b"00063" not in kept():
        time.sleep(0.2)
    assert b"00063" in kept()  # the newest output is kept
    assert rotated.exists()  # ~512 KiB went through a 64 KiB cap
    assert log.stat().st_size <= CONSOLE_CAP and rotated.stat().st_size <= CONSOLE_CAP
    assert log.stat().st_mode & 0o077 == 0


def test_memory_cpu_and_fork_bombs_stay_inside_their_vm(api, daemon, two):
    bomber, other = two
    daemon_rss = _rss_kib(daemon.proc.pid)
    bombs = [
        # Memory: allocate until the guest's OOM killer steps in.
        "python3 -c 'x=[]\nwhile True: x.append(bytearray(1<<24))'",
        # CPU: spin on every vCPU.
        "timeout 20 sh -c 'while :; do :; done'",
        # Pids: a fork bomb (bounded by the command timeout).
        "timeout 15 bash -c 'b(){ b|b& }; b'",
    ]
    for bomb in bombs:
        r = api.post(f"/v1/sandboxes/{bomber}/commands",
                     json={"command": bomb, "background": True})
        assert r.status_code == 201, r.text
    # While the bombs go off, the other sandbox keeps answering promptly.
    worst = 0.0
    for _ in range(10):
        started = time.monotonic()
        assert run(api, other, command="echo ok")["stdout"] == "ok\n"
        worst = max(worst, time.monotonic() - started)
        time.sleep(1)
    assert worst < 10, f"the other sandbox took {worst:.1f}s to answer"
    # The bomber's VMM stayed inside its cgroup's limits and the daemon did not grow.
    pid = _vmm(bomber)
    groups = dict(line.split(":", 2)[1:] for line in
                  Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    if "pids" in groups:
        base = Path(f"/sys/fs/cgroup/pids{groups['pids']}")
        assert int((base / "pids.current").read_text()) <= int((base / "pids.max").read_text())
    assert _rss_kib(daemon.proc.pid) - daemon_rss < 64 * 1024
    api.delete(f"/v1/sandboxes/{bomber}")
    assert not vmm_pids_for(bomber)


def test_a_cold_booted_vmm_is_confined_and_its_new_memory_file_private(api, daemon, two):
    sid = two[0]
    uid = int(_status(_vmm(sid))["Uid"].split()[0])
    run(api, sid, command="echo kept > /root/f && sync")
    os.kill(_vmm(sid), 9)  # its memory is gone: the next request cold-boots the disk
    deadline = time.monotonic() + 120
    while True:
        r = api.post(f"/v1/sandboxes/{sid}/execute", json={"command": "cat /root/f"})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
        time.sleep(float(r.headers["Retry-After"]))
    assert r.status_code == 200 and r.json()["stdout"] == "kept\n", r.text
    st = _status(_vmm(sid))
    assert int(st["Uid"].split()[0]) == uid and st["Seccomp"].strip() == "2"
    memory = daemon.data_dir / "sandboxes" / sid / "memory"
    assert memory.stat().st_uid == uid and memory.stat().st_mode & 0o077 == 0

