"""VMM confinement: uids, chroot mirrors of the disk chain, cgroups, the console log cap."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from vmctl import cgroup, confine
from vmctl.confine import ConfineConfig, Limits
from vmctl.console import ConsoleLog
from vmctl.errors import VMStartError


def test_confinement_for_gives_each_slot_its_own_uid_and_limits(tmp_path):
    cfg = ConfineConfig(uid_base=300000, memory_overhead_mib=100, cpu_percent=50, pids_max=40)
    a = confine.confinement_for(cfg, 3, "sb-a", tmp_path, mem_mib=512, vcpus=2)
    b = confine.confinement_for(cfg, 4, "sb-b", tmp_path, mem_mib=512, vcpus=2)
    assert a is not None and b is not None
    assert (a.uid, a.gid, b.uid) == (300003, 300003, 300004)
    # Slots of different pools (two daemons on one host) map to different uids.
    offsets = {confine.slot_uid_offset(f"169.254.{third}.1") for third in (64, 128, 32)}
    assert len(offsets) == 3
    assert confine.slot_uid_offset("169.254.128.1") + 1 == confine.slot_uid_offset("169.254.128.5")
    assert a.limits == Limits(memory_bytes=612 << 20, cpu_quota_us=100_000, pids_max=40)
    assert confine.confinement_for(ConfineConfig(enabled=False), 3, "x", tmp_path, 512, 1) is None


@pytest.mark.parametrize("bad", [{"uid_base": 0}, {"pids_max": 2}, {"cpu_percent": 0},
                                 {"memory_overhead_mib": 1}])
def test_confine_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        ConfineConfig(**bad)


def test_qemu_args_carry_seccomp_chroot_and_uid(tmp_path):
    c = confine.confinement_for(ConfineConfig(), 1, "sb", tmp_path, 256, 1)
    args = confine.qemu_args(c)
    assert args[args.index("-sandbox") + 1] == confine.SECCOMP
    assert "spawn=deny" in confine.SECCOMP and "obsolete=deny" in confine.SECCOMP
    assert args[args.index("-chroot") + 1] == str(tmp_path)
    assert args[args.index("-runas") + 1] == "200001:200001"  # offset 1
    assert confine.qemu_args(None) == []


def _overlay(path, backing, fmt):
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", fmt, "-b", str(backing),
                    str(path)], check=True)


def test_backing_chain_follows_qcow2_headers_to_the_raw_base(tmp_path):
    base = tmp_path / "rootfs.ext4"
    base.write_bytes(b"\0" * 65536)
    golden, disk = tmp_path / "golden.qcow2", tmp_path / "sb" / "disk.qcow2"
    disk.parent.mkdir()
    _overlay(golden, base, "raw")
    _overlay(disk, golden, "qcow2")
    assert confine.backing_chain(disk) == [disk, golden, base]
    assert confine.backing_chain(base) == [base]


def test_mirror_links_each_file_at_its_own_path_inside_the_chroot(tmp_path):
    jail = tmp_path / "jail"
    jail.mkdir()
    f = tmp_path / "data" / "disk.qcow2"
    f.parent.mkdir()
    f.write_bytes(b"disk")
    confine.mirror_into_chroot(jail, [f])
    confine.mirror_into_chroot(jail, [f])  # idempotent
    inside = jail / f.relative_to("/")
    assert os.path.samefile(inside, f)
    f.unlink()
    f.write_bytes(b"new disk")  # a new file at the same path replaces the stale link
    confine.mirror_into_chroot(jail, [f])
    assert os.path.samefile(inside, f) and inside.read_bytes() == b"new disk"


def test_mirror_across_filesystems_fails_with_a_clear_error(tmp_path):
    if os.stat("/proc/self/status").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs two filesystems")
    with pytest.raises(VMStartError, match="one filesystem"):
        confine.mirror_into_chroot(tmp_path, [__import__("pathlib").Path("/proc/self/status")])


def _fake_v1(root):
    for c in cgroup.CONTROLLERS:
        (root / c).mkdir(parents=True)
        (root / c / "cgroup.procs").write_text("")
    return cgroup.Hierarchy.detect(root)


def test_hierarchy_detects_v2_with_all_controllers_and_falls_back_to_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cgroup.Hierarchy.detect(v2) == cgroup.Hierarchy(2, v2)
    hybrid = tmp_path / "hybrid"  # this CI host: v1 controllers, an empty v2 beside them
    (hybrid / "unified").mkdir(parents=True)
    (hybrid / "cgroup.controllers").write_text("hugetlb\n")
    assert cgroup.Hierarchy.detect(hybrid) is None
    assert _fake_v1(tmp_path / "v1") == cgroup.Hierarchy(1, tmp_path / "v1")


def test_limit_files_name_each_controllers_knob():
    limits = Limits(memory_bytes=1 << 30, cpu_quota_us=50_000, pids_max=32)
    v1 = cgroup.Hierarchy(1, cgroup.CGROUP_ROOT).limit_files("p/x", limits)
    assert v1[cgroup.CGROUP_ROOT / "memory/p/x/memory.limit_in_bytes"] == str(1 << 30)
    assert v1[cgroup.CGROUP_ROOT / "cpu/p/x/cpu.cfs_quota_us"] == "50000"
    assert v1[cgroup.CGROUP_ROOT / "pids/p/x/pids.max"] == "32"
    v2 = cgroup.Hierarchy(2, cgroup.CGROUP_ROOT).limit_files("p/x", limits)
    assert v2[cgroup.CGROUP_ROOT / "p/x/cpu.max"] == "50000 100000"
    assert v2[cgroup.CGROUP_ROOT / "p/x/memory.max"] == str(1 << 30)


def test_wrap_joins_every_cgroup_then_execs_the_vmm(tmp_path):
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]
    out = subprocess.run(cgroup.wrap(["sh", "-c", "echo $$"], procs), capture_output=True,
                         text=True, check=True).stdout.strip()
    # The VMM is the same process that joined (exec, not a child).
    assert [p.read_text().strip() for p in procs] == [out, out]
    assert cgroup.wrap(["x"], []) == ["x"]


@pytest.mark.skipif(os.geteuid() != 0 or cgroup.Hierarchy.detect() is None,
                    reason="needs root and a cgroup hierarchy with memory, cpu and pids")
def test_real_cgroup_limits_a_process_and_is_removed(tmp_path):
    manager = cgroup.CgroupManager(cgroup.Hierarchy.detect(), cgroup.daemon_parent(tmp_path))
    limits = Limits(memory_bytes=64 << 20, cpu_quota_us=20_000, pids_max=16)
    procs = manager.create("unit-test", limits)
    proc = subprocess.Popen(cgroup.wrap(["sleep", "30"], procs))
    try:
        for p in procs:
            for _ in range(100):
                if str(proc.pid) in p.read_text().split():
                    break
                __import__("time").sleep(0.01)
            assert str(proc.pid) in p.read_text().split()
        for path, value in manager.hierarchy.limit_files(
                f"{manager.parent}/unit-test", limits).items():
            if path.exists():
                assert path.read_text().strip() in (value, f"{value} 100000")
        assert manager.sweep(keep=set()) == []  # busy: not removed
    finally:
        proc.kill()
        proc.wait()
    manager.remove("unit-test")
    assert not any(d.exists() for d in manager.hierarchy.dirs(f"{manager.parent}/unit-test"))
    manager.create("left-behind", limits)
    assert manager.sweep(keep=set()) == ["left-behind"]
    assert manager.remove_parent()  # the daemon's own cgroup goes with its last VMM
    assert not any(d.exists() for d in manager.hierarchy.dirs(manager.parent))


async def test_console_log_is_capped_and_rotated(tmp_path):
    sock = tmp_path / "console.sock"
    sent = bytes(range(256)) * 4096  # 1 MiB a guest "prints"

    async def guest(reader, writer):
        for i in range(0, len(sent), 10_000):
            writer.write(sent[i:i + 10_000])
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(guest, str(sock))
    log = tmp_path / "console.log"
    console = ConsoleLog(sock, log, max_bytes=64 * 1024)
    console.start()
    try:
        for _ in range(500):
            await asyncio.sleep(0.01)
            if console._task is not None and console._task.done():
                break
        rotated = log.with_name("console.log.1")
        assert log.stat().st_size <= 64 * 1024 and rotated.stat().st_size <= 64 * 1024
        assert (rotated.read_bytes() + log.read_bytes()).endswith(sent[-1000:])
        assert oct(log.stat().st_mode & 0o777) == "0o600"
    finally:
        await console.aclose()
        server.close()
