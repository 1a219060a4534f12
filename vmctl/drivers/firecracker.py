"""Firecracker driver: one ``firecracker`` process per VM, driven over its REST API.

Theory of operation
-------------------
Boot: start ``firecracker --api-sock SOCK`` (optionally through ``jailer``, or
inside ``spec.netns`` with ``ip netns exec``), wait for ``GET /``, then PUT
boot-source, the root drive, machine-config, the NIC (only with a netns, as in
the QEMU driver), an entropy device, and ``InstanceStart``.

Paths the VMM sees are chosen so a snapshot restores anywhere: the root drive
is always the *relative* path ``rootfs``, resolved against the VMM's working
directory (``spec.workdir``, where we keep a symlink to ``spec.disk``) or, when
jailed, against the chroot (where we keep a hard link). Firecracker records
drive paths in its state file, so this is what lets one snapshot be restored
into a different workdir or jail.

Snapshot: pause (idempotent), ``PUT /snapshot/create`` (Full) into
``dest/vmstate`` + ``dest/memory``, then copy the disk to ``dest/disk``
(``cp --reflink=auto --sparse=always``). Guest RAM lives in anonymous memory
while a freshly booted VM runs; ``spec.mem_file`` is not used by this driver.

Restore: a *fresh* process (started first, so it comes up while the caller still
verifies the snapshot: ``Driver.restore_when_ready``), ``PUT /snapshot/load`` with
the File memory backend (mapped MAP_PRIVATE: the memory file must stay unchanged
while the VM runs) and
``resume_vm``. Firecracker exits when a load fails; we wait for that, raise a
SnapshotError (wrapped in VMStartError by ``Driver._start``) and the base class
removes what is left. Snapshots are only restored by the exact Firecracker
release that took them (``FIRECRACKER_VERSION``, checked before anything starts).

Quit: there is no reliable guest shutdown (SendCtrlAltDel needs guest
cooperation), so ``_quit`` kills the process; the base class reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vmctl.console import DEFAULT_CONSOLE_LOG_BYTES, ConsoleLog, console_fifo
from vmctl.driver import Driver, SnapshotSource
from vmctl.drivers.fc_api import (
    ROOT_DRIVE_PATH,
    FirecrackerAPI,
    boot_requests,
    parse_version,
    snapshot_load_body,
)
from vmctl.errors import SnapshotError, VMProtocolError, VMStartError, VmctlError
from vmctl.spec import Accel, SnapshotFiles, VMMRecord, VMSpec

# The release this driver is written and tested against. Its API (swagger of the
# 1.16 line) has every field used here: mem_backend (1.1+), resume_vm, and
# network_overrides on /snapshot/load (1.12+); 1.12+ also boots the PVH entry of
# our vmlinux and 1.16.1 fixes vsock after restore. Firecracker restores only
# snapshots of its own format, so the pin is exact: a host upgrade is a new pin.
FIRECRACKER_VERSION = "1.16.1"
FIRECRACKER_BINARY = "firecracker"

API_SOCKET = "firecracker.sock"  # in spec.workdir (direct mode)
JAIL_API_SOCKET = "api.socket"  # in the jail root
CONSOLE_LOG = "console.log"  # the VMM's stdout+stderr: guest serial console + VMM messages
CONSOLE_FIFO = "console.fifo"  # what the VMM writes them to (vmctl.console: capped, rotated)
STATE_FILE, MEMORY_FILE, DISK_FILE = "vmstate", "memory", "disk"
START_TIMEOUT_S, LOAD_TIMEOUT_S, SNAPSHOT_TIMEOUT_S = 10.0, 60.0, 600.0
_KVM_GET_API_VERSION = 0xAE00
_SUN_PATH_MAX = 107
_JAIL_ID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


# -- host checks and versions ---------------------------------------------------------


def firecracker_usable(binary: str = FIRECRACKER_BINARY, kvm: Path = Path("/dev/kvm"),
                       pvm: Path = Path("/sys/module/kvm_pvm")) -> tuple[bool, str]:
    """Can this host run Firecracker VMs? Returns (ok, one-line reason)."""
    path = shutil.which(binary)
    if path is None:
        return False, f"{binary!r} is not on PATH"
    if pvm.exists():
        return False, f"host KVM is PVM ({pvm} present): Firecracker needs a normal KVM host"
    try:
        fd = os.open(kvm, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return False, f"{kvm} is not usable: {exc.strerror}"
    try:
        api = fcntl.ioctl(fd, _KVM_GET_API_VERSION)
    except OSError as exc:
        return False, f"{kvm} does not answer KVM_GET_API_VERSION: {exc.strerror}"
    finally:
        os.close(fd)
    if api != 12:
        return False, f"{kvm} reports KVM API {api}, expected 12"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        version = parse_version(out.stdout + out.stderr)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return False, f"{path} --version failed: {exc}"
    if version != FIRECRACKER_VERSION:
        return False, (f"{path} is Firecracker {version}, "
                       f"the driver is pinned to {FIRECRACKER_VERSION}")
    return True, f"Firecracker {version} at {path}, {kvm} usable"


_version_cache: dict[tuple[str, int, int], str] = {}


async def binary_version(path: str) -> str:
    """``path --version``, cached per binary file (restores must not pay for it)."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_mtime_ns)
    if key not in _version_cache:
        proc = await asyncio.create_subprocess_exec(
            path, "--version", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 10.0)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        _version_cache[key] = parse_version(out.decode(errors="replace"))
    return _version_cache[key]


# -- the jailer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JailerConfig:
    """How to run Firecracker under its ``jailer`` (chroot, uid/gid, cgroups, netns).

    No ``--daemonize``: the driver already starts the VMM in a new session, and
    the jailer's own ``setsid()`` fails for a session leader. No ``--new-pid-ns``:
    the driver tracks the pid it started.
    """

    uid: int | None = None  # None: the VMM's spec.confinement says (one uid per sandbox)
    gid: int | None = None
    binary: str = "jailer"
    chroot_base: Path = Path("/srv/jailer")
    cgroup_version: int = 2
    cgroups: tuple[str, ...] = ()  # "<cgroup file>=<value>", e.g. "cpu.max=100000 100000"
    parent_cgroup: str | None = None
    resource_limits: tuple[str, ...] = ()  # "<resource>=<value>", e.g. "no-file=1024"

    def __post_init__(self) -> None:
        if (self.uid is not None and self.uid < 0) or (self.gid is not None and self.gid < 0):
            raise ValueError("jailer uid and gid must be >= 0")
        if self.cgroup_version not in (1, 2):
            raise ValueError("jailer cgroup_version must be 1 or 2")
        for item in (*self.cgroups, *self.resource_limits):
            if "=" not in item:
                raise ValueError(f"jailer cgroup/resource limit {item!r} must be NAME=VALUE")
        if not self.chroot_base.is_absolute():
            raise ValueError("jailer chroot_base must be absolute")


def jail_root(cfg: JailerConfig, firecracker: str, vm_id: str) -> Path:
    """``<chroot_base>/<exec file name>/<id>/root``: where the jailer chroots."""
    return cfg.chroot_base / Path(firecracker).name / vm_id / "root"


def jail_owner(cfg: JailerConfig, spec: VMSpec) -> tuple[int, int]:
    """The uid/gid a jailed VMM runs as: the configured one, else its sandbox's own."""
    if cfg.uid is not None and cfg.gid is not None:
        return cfg.uid, cfg.gid
    if spec.confinement is None:
        raise VMStartError("a jailed Firecracker needs firecracker.uid/gid or a per-sandbox "
                           "uid (the daemon sets one)")
    return spec.confinement.uid, spec.confinement.gid


def jailer_argv(cfg: JailerConfig, firecracker: str, vm_id: str,
                netns: str | None = None, owner: tuple[int, int] | None = None) -> list[str]:
    """The jailer command line (pure; the API socket ends up at jail_root/api.socket)."""
    uid, gid = owner or (cfg.uid, cfg.gid)
    if uid is None or gid is None:
        raise ValueError("jailer_argv needs a uid and gid")
    if not _JAIL_ID_RE.fullmatch(vm_id):
        raise ValueError(f"jailer id {vm_id!r}: 1-64 letters, digits and hyphens")
    if not os.path.isabs(firecracker) or "firecracker" not in Path(firecracker).name:
        raise ValueError(f"jailer exec file {firecracker!r} must be an absolute path "
                         "to a file named *firecracker*")
    argv = [cfg.binary, "--id", vm_id, "--exec-file", firecracker,
            "--uid", str(uid), "--gid", str(gid),
            "--chroot-base-dir", str(cfg.chroot_base),
            "--cgroup-version", str(cfg.cgroup_version)]
    for item in cfg.cgroups:
        argv += ["--cgroup", item]
    if cfg.parent_cgroup:
        argv += ["--parent-cgroup", cfg.parent_cgroup]
    if netns:
        argv += ["--netns", f"/var/run/netns/{netns}"]
    for item in cfg.resource_limits:
        argv += ["--resource-limit", item]
    return argv + ["--", "--api-sock", "/" + JAIL_API_SOCKET]


def check_snapshot(snapshot: SnapshotFiles, spec: VMSpec) -> str | None:
    """Refuse what this driver cannot restore; return the TAP override to send, if any."""
    if snapshot.driver != "firecracker":
        raise SnapshotError(f"snapshot was taken by {snapshot.driver!r}, not firecracker")
    taken_with = snapshot.extra.get("firecracker_version")
    if taken_with != FIRECRACKER_VERSION:
        raise SnapshotError(
            f"snapshot {snapshot.state} was taken with Firecracker {taken_with or 'unknown'}; "
            f"this driver runs Firecracker {FIRECRACKER_VERSION} and only restores its own "
            "snapshots (re-create it from a cold boot, or restore with the matching release)")
    for path in (snapshot.state, snapshot.memory, snapshot.disk):
        if not path.is_file():
            raise SnapshotError(f"snapshot file {path} is missing")
    tap = snapshot.extra.get("tap")
    if tap is not None and spec.netns is None:
        raise SnapshotError(f"snapshot has a NIC on TAP {tap!r}; restore it with spec.netns set")
    return spec.tap if tap is not None and tap != spec.tap else None


# -- the driver ------------------------------------------------------------------------------------


class FirecrackerDriver(Driver):
    name = "firecracker"

    def __init__(self, binary: str = FIRECRACKER_BINARY, jailer: JailerConfig | None = None,
                 start_timeout: float = START_TIMEOUT_S,
                 console_log_bytes: int = DEFAULT_CONSOLE_LOG_BYTES) -> None:
        super().__init__()
        self.binary = binary
        self.jailer = jailer
        self.start_timeout = start_timeout
        self.console_log_bytes = console_log_bytes
        self._console: ConsoleLog | None = None
        self.version: str | None = None
        self._api: FirecrackerAPI | None = None
        self._jail: Path | None = None  # jail root on the host (jailer mode)

    def __repr__(self) -> str:
        return f"<FirecrackerDriver pid={self.pid} jailed={self.jailer is not None}>"

    async def restore(self, snapshot: SnapshotFiles, spec: VMSpec,
                      before_resume: Callable[[], None] | None = None) -> None:
        check_snapshot(snapshot, spec)  # SnapshotError before any process exists
        await super().restore(snapshot, spec, before_resume)

    # -- Driver hooks ---------------------------------------------------------------------

    async def _boot(self, spec: VMSpec) -> None:
        binary = await self._prepare(spec)
        kernel = self._expose(spec.kernel, "vmlinux")
        initrd = self._expose(spec.initrd, "initrd") if spec.initrd is not None else None
        await self._spawn(spec, binary)
        for method, path, body in boot_requests(spec, kernel, initrd, spec.netns is not None):
            await self._call().request(method, path, body)

    async def _restore(self, snapshot: SnapshotSource, spec: VMSpec,
                       before_resume: Callable[[], None]) -> None:
        # The process (and its jail) first: Firecracker opens the snapshot's files only at
        # /snapshot/load, so they may still be being verified meanwhile.
        binary = await self._prepare(spec, link_rootfs=False)
        await self._spawn(spec, binary)
        snap = await snapshot()
        tap_override = check_snapshot(snap, spec)
        await _restore_disk(snap.disk, spec.disk)
        self._link_rootfs(spec.disk)  # after the copy: a hard link names one inode
        state = self._expose(snap.state, STATE_FILE)
        memory = self._expose(snap.memory, MEMORY_FILE)
        body = snapshot_load_body(state, memory, tap_override, self.version or "")
        before_resume()  # the load resumes the VM at once (resume_vm), on the snapshot's disk
        try:
            await self._call().put("/snapshot/load", body, timeout=LOAD_TIMEOUT_S)
        except VmctlError as exc:
            code = await self._wait_exit(2.0)
            fate = "still running" if code is None else f"exited with code {code}"
            raise SnapshotError(f"firecracker could not load {snap.state}: {exc} "
                                f"(VMM {fate})") from exc
        info = await self._call().get("/")
        if info.get("state") != "Running":
            raise VMProtocolError(f"restored VM is {info.get('state')!r}, not Running")

    async def _adopt(self, record: VMMRecord) -> None:
        self._api = FirecrackerAPI(Path(record.control_socket))
        if self.jailer is not None:
            self._jail = Path(record.control_socket).parent
        try:
            info = await self._api.get("/", timeout=5.0)
            if info.get("state") not in ("Running", "Paused"):
                raise VMProtocolError(f"adopted VMM is {info.get('state')!r}")
        except BaseException:
            await self._api.aclose()  # the caller may drop us without destroy()
            self._api = None
            raise
        self._start_console()  # drains what the VMM wrote while no daemon read it
        try:
            self.version = parse_version(str(info.get("vmm_version", "")))
        except ValueError:
            self.version = None

    async def _finish_restore(self, before_resume: Callable[[], None]) -> None:
        info = await self._call().get("/")
        if info.get("state") == "Paused":
            before_resume()
            await self._resume()

    async def _pause(self) -> None:
        await self._call().patch("/vm", {"state": "Paused"})

    async def _resume(self) -> None:
        await self._call().patch("/vm", {"state": "Resumed"})

    async def _is_paused(self) -> bool:
        return (await self._call().get("/")).get("state") == "Paused"

    async def _snapshot(self, dest: Path) -> SnapshotFiles:
        assert self.spec is not None
        await self._pause()
        where = self._jail or dest  # the VMM writes inside its jail when jailed
        tmp_state, tmp_mem = where / (STATE_FILE + ".tmp"), where / (MEMORY_FILE + ".tmp")
        try:
            await self._call().put("/snapshot/create", {
                "snapshot_type": "Full", "snapshot_path": self._vmm_path(tmp_state),
                "mem_file_path": self._vmm_path(tmp_mem)}, timeout=SNAPSHOT_TIMEOUT_S)
            shutil.move(tmp_state, dest / STATE_FILE)
            shutil.move(tmp_mem, dest / MEMORY_FILE)
        finally:
            tmp_state.unlink(missing_ok=True)
            tmp_mem.unlink(missing_ok=True)
        if not _same_file(self.spec.disk, dest / DISK_FILE):
            # (Same file: the VM runs on this snapshot's disk; resuming it mutates the snapshot.)
            await copy_sparse(self.spec.disk, dest / DISK_FILE)
        extra = {"firecracker_version": self.version,
                 "tap": self.spec.tap if self.spec.netns is not None else None,
                 "vcpus": self.spec.vcpus, "mem_mib": self.spec.mem_mib}
        return SnapshotFiles(state=dest / STATE_FILE, memory=dest / MEMORY_FILE,
                             disk=dest / DISK_FILE, accel=Accel.KVM, driver=self.name,
                             extra=extra)

    async def _destroy(self) -> None:
        try:
            await super()._destroy()
        finally:
            await self._stop_console(drain_timeout=1.0)  # the VMM is gone: EOF comes at once

    async def _quit(self) -> None:
        try:
            if self._proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            elif self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        finally:
            api, self._api = self._api, None
            if api is not None:
                await api.aclose()

    def _cleanup_files(self) -> None:
        super()._cleanup_files()
        link = self.spec.workdir / ROOT_DRIVE_PATH if self.spec is not None else None
        if link is not None and link.is_symlink():
            link.unlink()
        if self.spec is not None:
            (self.spec.workdir / CONSOLE_FIFO).unlink(missing_ok=True)  # open fds keep working
        if self._jail is not None:
            shutil.rmtree(self._jail.parent, ignore_errors=True)  # <base>/<exec>/<id>
            self._jail = None

    # -- helpers --------------------------------------------------------------------------------

    def _call(self) -> FirecrackerAPI:
        if self._api is None:
            raise VMProtocolError("firecracker API is not connected")
        return self._api

    async def _prepare(self, spec: VMSpec, link_rootfs: bool = True) -> str:
        """Check the binary and host, and lay out the files the VMM will open."""
        if spec.accel is not Accel.KVM:
            raise VMStartError(f"firecracker runs on KVM only; spec.accel is {spec.accel.value}")
        binary = shutil.which(self.binary)
        if binary is None:
            raise VMStartError(f"{self.binary!r} not found on PATH")
        self.version = await binary_version(binary)
        if self.version != FIRECRACKER_VERSION:
            raise VMStartError(f"{binary} is Firecracker {self.version}; this driver is pinned "
                               f"to {FIRECRACKER_VERSION} (see docs/bare-metal.md)")
        if self.jailer is not None:
            self._jail = jail_root(self.jailer, binary, spec.vm_id)
            shutil.rmtree(self._jail.parent, ignore_errors=True)  # a stale jail of this id
            self._jail.mkdir(parents=True)
        if link_rootfs:
            self._link_rootfs(spec.disk)
        return binary

    def _link_rootfs(self, disk: Path) -> None:
        assert self.spec is not None
        if self._jail is None:
            link = self.spec.workdir / ROOT_DRIVE_PATH
            link.unlink(missing_ok=True)
            link.symlink_to(disk.resolve())
        else:
            self._expose(disk, ROOT_DRIVE_PATH, writable=True)

    def _expose(self, path: Path, name: str, writable: bool = False) -> str:
        """The name under which the VMM opens ``path``: the path itself, or a hard
        link in the jail (a copy for read-only files on another filesystem)."""
        if self._jail is None:
            return str(path.resolve())
        target = self._jail / name
        try:
            os.link(path, target)
        except OSError as exc:
            if writable:
                raise VMStartError(f"cannot hard-link {path} into the jail {self._jail}: "
                                   f"{exc.strerror} (keep disks and chroot_base on one "
                                   "filesystem)") from exc
            shutil.copyfile(path, target)
        assert self.jailer is not None and self.spec is not None
        os.chown(target, *jail_owner(self.jailer, self.spec))
        return name

    def _vmm_path(self, host_path: Path) -> str:
        if self._jail is None:
            return str(host_path)
        return "/" + str(host_path.relative_to(self._jail))

    async def _spawn(self, spec: VMSpec, binary: str) -> None:
        if self.jailer is not None:
            assert self._jail is not None
            argv = jailer_argv(self.jailer, binary, spec.vm_id, spec.netns,
                               jail_owner(self.jailer, spec))
            socket_path = self._jail / JAIL_API_SOCKET
        else:
            socket_path = spec.workdir / API_SOCKET
            argv = [binary, "--api-sock", str(socket_path)]
            if spec.netns is not None:
                argv = ["ip", "netns", "exec", spec.netns, *argv]
        if len(os.fsencode(socket_path)) > _SUN_PATH_MAX:
            raise VMStartError(f"API socket path {socket_path} is too long for a Unix socket")
        socket_path.unlink(missing_ok=True)  # Firecracker refuses to bind over a stale one
        self.control_socket = socket_path
        log_path = self.log_path = spec.workdir / CONSOLE_LOG
        # stdout/stderr go to a FIFO the daemon copies into the capped console.log: the
        # guest decides what its serial console prints, so it must not reach a file directly.
        out = console_fifo(spec.workdir / CONSOLE_FIFO)
        try:
            # A new session: the VMM must outlive the daemon (it is re-adopted on restart).
            self._proc = await asyncio.create_subprocess_exec(
                *argv, cwd=spec.workdir, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=out, start_new_session=True)
        finally:
            os.close(out)
        self.pid = self._proc.pid
        self._start_console()
        self._api = FirecrackerAPI(socket_path)
        proc = self._proc
        try:
            await self._api.wait_ready(self.start_timeout, alive=lambda: proc.returncode is None)
        except VmctlError as exc:
            if proc.returncode is not None:
                await self._stop_console(drain_timeout=1.0)
            raise VMStartError(f"firecracker did not come up: {exc}; "
                               f"log: {_tail(log_path)}") from exc

    def _start_console(self) -> None:
        assert self.spec is not None
        self._console = ConsoleLog.from_fifo(self.spec.workdir / CONSOLE_FIFO,
                                             self.spec.workdir / CONSOLE_LOG,
                                             self.console_log_bytes)
        self._console.start()

    async def _stop_console(self, drain_timeout: float = 0.0) -> None:
        console, self._console = self._console, None
        if console is not None:
            await console.aclose(drain_timeout)

    async def _wait_exit(self, timeout: float) -> int | None:
        if self._proc is None:
            return None
        try:
            return await asyncio.wait_for(self._proc.wait(), timeout)
        except TimeoutError:
            return None


async def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a disk image cheaply: reflink where the filesystem can, else sparse."""
    tmp = dst.with_name(dst.name + ".tmp")
    proc = await asyncio.create_subprocess_exec(
        "cp", "--reflink=auto", "--sparse=always", str(src), str(tmp),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        tmp.unlink(missing_ok=True)
        raise
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SnapshotError(f"copying disk {src} -> {dst} failed: {err.decode().strip()}")
    os.replace(tmp, dst)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return False


async def _restore_disk(snapshot_disk: Path, disk: Path) -> None:
    """The VM resumes on ``disk``, which must hold the snapshot's disk: copy it over
    unless the caller handed us the snapshot's own file (the snapshot is then consumed)."""
    if _same_file(snapshot_disk, disk):
        return
    disk.parent.mkdir(parents=True, exist_ok=True)
    await copy_sparse(snapshot_disk, disk)


def _tail(path: Path, limit: int = 800) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""
