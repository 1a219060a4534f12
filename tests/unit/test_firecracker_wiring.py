"""vmm = "firecracker" wired through golden snapshots and Machine, against the API simulator.

The Firecracker API simulator (tests/fcsim) runs as the ``firecracker`` on PATH,
``vmctl.backend`` is told that KVM is usable, a fake ``ip`` runs
``ip netns exec NS CMD`` as plain ``CMD`` (no namespaces are created: the
network set-up is recorded, not performed), and an AgentClient stand-in answers
for the guest agent.

What this proves: the Firecracker path through the *same* golden/Machine/store
code as QEMU makes the right calls in the right order with the right files:
the golden VM boots the Firecracker vmlinux without an initrd and with
``init=``, its disk is a raw copy of the template rootfs; a sandbox gets a raw
copy of the golden disk and no memory copy (the load maps the golden memory
file); a suspend keeps state, a fresh memory file and a hard link of the disk,
with the manifest checks the docs promise; a wake loads that snapshot onto the
same disk inode; a cold boot boots the Firecracker kernel; destroy leaves no
file, socket or process. What it does not prove: anything a guest does (the
simulator runs no VM, and the "agent" is a stub). That is
tests/e2e/test_firecracker_api.py's job on a KVM host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import ConfigError, load
from vmctl import accel as accel_probe
from vmctl import backend as backend_mod
from vmctl import golden as golden_mod
from vmctl import machine as machine_mod
from vmctl import network, store
from vmctl.backend import FIRECRACKER_INIT, Backend, FirecrackerConfig, VMConfig, select
from vmctl.confine import slot_uid_offset
from vmctl.driver import pid_alive
from vmctl.drivers.fc_api import boot_args
from vmctl.drivers.firecracker import FirecrackerDriver, JailerConfig
from vmctl.errors import VmctlError
from vmctl.golden import ensure_golden, load_golden_dir
from vmctl.machine import Machine, MachinePlan, RestoreError
from vmctl.spec import Accel

FCSIM_DIR = Path(__file__).resolve().parents[1] / "fcsim"
NET = network.NetworkConfig(pool="169.254.64.0/24")
CMDLINE = "console=ttyS0 reboot=k panic=1 root=/dev/vda rw quiet"
FAKE_IP = """#!/bin/sh
# Test stand-in for iproute2: `ip netns exec NS CMD...` runs CMD here (no namespaces).
if [ "$1" = netns ] && [ "$2" = exec ]; then shift 3; exec "$@"; fi
echo "fake ip: unsupported: $*" >&2
exit 1
"""

pytestmark = pytest.mark.timeout(120)


class FakeAgent:
    """Stands in for vmctl.agent_client.AgentClient: no guest runs under the simulator."""

    made: list[FakeAgent] = []

    def __init__(self, address: str, port: int = 0) -> None:
        self.address, self.calls, self.closed = address, [], False
        FakeAgent.made.append(self)

    async def wait_ready(self, timeout: float, alive: Any = None) -> None:
        self.calls.append("wait_ready")

    async def init_when_ready(self, make_req: Any, timeout: float, alive: Any = None) -> None:
        self.calls.append(("init", make_req()))

    async def sync(self, timeout: float) -> None:
        self.calls.append("sync")

    async def init(self, req: Any) -> None:
        self.calls.append(("init", req))

    async def execute(self, req: Any) -> Any:
        self.calls.append(("execute", req.command or req.code))
        return SimpleNamespace(exit_code=0, stdout="", stderr="")

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        # The golden build starts the default interpreter context through /contexts.
        self.calls.append((method, path))
        return {"name": "default", "language": "python", "cwd": "/root", "pid": 7,
                "running": False, "execution_count": 0, "created_at": 1.0}

    async def aclose(self) -> None:
        self.closed = True


@dataclasses.dataclass
class Host:
    root: Path
    image: Any
    kernel_link: Path  # [vm] firecracker_kernel (a symlink, like build_kernel.sh makes)
    kernel: Path  # what it points to
    vmms: list[dict[str, Any]]  # per VMM that was stopped: vm_id, pid, API calls
    net: list[tuple[str, str]]  # ("create" | "destroy", netns)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    root = Path(tempfile.mkdtemp(prefix="fcw", dir="/tmp"))  # short: socket paths
    bindir = root / "bin"
    bindir.mkdir()
    (bindir / "ip").write_text(FAKE_IP)
    (bindir / "ip").chmod(0o755)
    monkeypatch.setenv("PATH", f"{FCSIM_DIR}{os.pathsep}{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FCSIM_PYTHON", sys.executable)
    host = Host(root, _template(root), root / "fc" / "vmlinux", root / "fc" / "vmlinux-abc",
                [], [])
    host.kernel.parent.mkdir()
    host.kernel.write_bytes(b"ELF: not a kernel, the simulator runs no guest")
    host.kernel_link.symlink_to(host.kernel.name)
    _fake_host(monkeypatch, host)
    FakeAgent.made.clear()
    yield host
    shutil.rmtree(root, ignore_errors=True)


def _template(root: Path) -> Any:
    """A built template as images.catalog.TemplateImage describes one (tiny files)."""
    d = root / "img" / "python" / "h1"
    d.mkdir(parents=True)
    for name, data in (("vmlinuz", b"bzImage"), ("initrd.img", b"initramfs"),
                       ("rootfs.ext4", b"ext4-rootfs" + b"\0" * 65525)):
        (d / name).write_bytes(data)
    (d / "rootfs.ext4").chmod(0o444)  # as the image pipeline leaves it
    return SimpleNamespace(name="python", dir=d, kernel=d / "vmlinuz", initrd=d / "initrd.img",
                           rootfs=d / "rootfs.ext4", cmdline=CMDLINE, mem_mib=64,
                           warmup="import json\n")


def _fake_host(monkeypatch: pytest.MonkeyPatch, host: Host) -> None:
    netns_dir = host.root / "netns"  # what the fake jailer's --netns checks
    netns_dir.mkdir()
    monkeypatch.setenv("FCSIM_NETNS_DIR", str(netns_dir))

    async def create(slot: network.NetSlot, config: network.NetworkConfig, *,
                     policy: object = None, tap_owner: int | None = None) -> None:
        host.net.append(("create", slot.netns))
        (netns_dir / slot.netns).touch()

    async def destroy(slot: network.NetSlot) -> None:
        host.net.append(("destroy", slot.netns))
        (netns_dir / slot.netns).unlink(missing_ok=True)

    original_quit = FirecrackerDriver._quit

    async def recording_quit(self: FirecrackerDriver) -> None:
        """Read the simulator's call log just before the driver kills the VMM."""
        try:
            if self._api is not None and self.spec is not None:
                calls = (await self._api.get("/_sim/calls"))["calls"]
                host.vmms.append({"vm_id": self.spec.vm_id, "pid": self.pid,
                                  "calls": [c for c in calls if c["method"] != "GET"]})
        except VmctlError:
            host.vmms.append({"vm_id": self.spec.vm_id, "pid": self.pid, "calls": None})
        finally:
            await original_quit(self)

    monkeypatch.setattr(network, "create", create)
    monkeypatch.setattr(network, "destroy", destroy)
    monkeypatch.setattr(FirecrackerDriver, "_quit", recording_quit)
    monkeypatch.setattr(backend_mod, "_firecracker_usable",
                        lambda binary="firecracker": (True, f"fake: {binary}, KVM usable"))
    monkeypatch.setattr(golden_mod, "AgentClient", FakeAgent)
    monkeypatch.setattr(machine_mod, "AgentClient", FakeAgent)


async def _backend(host: Host) -> Backend:
    config = VMConfig(vmm="firecracker", firecracker_kernel=host.kernel_link, network=NET,
                      firecracker=FirecrackerConfig(jailer=False))
    backend = await select(config, kernel=host.image.kernel)
    assert (backend.driver_name, backend.accel, backend.key) == (
        "firecracker", Accel.KVM, "firecracker-kvm")
    return backend


def _paths(calls: list[dict[str, Any]]) -> list[str]:
    return [c["path"] for c in calls]


def _our_processes(root: Path) -> list[int]:
    """Live processes whose command line mentions ``root`` (VMMs started by the test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(root).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if pid_alive(pid)]


# -- the golden snapshot ----------------------------------------------------------------------


async def test_golden_boots_the_firecracker_kernel_on_a_raw_copy(host: Host) -> None:
    backend = await _backend(host)
    golden = await ensure_golden(host.image, backend, progress=lambda _: None)

    name = f"golden-firecracker-kvm-2c-64M-r{golden_mod.GOLDEN_RECIPE}"  # [vm] vcpus = 2
    assert golden.dir == host.image.dir / name
    assert sorted(p.name for p in golden.dir.iterdir()) == [
        "disk", "manifest.json", "memory", "vmstate"]
    assert (golden.kernel, golden.initrd) == (host.kernel, None)  # resolved, no initrd
    assert golden.cmdline == f"{CMDLINE} {FIRECRACKER_INIT}"

    [vmm] = host.vmms
    assert _paths(vmm["calls"]) == ["/boot-source", "/drives/rootfs", "/machine-config",
                                    "/network-interfaces/eth0", "/entropy", "/actions",
                                    "/vm", "/snapshot/create"]
    assert vmm["calls"][0]["body"] == {"kernel_image_path": str(host.kernel),
                                       "boot_args": boot_args(golden.cmdline)}
    # The golden disk: a raw, writable copy of the template's read-only rootfs.
    disk = golden.snapshot.disk
    assert disk == golden.dir / "disk"
    assert disk.read_bytes() == host.image.rootfs.read_bytes()
    assert not disk.samefile(host.image.rootfs) and stat.S_IMODE(disk.stat().st_mode) == 0o644
    manifest = json.loads((golden.dir / "manifest.json").read_text())
    assert all("sha256" in manifest["files"][r] for r in ("state", "memory", "disk"))
    assert manifest["meta"]["initrd"] is None and manifest["meta"]["firecracker_version"]
    # The agent was waited for and warmed up; the build's network slot came and went.
    [agent] = FakeAgent.made
    assert agent.calls == ["wait_ready", ("execute", "import json\n"), ("POST", "/contexts"),
                           ("execute", "sync")]
    assert [op for op, _ in host.net] == ["create", "destroy"]
    assert not pid_alive(vmm["pid"]) and _our_processes(host.root) == []
    assert sorted(p.name for p in host.image.dir.iterdir()) == [  # no build temp dir left
        f"golden-firecracker-kvm-2c-64M-r{golden_mod.GOLDEN_RECIPE}", "initrd.img",
        "rootfs.ext4", "vmlinuz"]

    # Sandboxes of an older build find the same boot files from the directory alone.
    again = load_golden_dir(golden.dir)
    assert (again.kernel, again.initrd, again.cmdline) == (host.kernel, None, golden.cmdline)


# -- a sandbox's life -------------------------------------------------------------------------


async def test_jailed_by_default_each_sandbox_as_its_own_uid(host: Host) -> None:
    """The default: every VMM through the jailer, as the uid its slot gives it, with the
    files it opens linked into its jail and owned by that uid."""
    jails = host.root / "jail"
    config = VMConfig(vmm="firecracker", firecracker_kernel=host.kernel_link, network=NET,
                      firecracker=FirecrackerConfig(chroot_base=jails))
    backend = (await select(config, kernel=host.image.kernel)).for_daemon(host.root / "data")
    assert backend.confined and backend.cgroups is None  # the jailer makes the cgroups
    golden = await ensure_golden(host.image, backend, progress=lambda _: None)
    owners = {}
    for i in range(2):
        plan = MachinePlan(vm_id=f"sb-{i}", root=host.root / "sb" / f"sb-{i}",
                           slot=network.slot_for(i, f"sb-{i}", NET), golden=golden)
        m = Machine(plan, backend)
        await m.create()
        jail = jails / "firecracker" / plan.vm_id / "root"
        expected = 200000 + slot_uid_offset(plan.slot.host_addr)
        assert m.driver is not None and m.driver.control_socket == jail / "api.socket"
        owners[plan.vm_id] = {p.name: p.stat().st_uid for p in jail.iterdir() if p.is_file()}
        assert set(owners[plan.vm_id].values()) == {expected}, owners
        await m.suspend()
        await m.wake()
        await m.destroy()
        assert not (jails / "firecracker" / plan.vm_id).exists()
    assert owners["sb-0"] != owners["sb-1"]  # two sandboxes, two uids
    assert _our_processes(host.root) == []


async def test_create_suspend_wake_cold_boot_destroy(host: Host) -> None:
    backend = await _backend(host)
    golden = await ensure_golden(host.image, backend, progress=lambda _: None)
    host.vmms.clear()
    plan = MachinePlan(vm_id="sb-1", root=host.root / "sb" / "sb-1",
                       slot=network.slot_for(0, "sb-1", NET), golden=golden)
    m = Machine(plan, backend)
    disk = plan.root / "disk"

    # create: a raw copy of the golden disk; memory is the golden's, mapped, not copied.
    await m.create()
    assert m.spec.disk == disk and disk.read_bytes() == golden.snapshot.disk.read_bytes()
    assert not disk.samefile(golden.snapshot.disk)
    assert sorted(p.name for p in plan.root.iterdir()) == ["disk", "vm"]
    assert (plan.root / "vm" / "rootfs").resolve() == disk
    assert isinstance(m.agent, FakeAgent) and m.agent.calls[0][0] == "init"
    with open(disk, "r+b") as f:
        f.write(b"written by the guest")  # what a guest would do (the simulator does not)

    await m.suspend()
    load = _one_vmm(host)["calls"]
    assert _paths(load) == ["/snapshot/load", "/vm", "/snapshot/create"]
    assert load[0]["body"] == {
        "snapshot_path": str(golden.snapshot.state), "resume_vm": True,
        "mem_backend": {"backend_type": "File", "backend_path": str(golden.snapshot.memory)}}
    snap_dir = plan.root / "snapshot"
    assert sorted(p.name for p in snap_dir.iterdir()) == [
        "disk", "manifest.json", "memory", "vmstate"]
    assert (snap_dir / "disk").samefile(disk)  # the stopped VM's disk, not a copy
    files = json.loads((snap_dir / "manifest.json").read_text())["files"]
    assert "sha256" in files["state"]
    assert "mtime_ns" in files["memory"] and "mtime_ns" in files["disk"]
    assert "sha256" not in files["disk"]
    assert m.driver is None and _our_processes(host.root) == []
    assert not list(plan.root.rglob("*.sock")) and not list(plan.root.rglob("*.tmp"))

    # wake: loads the sandbox's own snapshot onto the same disk inode, then drops it.
    inode = disk.stat().st_ino
    await m.wake()
    assert disk.stat().st_ino == inode and disk.read_bytes().startswith(b"written by the guest")
    assert not snap_dir.exists() and sorted(p.name for p in plan.root.iterdir()) == [
        "disk", "vm"]
    await m.suspend()
    load = _one_vmm(host)["calls"]
    assert load[0]["body"]["snapshot_path"] == str(snap_dir / "vmstate")
    assert load[0]["body"]["mem_backend"]["backend_path"] == str(snap_dir / "memory")

    # A memory file touched after the suspend is refused: the VMM started meanwhile
    # (vm.overlap_restore) is stopped without being given anything to load; without the
    # overlap, no VMM starts at all.
    st = (snap_dir / "memory").stat()
    os.utime(snap_dir / "memory", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(RestoreError, match="changed since the snapshot") as info:
        await m.wake()
    assert info.value.guest_started is False and info.value.snapshot_unusable
    assert _one_vmm(host)["calls"] == [] and m.driver is None
    overlapped = m.backend
    m.backend = dataclasses.replace(overlapped, config=dataclasses.replace(
        overlapped.config, overlap_restore=False))
    with pytest.raises(RestoreError, match="changed since the snapshot") as info:
        await m.wake()
    assert info.value.snapshot_unusable and host.vmms == []
    m.backend = overlapped

    # cold boot: the Firecracker kernel, no initrd, on the sandbox's own disk.
    await m.cold_boot()
    assert not snap_dir.exists()
    await m.destroy()
    boot = _one_vmm(host)["calls"]
    assert boot[0]["body"] == {"kernel_image_path": str(host.kernel),
                               "boot_args": boot_args(golden.cmdline)}
    assert "initrd_path" not in boot[0]["body"]
    assert not plan.root.exists() and _our_processes(host.root) == []
    assert not list(host.root.rglob("*.sock")) and not list(host.root.rglob("*.tmp*"))
    assert ("destroy", plan.slot.netns) in host.net
    assert all(agent.closed for agent in FakeAgent.made)
    await m.destroy()  # idempotent


def _one_vmm(host: Host) -> dict[str, Any]:
    [vmm] = host.vmms
    host.vmms.clear()
    assert not pid_alive(vmm["pid"])
    return vmm


async def test_a_failed_create_leaves_no_process(host: Host) -> None:
    backend = await _backend(host)
    golden = await ensure_golden(host.image, backend, progress=lambda _: None)
    golden.snapshot.state.write_text("not a vmstate")  # the simulator refuses to load it
    plan = MachinePlan(vm_id="sb-2", root=host.root / "sb" / "sb-2",
                       slot=network.slot_for(1, "sb-2", NET), golden=golden)
    m = Machine(plan, backend)
    with pytest.raises(RestoreError) as info:
        await m.create()
    assert info.value.guest_started is False and m.driver is None
    [vmm] = host.vmms[1:]
    assert vmm["calls"] is None and not pid_alive(vmm["pid"])  # it exited after the 400
    await m.destroy()
    assert not plan.root.exists() and _our_processes(host.root) == []


# -- selection and configuration ----------------------------------------------------------------


async def test_select_needs_the_guest_kernel(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = host.root / "no-vmlinux"
    with pytest.raises(RuntimeError, match="make kernel-firecracker"):
        await select(VMConfig(vmm="firecracker", firecracker_kernel=missing), host.image.kernel)

    async def tcg(kernel: Path, forced: str | None = None) -> Any:
        return accel_probe.AccelChoice(Accel.TCG, "fake probe")

    monkeypatch.setattr(accel_probe, "detect", tcg)
    auto = await select(VMConfig(vmm="auto", firecracker_kernel=missing), host.image.kernel)
    assert auto.driver_name == "qemu"


def test_the_qemu_path_keeps_its_files(tmp_path: Path) -> None:
    qemu = Backend("qemu", Accel.TCG, "test", VMConfig())
    layout = qemu.layout
    assert (layout.disk(tmp_path), layout.memory(tmp_path)) == (
        tmp_path / "disk.qcow2", tmp_path / "memory")
    assert (layout.suspend_hashed, layout.suspend_stat_checked) == (("state",), ("memory", "disk"))
    image = _template(tmp_path)
    boot = qemu.boot_files(image)
    assert (boot.kernel, boot.initrd, boot.cmdline) == (image.kernel, image.initrd, CMDLINE)


def test_config_wires_the_firecracker_section_to_the_driver(tmp_path: Path) -> None:
    path = tmp_path / "agentbox.toml"
    path.write_text(f"""
[vm]
vmm = "firecracker"
firecracker_kernel = "{tmp_path / 'vmlinux'}"

[firecracker]
binary = "/opt/fc/firecracker"
jailer = true
jailer_binary = "/opt/fc/jailer"
uid = 1500
gid = 1501
chroot_base = "{tmp_path / 'jail'}"
""")
    vm = load(path).vm
    assert vm.firecracker_kernel == tmp_path / "vmlinux"
    driver = Backend("firecracker", Accel.KVM, "test", vm).new_driver()
    assert isinstance(driver, FirecrackerDriver) and driver.binary == "/opt/fc/firecracker"
    assert driver.jailer == JailerConfig(uid=1500, gid=1501, binary="/opt/fc/jailer",
                                         chroot_base=tmp_path / "jail")
    # Jailed by default, each VMM as its sandbox's own uid.
    assert load(tmp_path / "none.toml").vm.firecracker.jailer_config() == JailerConfig()
    path.write_text("[firecracker]\njailer = false\n")
    assert load(path).vm.firecracker.jailer_config() is None
    path.write_text("[firecracker]\nuid = 1500\n")
    with pytest.raises(ConfigError, match=r"\[firecracker\].*gid"):
        load(path)
    path.write_text("[firecracker]\nbinaries = 1\n")
    with pytest.raises(ConfigError, match="binaries"):
        load(path)


def test_store_checks_size_and_mtime_only_where_asked(tmp_path: Path) -> None:
    from vmctl.errors import SnapshotError
    from vmctl.spec import SnapshotFiles

    for name in ("vmstate", "memory", "disk"):
        (tmp_path / name).write_bytes(name.encode())
    snap = SnapshotFiles(tmp_path / "vmstate", tmp_path / "memory", tmp_path / "disk",
                         Accel.KVM, "firecracker")
    store.write_manifest(tmp_path, snap, hash_roles=("state",), stat_roles=("disk",))
    (tmp_path / "memory").write_bytes(b"memory, rewritten")  # not checked: loads
    store.load(tmp_path)
    (tmp_path / "disk").write_bytes(b"disk, rewritten")
    with pytest.raises(SnapshotError, match="disk .* changed"):
        store.load(tmp_path)
    store.load(tmp_path, verify=False)
