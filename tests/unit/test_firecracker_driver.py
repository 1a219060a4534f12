"""FirecrackerDriver against the Firecracker API simulator (tests/fcsim).

The simulator runs as a fake ``firecracker`` executable (tests/fcsim/firecracker
on PATH), so these tests exercise the real process handling: spawning, the API
socket, the exit after a failed snapshot load, killing and reaping.

What they prove: the driver sends the documented calls in the documented order
and states, handles the process's life cycle, and leaves nothing behind. What
they do not prove: that a guest boots, runs, or survives a snapshot. The
simulator runs no VM; that is tests/e2e/test_firecracker_real.py's job.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.fcsim import DEFAULT_VERSION
from vmctl.driver import pid_alive
from vmctl.drivers import firecracker as fcmod
from vmctl.drivers.fc_api import (
    FirecrackerAPI,
    boot_args,
    boot_requests,
    parse_version,
    snapshot_load_body,
)
from vmctl.drivers.firecracker import (
    FIRECRACKER_VERSION,
    FirecrackerDriver,
    JailerConfig,
    check_snapshot,
    firecracker_usable,
    jail_root,
    jailer_argv,
)
from vmctl.errors import SnapshotError, VMStartError
from vmctl.spec import Accel, SnapshotFiles, VMSpec

FCSIM_DIR = Path(__file__).resolve().parents[1] / "fcsim"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def fake_firecracker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{FCSIM_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FCSIM_PYTHON", sys.executable)  # the one with aiohttp


@pytest.fixture
def root() -> Iterator[Path]:
    # Short paths: a Unix socket path must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="fct", dir="/tmp"))
    (path / "vmlinux").write_bytes(b"not a kernel: the simulator runs no guest")
    (path / "disk.ext4").write_bytes(b"disk-v1" + b"\0" * 8185)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _spec(root: Path, name: str = "vm1", **kw: Any) -> VMSpec:
    return VMSpec(vm_id=name, workdir=root / name, kernel=root / "vmlinux",
                  disk=kw.pop("disk", root / "disk.ext4"), mem_file=root / name / "mem",
                  accel=Accel.KVM, mem_mib=64, vcpus=2, **kw)


async def _calls(socket: Path) -> list[dict[str, Any]]:
    api = FirecrackerAPI(socket)
    try:
        calls = (await api.get("/_sim/calls"))["calls"]
    finally:
        await api.aclose()
    return [c for c in calls if c["method"] != "GET"]


def _assert_gone(driver: FirecrackerDriver, pid: int, workdir: Path) -> None:
    assert not pid_alive(pid)
    assert driver.pid is None
    leftovers = sorted(p.name for p in workdir.iterdir())
    assert leftovers == ["console.log"], leftovers  # the log is kept for post-mortems


# -- boot -----------------------------------------------------------------------------------------


async def test_boot_sends_the_documented_sequence(root: Path) -> None:
    spec = _spec(root, cmdline="console=ttyS0 quiet")
    driver = FirecrackerDriver()
    await driver.boot(spec)
    try:
        assert driver.alive() and driver.version == FIRECRACKER_VERSION
        assert driver.control_socket == spec.workdir / "firecracker.sock"
        calls = await _calls(driver.control_socket)
        assert [(c["method"], c["path"], c["status"]) for c in calls] == [
            ("PUT", "/boot-source", 204), ("PUT", "/drives/rootfs", 204),
            ("PUT", "/machine-config", 204), ("PUT", "/entropy", 204),
            ("PUT", "/actions", 204)]
        source, drive, machine = (c["body"] for c in calls[:3])
        assert source == {"kernel_image_path": str(root / "vmlinux"),
                          "boot_args": "console=ttyS0 quiet reboot=k panic=1"}
        assert drive["path_on_host"] == "rootfs" and drive["is_root_device"] is True
        assert (spec.workdir / "rootfs").resolve() == spec.disk  # relative, via workdir
        assert machine == {"vcpu_count": 2, "mem_size_mib": 64, "smt": False}
        assert calls[-1]["body"] == {"action_type": "InstanceStart"}
    finally:
        pid = driver.pid
        await driver.destroy()
    assert pid is not None
    _assert_gone(driver, pid, spec.workdir)
    await driver.destroy()  # idempotent


async def test_boot_failure_leaves_nothing_behind(root: Path) -> None:
    spec = replace(_spec(root), kernel=root / "missing")
    driver = FirecrackerDriver()
    with pytest.raises(VMStartError) as info:
        await driver.boot(spec)
    assert "kernel" in str(info.value)
    assert driver.pid is None
    assert sorted(p.name for p in spec.workdir.iterdir()) == ["console.log"]


async def test_boot_refuses_a_binary_of_another_version(root: Path) -> None:
    other = root / "bin" / "firecracker"
    other.parent.mkdir()
    other.write_text(f"#!/bin/sh\nFCSIM_VERSION=1.15.0 exec {FCSIM_DIR / 'firecracker'} \"$@\"\n")
    other.chmod(0o755)
    driver = FirecrackerDriver(binary=str(other))
    with pytest.raises(VMStartError, match="pinned to " + FIRECRACKER_VERSION):
        await driver.boot(_spec(root))
    assert driver.pid is None


async def test_boot_refuses_tcg(root: Path) -> None:
    with pytest.raises(VMStartError, match="KVM"):
        await FirecrackerDriver().boot(replace(_spec(root), accel=Accel.TCG))


def test_simulator_and_driver_pin_the_same_release() -> None:
    assert DEFAULT_VERSION == FIRECRACKER_VERSION


# -- snapshot and restore -------------------------------------------------------------------------


async def _booted_snapshot(root: Path) -> tuple[SnapshotFiles, int]:
    driver = FirecrackerDriver()
    await driver.boot(_spec(root))
    try:
        snap = await driver.snapshot(root / "snap")
        calls = await _calls(driver.control_socket)  # type: ignore[arg-type]
        pid = driver.pid
    finally:
        await driver.destroy()
    assert [c["path"] for c in calls[-2:]] == ["/vm", "/snapshot/create"]
    assert calls[-2]["body"] == {"state": "Paused"}
    assert calls[-1]["body"]["snapshot_type"] == "Full"
    assert pid is not None and not pid_alive(pid)
    return snap, pid


async def test_pause_snapshot_exit_load_resume(root: Path) -> None:
    snap, _ = await _booted_snapshot(root)
    assert snap.driver == "firecracker" and snap.accel is Accel.KVM
    assert snap.extra["firecracker_version"] == FIRECRACKER_VERSION
    assert (snap.state, snap.memory, snap.disk) == (
        root / "snap" / "vmstate", root / "snap" / "memory", root / "snap" / "disk")
    assert snap.disk.read_bytes() == (root / "disk.ext4").read_bytes()
    assert not list((root / "snap").glob("*.tmp"))

    spec = _spec(root, "vm2", disk=root / "vm2-disk.ext4")
    driver = FirecrackerDriver()
    await driver.restore(snap, spec)
    try:
        calls = await _calls(driver.control_socket)  # type: ignore[arg-type]
        assert [c["path"] for c in calls] == ["/snapshot/load"]
        assert calls[0]["body"] == {
            "snapshot_path": str(snap.state), "resume_vm": True,
            "mem_backend": {"backend_type": "File", "backend_path": str(snap.memory)}}
        assert spec.disk.read_bytes() == snap.disk.read_bytes()  # the VM runs on its own copy
        await driver.pause()
        await driver.resume()
        api = FirecrackerAPI(driver.control_socket)  # type: ignore[arg-type]
        try:
            assert (await api.get("/"))["state"] == "Running"
        finally:
            await api.aclose()
    finally:
        pid = driver.pid
        await driver.destroy()
    assert pid is not None
    _assert_gone(driver, pid, spec.workdir)


async def test_the_process_starts_before_the_snapshot_is_ready(root: Path) -> None:
    """restore_when_ready: Firecracker is up (API answering, nothing loaded) when the
    snapshot is asked for; the load follows it. A snapshot that turns out unusable kills
    the early process before it was given anything."""
    snap, _ = await _booted_snapshot(root)
    spec = _spec(root, "early", disk=root / "early-disk.ext4")
    driver = FirecrackerDriver()
    seen: dict[str, Any] = {}

    async def source() -> SnapshotFiles:
        assert driver.pid is not None and pid_alive(driver.pid)
        seen["calls"] = await _calls(driver.control_socket)  # type: ignore[arg-type]
        seen["disk"] = spec.disk.exists()  # copied only once the snapshot is known
        return snap

    await driver.restore_when_ready(spec, source)
    try:
        assert seen == {"calls": [], "disk": False}
        calls = await _calls(driver.control_socket)  # type: ignore[arg-type]
        assert [c["path"] for c in calls] == ["/snapshot/load"]
        assert spec.disk.read_bytes() == snap.disk.read_bytes()
    finally:
        await driver.destroy()

    async def unusable() -> SnapshotFiles:
        seen["pid"] = driver.pid
        raise SnapshotError("snapshot memory file changed since the snapshot")

    driver = FirecrackerDriver()
    with pytest.raises(VMStartError) as info:
        await driver.restore_when_ready(_spec(root, "early2"), unusable)
    assert isinstance(info.value.__cause__, SnapshotError)
    assert driver.pid is None and not pid_alive(seen["pid"])


async def test_restore_onto_the_snapshot_disk_does_not_copy(root: Path) -> None:
    snap, _ = await _booted_snapshot(root)
    before = snap.disk.stat().st_ino
    driver = FirecrackerDriver()
    await driver.restore(snap, _spec(root, "vm3", disk=snap.disk))
    try:
        again = await driver.snapshot(snap.state.parent)  # suspend into the same place
    finally:
        await driver.destroy()
    assert snap.disk.stat().st_ino == before == again.disk.stat().st_ino


@pytest.mark.parametrize("breakage", ["garbage_state", "short_memory"])
async def test_failed_load_kills_the_process_and_leaks_nothing(root: Path, breakage: str) -> None:
    snap, _ = await _booted_snapshot(root)
    if breakage == "garbage_state":
        snap.state.write_bytes(b"\x00 not a vmstate")
    else:
        with open(snap.memory, "r+b") as f:
            f.truncate(4096)
    spec = _spec(root, "vm4")
    driver = FirecrackerDriver()
    with pytest.raises(VMStartError) as info:
        await driver.restore(snap, spec)
    cause = info.value.__cause__
    assert isinstance(cause, SnapshotError)
    assert "exited with code 1" in str(cause)
    assert driver.last_error is cause
    assert driver.pid is None
    assert sorted(p.name for p in spec.workdir.iterdir()) == ["console.log"]
    assert "Load snapshot failed" in (spec.workdir / "console.log").read_text()


async def test_snapshot_of_another_version_is_refused_before_starting(root: Path) -> None:
    snap, _ = await _booted_snapshot(root)
    old = replace(snap, extra={**snap.extra, "firecracker_version": "1.15.0"})
    spec = _spec(root, "vm5")
    driver = FirecrackerDriver()
    with pytest.raises(SnapshotError, match="taken with Firecracker 1.15.0"):
        await driver.restore(old, spec)
    assert driver.pid is None and not spec.workdir.exists()


async def test_snapshot_files_are_checked(root: Path) -> None:
    snap, _ = await _booted_snapshot(root)
    snap.memory.unlink()
    with pytest.raises(SnapshotError, match="missing"):
        await FirecrackerDriver().restore(snap, _spec(root, "vm6"))
    qemu = replace(snap, driver="qemu")
    with pytest.raises(SnapshotError, match="qemu"):
        check_snapshot(qemu, _spec(root))


# -- jailer ---------------------------------------------------------------------------------------


async def test_jailed_boot_snapshot_restore_with_the_fake_jailer(root: Path) -> None:
    cfg = JailerConfig(uid=os.getuid(), gid=os.getgid(), binary=str(FCSIM_DIR / "jailer"),
                       chroot_base=root / "jail")
    driver = FirecrackerDriver(jailer=cfg)
    await driver.boot(_spec(root))
    jail = root / "jail" / "firecracker" / "vm1" / "root"
    try:
        assert driver.control_socket == jail / "api.socket"
        assert (jail / "rootfs").samefile(root / "disk.ext4")  # hard link, same inode
        calls = await _calls(jail / "api.socket")
        assert calls[0]["body"]["kernel_image_path"] == "vmlinux"  # resolved inside the jail
        snap = await driver.snapshot(root / "snap")
        create = (await _calls(jail / "api.socket"))[-1]["body"]
        assert create["snapshot_path"] == "/vmstate.tmp"
    finally:
        await driver.destroy()
    assert not (root / "jail" / "firecracker" / "vm1").exists()
    assert snap.state.is_file() and snap.memory.is_file() and not list(jail.parent.glob("*"))

    again = FirecrackerDriver(jailer=cfg)
    await again.restore(snap, _spec(root, "vm2", disk=root / "vm2.ext4"))
    try:
        assert (await _calls(again.control_socket))[0]["body"]["snapshot_path"] == "vmstate"  # type: ignore[arg-type]
    finally:
        await again.destroy()
    assert not (root / "jail" / "firecracker" / "vm2").exists()


# -- adopt ----------------------------------------------------------------------------------------


async def test_adopt_reconnects_and_destroy_kills_a_non_child(root: Path) -> None:
    spec = _spec(root)
    first = FirecrackerDriver()
    await first.boot(spec)
    record = first.record()
    second = FirecrackerDriver()  # as a restarted daemon would: a new instance, no child
    await second.adopt(record, spec)
    try:
        assert second.version == FIRECRACKER_VERSION
        await second.pause()
        calls = await _calls(Path(record.control_socket))
        assert calls[-1]["body"] == {"state": "Paused"}
    finally:
        await second.destroy()
        await first.destroy()  # reaps our own child; nothing left to kill
    assert not pid_alive(record.pid)
    assert not Path(record.control_socket).exists()


async def test_failed_adopt_closes_its_api_client(root: Path) -> None:
    from vmctl.errors import VMGoneError
    from vmctl.spec import VMMRecord

    record = VMMRecord("firecracker", os.getpid(), str(root / "gone.sock"), str(root), "kvm", 0.0)
    driver = FirecrackerDriver()
    with pytest.raises(VMGoneError):
        await driver.adopt(record, _spec(root))
    driver.pid = None  # that pid is this test process: never let destroy() near it
    assert driver._api is None


# -- pure pieces ----------------------------------------------------------------------------------


def test_boot_requests_with_network_and_initrd(root: Path) -> None:
    spec = _spec(root, netns="sb-1")
    calls = boot_requests(spec, "/vmlinux", "/initrd", network=True)
    assert [p for _, p, _ in calls] == ["/boot-source", "/drives/rootfs", "/machine-config",
                                        "/network-interfaces/eth0", "/entropy", "/actions"]
    assert calls[0][2]["initrd_path"] == "/initrd"
    assert calls[3][2] == {"iface_id": "eth0", "host_dev_name": spec.tap, "guest_mac": spec.mac}


def test_boot_args_adds_console_and_panic_policy() -> None:
    assert boot_args("root=/dev/vda") == "console=ttyS0 root=/dev/vda reboot=k panic=1"
    assert boot_args("console=hvc0 panic=5 reboot=t") == "console=hvc0 panic=5 reboot=t"


def test_load_body_network_override_needs_a_version_that_has_it() -> None:
    body = snapshot_load_body("s", "m", "tap7", FIRECRACKER_VERSION)
    assert body["network_overrides"] == [{"iface_id": "eth0", "host_dev_name": "tap7"}]
    with pytest.raises(SnapshotError, match="1.12"):
        snapshot_load_body("s", "m", "tap7", version="1.10.1")
    assert "network_overrides" not in snapshot_load_body("s", "m", None, FIRECRACKER_VERSION)


def test_tap_override_only_when_the_tap_differs(root: Path) -> None:
    for name in ("vmstate", "memory", "disk"):
        (root / name).write_bytes(b"x")
    snap = SnapshotFiles(root / "vmstate", root / "memory", root / "disk", Accel.KVM,
                         "firecracker", {"firecracker_version": FIRECRACKER_VERSION,
                                         "tap": "tap0"})
    assert check_snapshot(snap, _spec(root, netns="ns", tap="tap0")) is None
    assert check_snapshot(snap, _spec(root, netns="ns", tap="tap1")) == "tap1"
    with pytest.raises(SnapshotError, match="netns"):
        check_snapshot(snap, _spec(root))


def test_jailer_command_line() -> None:
    cfg = JailerConfig(uid=123, gid=100, binary="/usr/bin/jailer", chroot_base=Path("/srv/j"),
                       cgroups=("cpu.max=50000 100000",), parent_cgroup="agentbox",
                       resource_limits=("no-file=2048",))
    argv = jailer_argv(cfg, "/usr/bin/firecracker", "sb-42", netns="sb-42")
    assert argv == [
        "/usr/bin/jailer", "--id", "sb-42", "--exec-file", "/usr/bin/firecracker",
        "--uid", "123", "--gid", "100", "--chroot-base-dir", "/srv/j", "--cgroup-version", "2",
        "--cgroup", "cpu.max=50000 100000", "--parent-cgroup", "agentbox",
        "--netns", "/var/run/netns/sb-42", "--resource-limit", "no-file=2048",
        "--", "--api-sock", "/api.socket"]
    assert "--daemonize" not in argv  # the driver's own new session replaces it
    assert jail_root(cfg, "/usr/bin/firecracker", "sb-42") == Path("/srv/j/firecracker/sb-42/root")
    minimal = jailer_argv(JailerConfig(uid=1, gid=1), "/opt/fc/firecracker-v1", "a")
    assert "--netns" not in minimal and "--cgroup" not in minimal


@pytest.mark.parametrize("vm_id,binary", [("bad_id", "/usr/bin/firecracker"),
                                          ("x" * 65, "/usr/bin/firecracker"),
                                          ("ok", "firecracker"), ("ok", "/usr/bin/vmm")])
def test_jailer_refuses_what_the_jailer_would(vm_id: str, binary: str) -> None:
    with pytest.raises(ValueError):
        jailer_argv(JailerConfig(uid=1, gid=1), binary, vm_id)


def test_jailer_config_validation() -> None:
    with pytest.raises(ValueError, match="cgroup_version"):
        JailerConfig(uid=1, gid=1, cgroup_version=3)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        JailerConfig(uid=1, gid=1, cgroups=("cpu.max",))


def test_parse_version() -> None:
    assert parse_version("Firecracker v1.16.1\n\nSupported snapshot data format versions:") \
        == "1.16.1"
    assert parse_version("1.10.1") == "1.10.1"
    with pytest.raises(ValueError):
        parse_version("firecracker")


def test_usable_reports_why_not(tmp_path: Path) -> None:
    ok, why = firecracker_usable(binary="no-such-firecracker-binary")
    assert not ok and "not on PATH" in why
    pvm = tmp_path / "kvm_pvm"
    pvm.mkdir()
    ok, why = firecracker_usable(pvm=pvm)
    assert not ok and "PVM" in why
    ok, why = firecracker_usable(kvm=tmp_path / "no-kvm", pvm=tmp_path / "none")
    assert not ok and "no-kvm" in why


def test_usable_on_this_host_is_one_line() -> None:
    ok, why = firecracker_usable()
    assert isinstance(ok, bool) and why and "\n" not in why
    if Path("/sys/module/kvm_pvm").exists():
        assert not ok


def test_module_pins_one_version() -> None:
    assert fcmod.FIRECRACKER_VERSION.count(".") == 2


# -- the guest console --------------------------------------------------------------------------


async def _flood(driver: FirecrackerDriver, size: int, marker: str) -> None:
    assert driver.control_socket is not None
    api = FirecrackerAPI(driver.control_socket)
    try:
        await api.put("/_sim/console", {"bytes": size, "marker": marker})
    finally:
        await api.aclose()


async def _wait_for_marker(log: Path, marker: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (log.exists() and marker in log.read_text(errors="replace")):
        assert loop.time() < deadline, f"{marker!r} never reached {log}"
        await asyncio.sleep(0.05)


async def test_a_flooding_console_is_capped_and_rotated(root: Path) -> None:
    """The guest decides what its serial console prints: 4 MiB of it must not take more
    than twice the cap on the host, and the newest output must be kept."""
    spec = _spec(root)
    cap = 128 * 1024
    driver = FirecrackerDriver(console_log_bytes=cap)
    await driver.boot(spec)
    try:
        await _flood(driver, 4 << 20, "END-OF-FLOOD")
        log = spec.workdir / "console.log"
        await _wait_for_marker(log, "END-OF-FLOOD")
        assert log.stat().st_size <= cap
        rotated = spec.workdir / "console.log.1"
        assert rotated.exists() and rotated.stat().st_size <= cap
        assert log.stat().st_mode & 0o777 == 0o600
        assert driver.alive()
    finally:
        await driver.destroy()
    assert not (spec.workdir / "console.fifo").exists()


async def test_console_output_while_no_daemon_reads_is_drained_on_adopt(root: Path) -> None:
    """Between a daemon crash and its restart nobody reads the FIFO: the VMM must neither
    die (EPIPE) nor lose its API, and the next daemon picks the output up."""
    spec = _spec(root)
    first = FirecrackerDriver()
    await first.boot(spec)
    record = first.record()
    await first._stop_console()  # the daemon is gone: nobody reads the console any more
    await _flood(first, 3 << 20, "WRITTEN-WHILE-DOWN")  # more than the pipe holds
    await asyncio.sleep(0.5)
    second = FirecrackerDriver()
    await second.adopt(record, spec)
    try:
        assert (await second._call().get("/"))["state"] == "Running"
        await _wait_for_marker(spec.workdir / "console.log", "WRITTEN-WHILE-DOWN")
    finally:
        await second.destroy()
        await first.destroy()
    assert not pid_alive(record.pid)
