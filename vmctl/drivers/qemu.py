"""QEMU ``microvm`` driver, controlled over QMP.

Memory model: guest RAM is a ``memory-backend-file`` with ``share=on`` on the
VM's own file (``spec.mem_file``). Snapshots set the ``x-ignore-shared``
migration capability, so the migration stream holds only device state (tens of
KiB, milliseconds) and RAM stays in that file. Restoring maps the same file
again, so a wake is: start QEMU with ``-incoming defer``, stream the device
state in, and let the guest run; pages load on demand.

The command line must be identical between save and restore (device order
fixes each virtio-mmio transport), so both paths build it with ``qemu_argv``;
only ``-incoming`` is appended on restore.

Confinement (``vmctl.confine``): a confined QEMU chroots into its VM directory,
drops to the sandbox's uid and may not spawn processes, so migration never uses
``exec:``. A restore hands QEMU the open device-state file over QMP (``getfd``,
then ``fd:vmstate``), which also lets QEMU start before the snapshot is ready; a
snapshot has QEMU connect to a Unix socket the driver listens on inside the
chroot and the driver writes what arrives to the file. The console goes to a
socket too (``vmctl.console``: a capped log, not a file the guest can grow).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from vmctl import cgroup, confine, faults
from vmctl.console import DEFAULT_CONSOLE_LOG_BYTES, ConsoleLog
from vmctl.driver import Driver, SnapshotSource
from vmctl.errors import SnapshotError, VMStartError, VMTimeoutError, VmctlError
from vmctl.qmp import QMPClient
from vmctl.spec import Accel, SnapshotFiles, VMMRecord, VMSpec

QEMU_BINARY = "qemu-system-x86_64"
STATE_FILE = "vmstate"
STATE_FD_NAME = "vmstate"  # the device-state file's name on QMP (getfd)
QMP_SOCKET = "qmp.sock"
MIGRATE_SOCKET = "migrate.sock"
CONSOLE_SOCKET = "console.sock"
CONSOLE_LOG = "console.log"
_MIGRATION_POLL_S = 0.002
# Under TCG the guest sees every feature TCG emulates, except ERMS: with it, the guest kernel
# (clear_page, copy_page) and glibc (memset, memcpy) use `rep stosb`/`rep movsb`, which TCG
# runs a byte per iteration; without it they use 8-byte or vector loops. A 64 MiB bytearray
# costs half as much, and zeroing freed pages (init_on_free) stays cheap: bench/zeroing.py.
TCG_CPU = "max,-erms"


def qemu_argv(spec: VMSpec, qmp_socket: Path, binary: str = QEMU_BINARY,
              console_socket: Path | None = None) -> list[str]:
    """The full QEMU command line for ``spec`` (no ``-incoming``)."""
    console_socket = console_socket or socket_path(spec, CONSOLE_SOCKET)
    accel = ["-accel", "kvm", "-cpu", "host"] if spec.accel is Accel.KVM else \
        ["-accel", "tcg,tb-size=64", "-cpu", TCG_CPU]
    argv = [
        binary, "-M", "microvm,memory-backend=mem0", *accel,
        "-m", f"{spec.mem_mib}M", "-smp", str(spec.vcpus),
        "-object", f"memory-backend-file,id=mem0,size={spec.mem_mib}M,"
                   f"mem-path={spec.mem_file},share=on",
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(spec.kernel), "-append", spec.cmdline,
        "-drive", f"id=root,file={spec.disk},format={_disk_format(spec.disk)},if=none,"
                  "discard=unmap",
        "-device", "virtio-blk-device,drive=root",
        "-device", "virtio-rng-device",
        "-chardev", f"socket,id=con0,path={console_socket},server=on,wait=off",
        "-serial", "chardev:con0",
        "-qmp", f"unix:{qmp_socket},server=on,wait=off",
        *confine.qemu_args(spec.confinement),
    ]
    if spec.initrd is not None:
        argv[argv.index("-append"):argv.index("-append")] = ["-initrd", str(spec.initrd)]
    if spec.netns is not None:
        argv += ["-netdev", f"tap,id=n0,ifname={spec.tap},script=no,downscript=no",
                 "-device", f"virtio-net-device,netdev=n0,mac={spec.mac}"]
    return argv


# sun_path is 108 bytes; deep data dirs (and golden builds' temp dirs) can exceed it.
_SUN_PATH_MAX = 100
SHORT_SOCKET_DIR = Path("/run/agentbox")


def control_socket_path(spec: VMSpec) -> Path:
    return socket_path(spec, QMP_SOCKET)


def socket_path(spec: VMSpec, name: str) -> Path:
    """A socket QEMU creates at start-up: in the VM's workdir, or under /run/agentbox if
    that path is too long for a Unix socket. The short name carries a digest of the
    workdir: one sandbox id can run under two daemons of one kernel at once (a sandbox
    moving between two hosts of a test fleet), and neither may take the other's socket."""
    path = spec.workdir / name
    if len(str(path)) <= _SUN_PATH_MAX:
        return path
    SHORT_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    where = hashlib.sha256(os.fsencode(spec.workdir)).hexdigest()[:8]
    return SHORT_SOCKET_DIR / f"{spec.vm_id}-{where}.{name}"


def console_beside(control_socket: Path) -> Path:
    """The console socket of a VMM whose QMP socket is ``control_socket`` (as recorded:
    not recomputed, since a VMM an older daemon started may have an older short name)."""
    return control_socket.with_name(
        control_socket.name.removesuffix(QMP_SOCKET) + CONSOLE_SOCKET)


def _disk_format(disk: Path) -> str:
    return "qcow2" if disk.suffix == ".qcow2" else "raw"


class QemuDriver(Driver):
    name = "qemu"

    def __init__(self, binary: str = QEMU_BINARY, cgroups: cgroup.CgroupManager | None = None,
                 console_log_bytes: int = DEFAULT_CONSOLE_LOG_BYTES) -> None:
        super().__init__()
        self.binary = binary
        self.cgroups = cgroups
        self.console_log_bytes = console_log_bytes
        self._qmp = QMPClient()
        self._console: ConsoleLog | None = None

    async def _boot(self, spec: VMSpec) -> None:
        await self._spawn(spec, [])

    async def _restore(self, snapshot: SnapshotSource, spec: VMSpec,
                       before_resume: Callable[[], None]) -> None:
        # -S: the guest stays paused after the load whatever state the stream carries,
        # so nothing runs before ``before_resume`` has marked the snapshot consumed.
        # -incoming defer: QEMU starts, maps the RAM file (it touches no guest RAM while
        # it waits for an incoming state) and waits; the snapshot may still be being
        # rebuilt into that file or verified meanwhile (``restore_when_ready``).
        await self._spawn(spec, ["-S", "-incoming", "defer"])
        await self._qmp.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})
        faults.point("restore.waiting")
        snap = await snapshot()
        if snap.driver != self.name:
            raise SnapshotError(f"snapshot was taken by {snap.driver!r}, not qemu")
        if snap.accel is not spec.accel:
            raise SnapshotError(f"snapshot was taken under {snap.accel.value}, "
                                f"this host runs {spec.accel.value}")
        if not snap.state.is_file():
            raise SnapshotError(f"snapshot state {snap.state} is missing")
        # The state file is opened here and handed over on the QMP socket (a confined
        # QEMU can open nothing itself any more).
        state_fd = os.open(snap.state, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await self._qmp.execute("getfd", {"fdname": STATE_FD_NAME}, fds=(state_fd,))
        finally:
            os.close(state_fd)
        await self._qmp.execute("migrate-incoming", {"uri": f"fd:{STATE_FD_NAME}"})
        faults.point("restore.loading")
        await self._wait_running(timeout=30.0, before_resume=before_resume)

    async def _finish_restore(self, before_resume: Callable[[], None]) -> None:
        await self._wait_running(timeout=30.0, before_resume=before_resume)

    async def _adopt(self, record: VMMRecord) -> None:
        control = Path(record.control_socket)
        await self._qmp.connect(control, timeout=5.0)
        self._start_console(console_beside(control))

    async def resize_disk(self, size_bytes: int) -> None:
        # Raises the qcow2 overlay's virtual size and sends the guest a config change.
        await self._qmp.execute("block_resize", {"device": "root", "size": size_bytes})

    async def _pause(self) -> None:
        await self._qmp.execute("stop")

    async def _resume(self) -> None:
        await self._qmp.execute("cont")

    async def _is_paused(self) -> bool:
        return (await self._qmp.execute("query-status")).get("status") == "paused"

    async def _snapshot(self, dest: Path) -> SnapshotFiles:
        assert self.spec is not None
        tmp, final = dest / (STATE_FILE + ".tmp"), dest / STATE_FILE
        await self._qmp.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})
        await self._qmp.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        await self._qmp.execute("stop")
        async with migration_sink(self.spec, tmp) as (uri, received):
            await self._qmp.execute("migrate", {"uri": uri})
            faults.point("suspend.migrating")
            await self._wait_migration(timeout=120.0)
            await asyncio.wait_for(received, timeout=30.0)
        os.replace(tmp, final)
        return SnapshotFiles(state=final, memory=self.spec.mem_file, disk=self.spec.disk,
                             accel=self.spec.accel, driver=self.name)

    async def _quit(self) -> None:
        try:
            await self._qmp.execute("quit", timeout=2.0)
        finally:
            await self._qmp.close()

    async def _destroy(self) -> None:
        try:
            await super()._destroy()
        finally:
            await self._stop_console()
            if self.spec is not None:
                for name in (CONSOLE_SOCKET, MIGRATE_SOCKET):  # may live under /run/agentbox
                    socket_path(self.spec, name).unlink(missing_ok=True)
                if self.cgroups is not None:
                    await asyncio.to_thread(self.cgroups.remove, self.spec.vm_id)

    # -- helpers ---------------------------------------------------------------

    async def _spawn(self, spec: VMSpec, extra: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        self.control_socket = control_socket_path(spec)
        console_socket = socket_path(spec, CONSOLE_SOCKET)
        for stale in (self.control_socket, console_socket, spec.workdir / MIGRATE_SOCKET,
                      socket_path(spec, MIGRATE_SOCKET)):
            stale.unlink(missing_ok=True)
        argv = qemu_argv(spec, self.control_socket, self.binary, console_socket) + extra
        if spec.netns is not None:
            argv = ["ip", "netns", "exec", spec.netns, *argv]
        # Outermost: `ip netns exec` mounts a fresh /sys, which has no cgroup mounts.
        argv = cgroup.wrap(argv, await asyncio.to_thread(self._prepare_confinement, spec))
        log_path = self.log_path = spec.workdir / "vmm.log"
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
                       "ab") as log_file:
            # A new session: the VMM must outlive the daemon (it is re-adopted on restart).
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                start_new_session=True, pass_fds=pass_fds)
        self.pid = self._proc.pid
        try:
            await self._qmp.connect(self.control_socket, timeout=10.0, alive=self.alive)
        except Exception as exc:
            tail = _tail(log_path)
            raise VMStartError(f"QEMU did not come up: {exc}; log: {tail}") from exc
        self._start_console()

    def _prepare_confinement(self, spec: VMSpec) -> list[Path]:
        """Give the VM's files to its uid (0600; its directory 0700) and make its cgroup;
        returns the cgroup.procs files the VMM must join."""
        c = spec.confinement
        if not spec.mem_file.exists():  # a cold boot: QEMU would create it world-readable
            os.close(os.open(spec.mem_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        for path in (spec.disk, spec.mem_file):
            if path.exists():
                confine.chown_private(path, c)
        confine.chown_private(spec.workdir, c, mode=0o700)
        if c is None:
            return []
        confine.mirror_into_chroot(c.chroot, confine.backing_chain(spec.disk))
        if self.cgroups is None:
            return []
        return self.cgroups.create(spec.vm_id, c.limits)

    def _start_console(self, console_socket: Path | None = None) -> None:
        assert self.spec is not None
        self._console = ConsoleLog(console_socket or socket_path(self.spec, CONSOLE_SOCKET),
                                   self.spec.workdir / CONSOLE_LOG, self.console_log_bytes)
        self._console.start()

    async def _stop_console(self) -> None:
        console, self._console = self._console, None
        if console is not None:
            await console.aclose()

    async def _wait_running(self, timeout: float, before_resume: Callable[[], None]) -> None:
        """Wait for the incoming stream to load, then start the guest with ``cont``.

        A load that fails (QEMU exits, or ends in another state) is a SnapshotError:
        that device state will not load next time either."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                status = (await self._qmp.execute("query-status")).get("status")
            except VmctlError as exc:
                if self.alive():
                    raise
                raise SnapshotError(f"QEMU exited while loading the device state: "
                                    f"{_tail(self.spec.workdir / 'vmm.log') if self.spec else exc}"
                                    ) from exc
            if status == "running":
                return
            if status in ("paused", "postmigrate"):
                before_resume()
                faults.point("restore.before_cont")
                await self._qmp.execute("cont")
                faults.point("restore.resumed")
                return
            if status not in ("inmigrate", "prelaunch"):
                raise SnapshotError(f"the device state did not load (QEMU is {status!r})")
            if loop.time() > deadline:
                raise VMTimeoutError(f"restore did not finish within {timeout}s")
            await asyncio.sleep(_MIGRATION_POLL_S)

    async def _wait_migration(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = await self._qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise SnapshotError(f"migration {status}: {info.get('error-desc', '')}")
            if loop.time() > deadline:
                raise VMTimeoutError(f"snapshot did not finish within {timeout}s")
            await asyncio.sleep(_MIGRATION_POLL_S)


@contextlib.asynccontextmanager
async def migration_sink(spec: VMSpec, dest: Path):  # type: ignore[no-untyped-def]
    """A Unix socket QEMU can migrate to (inside its chroot when confined); yields the
    migrate URI and a future that resolves once the whole stream is in ``dest``."""
    # Confined, QEMU finds it at /migrate.sock in its chroot (the workdir), however long
    # the workdir's own path is; unconfined, it must be a short path like the others.
    path = spec.workdir / MIGRATE_SOCKET if spec.confinement else socket_path(spec, MIGRATE_SOCKET)
    path.unlink(missing_ok=True)
    loop = asyncio.get_running_loop()
    received: asyncio.Future[None] = loop.create_future()

    async def receive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with open(dest, "wb") as out:
                while chunk := await reader.read(1 << 20):
                    out.write(chunk)
            if not received.done():
                received.set_result(None)
        except Exception as exc:
            if not received.done():
                received.set_exception(SnapshotError(f"migration stream: {exc}"))
        finally:
            writer.close()

    dir_fd = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
    try:  # /proc/self/fd/N/name: a long directory path still fits sun_path
        server = await asyncio.start_unix_server(receive, f"/proc/self/fd/{dir_fd}/{path.name}")
    finally:
        os.close(dir_fd)
    try:
        confine.chown_private(path, spec.confinement)
        inside = Path("/") / MIGRATE_SOCKET if spec.confinement else path
        yield f"unix:{inside}", received
    finally:
        server.close()
        path.unlink(missing_ok=True)
        if not received.done():
            received.cancel()


def _tail(path: Path, limit: int = 800) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""


__all__ = ["QemuDriver", "VMStartError", "qemu_argv"]
