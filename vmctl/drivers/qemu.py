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
import time
from collections.abc import Callable
from pathlib import Path

from vmctl import cgroup, confine, faults, streams
from vmctl.console import DEFAULT_CONSOLE_LOG_BYTES, ConsoleLog
from vmctl.driver import Connect, Driver, LiveStats, SnapshotSource
from vmctl.errors import (MigrationError, SnapshotError, VMStartError, VMTimeoutError,
                          VmctlError)
from vmctl.qmp import QMPClient
from vmctl.spec import Accel, SnapshotFiles, VMMRecord, VMSpec

QEMU_BINARY = "qemu-system-x86_64"
STATE_FILE = "vmstate"
STATE_FD_NAME = "vmstate"  # the device-state file's name on QMP (getfd)
QMP_SOCKET = "qmp.sock"
MIGRATE_SOCKET = "migrate.sock"
# Live migration (vmctl.migrate). The destination's QEMU listens on two sockets in its own
# directory (its chroot), which only the daemon connects to; the source's QEMU connects to
# two sockets the daemon listens on in its directory. QEMU itself reaches no other host.
NBD_SOCKET = "nbd.sock"  # destination: its disk, exported over NBD for the mirror
INCOMING_SOCKET = "incoming.sock"  # destination: the migration stream (RAM, devices)
OUT_DISK_SOCKET = "out-disk.sock"  # source: the mirror's NBD client connects here
OUT_RAM_SOCKET = "out-ram.sock"  # source: ``migrate`` sends here
MIRROR_JOB = "agentbox-migrate"
MIRROR_NODE = "agentbox-migrate-target"
NBD_EXPORT = "root"
CONSOLE_SOCKET = "console.sock"
CONSOLE_LOG = "console.log"
_MIGRATION_POLL_S = 0.002
# Under TCG the guest sees every feature TCG emulates, except ERMS: with it, the guest kernel
# (clear_page, copy_page) and glibc (memset, memcpy) use `rep stosb`/`rep movsb`, which TCG
# runs a byte per iteration; without it they use 8-byte or vector loops. A 64 MiB bytearray
# costs half as much, and zeroing freed pages (init_on_free) stays cheap: bench/zeroing.py.
TCG_CPU = "max,-erms"
# The pause QEMU aims for when it decides to stop the source for the last of the RAM.
LIVE_DOWNTIME_MS = 300
RELAY_DRAIN_S = 30.0  # after a migration completed, for its streams to reach the other side



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
        self.resumed_at: float | None = None  # an incoming migration's RESUME (wall clock)

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
                for name in (CONSOLE_SOCKET, MIGRATE_SOCKET, NBD_SOCKET, INCOMING_SOCKET,
                             OUT_DISK_SOCKET, OUT_RAM_SOCKET):  # may be under /run/agentbox
                    socket_path(self.spec, name).unlink(missing_ok=True)
                if self.cgroups is not None:
                    await asyncio.to_thread(self.cgroups.remove, self.spec.vm_id)

    # -- live migration (vmctl.migrate) ---------------------------------------------

    async def listen_incoming(self, spec: VMSpec) -> dict[str, Path]:
        """Start QEMU for ``spec`` waiting for a live migration: its disk exported
        (writable) over NBD for the source's mirror, its migration stream awaited, the
        guest held (``-S``) until ``finish_incoming``. Returns the Unix sockets QEMU
        listens on (host paths; only the daemon connects to them), by channel."""
        async def start(s: VMSpec) -> None:
            await self._spawn(s, ["-S", "-incoming", "defer"])
            await self._set_live_capabilities(outgoing=False)
            await self._qmp.execute("nbd-server-start", {"addr": {
                "type": "unix", "data": {"path": str(_qemu_side(s, NBD_SOCKET))}}})
            await self._qmp.execute("nbd-server-add", {"device": "root", "name": NBD_EXPORT,
                                                       "writable": True})
            await self._qmp.execute("migrate-incoming",
                                    {"uri": f"unix:{_qemu_side(s, INCOMING_SOCKET)}"})
        await self._start(spec, start)
        return {"disk": _host_side(spec, NBD_SOCKET), "ram": _host_side(spec, INCOMING_SOCKET)}

    async def finish_incoming(self, before_resume: Callable[[], None], timeout: float) -> None:
        """Wait until the migration stream has loaded, stop the NBD export (the source's
        mirror ended before the stream's last part was sent) and let the guest run."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._wait_migration(timeout, MigrationError, "incoming migration",
                                   _MIGRATION_POLL_S * 5)
        await self._qmp.execute("nbd-server-stop")
        await self._wait_running(timeout=max(1.0, deadline - loop.time()),
                                 before_resume=before_resume)
        with contextlib.suppress(VMTimeoutError):
            self.resumed_at = _event_time(await self._qmp.wait_event("RESUME", 1.0))

    async def send_live(self, connect: Connect, timeout: float,
                        live: bool | None = None) -> LiveStats:
        """Migrate the running VM out: its disk's top layer mirrored to the destination's
        NBD export while the guest runs, then RAM and devices by ``migrate``. The mirror is
        ended (in sync) while the source is stopped before the switch-over, so the
        destination's disk is whole before its device state arrives.

        ``live``: RAM too is copied while the guest runs (pre-copy), and the guest stops
        only for the last dirty pages. None (the default) decides by ``live_ram_safe``:
        under TCG before QEMU 9.0 the guest is stopped before RAM is sent (see there).

        ``connect(channel)`` opens the stream for "disk" or "ram" to the destination. On
        success the VM is stopped here (QEMU's ``postmigrate``): the caller starts the
        destination, then destroys this VMM, or ``resume_after_send``. On failure or
        cancellation the VM runs again here as before and the error is raised."""
        assert self.spec is not None
        spec, loop = self.spec, asyncio.get_running_loop()
        deadline = loop.time() + timeout
        started = time.monotonic()
        mirrored = 0
        async with contextlib.AsyncExitStack() as stack:
            disk_path = await stack.enter_async_context(
                _outbound(spec, OUT_DISK_SOCKET, "disk", connect))
            ram_path = await stack.enter_async_context(
                _outbound(spec, OUT_RAM_SOCKET, "ram", connect))
            try:
                await self._set_live_capabilities(outgoing=True)
                await self._qmp.execute("migrate-set-parameters", {
                    "max-bandwidth": 1 << 40, "downtime-limit": LIVE_DOWNTIME_MS})
                await self._qmp.execute("blockdev-add", {
                    "driver": "nbd", "node-name": MIRROR_NODE, "export": NBD_EXPORT,
                    "server": {"type": "unix", "path": str(disk_path)}})
                await self._qmp.execute("blockdev-mirror", {
                    "job-id": MIRROR_JOB, "device": "root", "target": MIRROR_NODE,
                    "sync": "top"})
                mirrored = await self._wait_mirror(deadline, ready=True)
                mirror_ms = (time.monotonic() - started) * 1000
                if live is None:
                    live = await self.live_ram_safe()
                if not live:
                    await self._qmp.execute("stop")
                await self._qmp.execute("migrate", {"uri": f"unix:{ram_path}"})
                await self._wait_outgoing(deadline, {"pre-switchover"})
                # The guest is stopped now. End the mirror (a cancel after READY waits until
                # the target holds every write), then let the last of the stream go.
                await self._qmp.execute("block-job-cancel", {"device": MIRROR_JOB})
                await self._wait_mirror(deadline, ready=False)
                await self._qmp.execute("blockdev-del", {"node-name": MIRROR_NODE})
                await self._qmp.execute("migrate-continue", {"state": "pre-switchover"})
                info = await self._wait_outgoing(deadline, {"completed"})
            except BaseException:
                await asyncio.shield(self._undo_send())
                raise
        ram = info.get("ram") or {}
        return LiveStats(mirror_ms=mirror_ms, send_ms=(time.monotonic() - started) * 1000,
                         downtime_ms=float(info.get("downtime") or 0),
                         stopped_at=self._stop_time(), ram_bytes=int(ram.get("transferred") or 0),
                         disk_bytes=mirrored, live=bool(live))

    async def live_ram_safe(self) -> bool:
        """Whether this VMM tracks every guest write while RAM is copied live.

        KVM does (its dirty log). TCG in QEMU before 9.0 does not: syncing the dirty bitmap
        a word at a time clears bits without resetting the vCPUs' TLB entries that skip
        dirty marking, so later writes through them are lost (QEMU commit "system/physmem:
        Fix migration dirty bitmap coherency with TCG memory access", 2024, in 9.0). We saw
        it here: a guest serving network traffic during the copy came up on the destination
        with a corrupt virtqueue or crashed, in 2 of 5 runs. There the guest is stopped
        before RAM is sent (stop and copy): a longer pause, never a corrupt guest."""
        assert self.spec is not None
        if self.spec.accel is Accel.KVM:
            return True
        version = (await self._qmp.execute("query-version")).get("qemu") or {}
        return int(version.get("major") or 0) >= 9

    async def resume_after_send(self) -> None:
        """After ``send_live`` succeeded but the destination did not start: run here again
        (``cont`` re-activates the disk QEMU handed over at the end of the stream)."""
        with contextlib.suppress(VmctlError):
            await self._qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "pause-before-switchover", "state": False}]})
        if await self._is_paused() or (await self._qmp.execute("query-status")).get(
                "status") != "running":
            await self._qmp.execute("cont")

    async def _set_live_capabilities(self, outgoing: bool) -> None:
        # x-ignore-shared off: RAM is shared with its file here, but the destination's file
        # is another host's, so RAM must travel (a restore or snapshot sets it on again).
        caps = [{"capability": "x-ignore-shared", "state": False}]
        if outgoing:
            caps.append({"capability": "pause-before-switchover", "state": True})
        await self._qmp.execute("migrate-set-capabilities", {"capabilities": caps})

    async def _wait_mirror(self, deadline: float, ready: bool) -> int:
        """Until the mirror job is READY (``ready``) or gone; returns the bytes it copied."""
        loop = asyncio.get_running_loop()
        offset = 0
        while True:
            jobs = [j for j in await self._qmp.execute("query-block-jobs")
                    if j.get("device") == MIRROR_JOB]
            if not jobs:
                if ready:
                    raise MigrationError("the disk mirror ended before it was in sync: "
                                         f"{self._job_error()}")
                return offset
            job = jobs[0]
            offset = int(job.get("offset") or 0)
            if job.get("status") == "concluded" or job.get("error"):
                raise MigrationError(f"the disk mirror failed: {job.get('error') or 'concluded'}")
            if ready and job.get("ready"):
                return offset
            if loop.time() > deadline:
                raise VMTimeoutError("the disk mirror did not " +
                                     ("reach sync" if ready else "end") + " in time")
            await asyncio.sleep(0.02)

    def _job_error(self) -> str:
        for ev in self._qmp.events:
            if ev.get("event") in ("BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED"):
                return str(ev.get("data", {}).get("error", ev.get("event")))
        return "no reason given"

    def _stop_time(self) -> float | None:
        """When the source's vCPUs stopped for the switch-over (QMP's STOP event, wall clock)."""
        for ev in reversed(self._qmp.events):
            if ev.get("event") == "STOP":
                return _event_time(ev)
        return None

    async def _wait_outgoing(self, deadline: float, want: set[str]) -> dict:
        loop = asyncio.get_running_loop()
        while True:
            info = await self._qmp.execute("query-migrate")
            status = info.get("status")
            if status in want:
                return info
            if status in ("failed", "cancelled", "cancelling", None):
                raise MigrationError(f"migration {status}: {info.get('error-desc', '')}")
            if loop.time() > deadline:
                raise VMTimeoutError(f"migration still {status!r} at its deadline")
            await asyncio.sleep(_MIGRATION_POLL_S * 5)

    async def _undo_send(self) -> None:
        """Back to where ``send_live`` started, whatever step failed: no migration, no
        mirror, no NBD client, the guest running. Best effort, step by step."""
        with contextlib.suppress(VmctlError):
            info = await self._qmp.execute("query-migrate")
            if info.get("status") not in (None, "completed", "failed", "cancelled"):
                await self._qmp.execute("migrate_cancel")
                for _ in range(500):  # the stream's thread winds down
                    status = (await self._qmp.execute("query-migrate")).get("status")
                    if status in ("failed", "cancelled", "completed"):
                        break
                    await asyncio.sleep(0.02)
        with contextlib.suppress(VmctlError):
            if any(j.get("device") == MIRROR_JOB
                   for j in await self._qmp.execute("query-block-jobs")):
                await self._qmp.execute("block-job-cancel", {"device": MIRROR_JOB,
                                                             "force": True})
                for _ in range(500):
                    if not any(j.get("device") == MIRROR_JOB
                               for j in await self._qmp.execute("query-block-jobs")):
                        break
                    await asyncio.sleep(0.02)
        with contextlib.suppress(VmctlError):
            await self._qmp.execute("blockdev-del", {"node-name": MIRROR_NODE})
        with contextlib.suppress(VmctlError):
            await self.resume_after_send()

    # -- helpers ---------------------------------------------------------------

    async def _spawn(self, spec: VMSpec, extra: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        self.control_socket = control_socket_path(spec)
        console_socket = socket_path(spec, CONSOLE_SOCKET)
        for stale in (self.control_socket, console_socket, *(
                p for name in (MIGRATE_SOCKET, NBD_SOCKET, INCOMING_SOCKET)
                for p in (spec.workdir / name, socket_path(spec, name)))):
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

    async def _wait_migration(self, timeout: float, error: type[Exception] = SnapshotError,
                              what: str = "snapshot", poll: float = _MIGRATION_POLL_S) -> None:
        """Until QEMU's migration stream (a snapshot written, or an incoming move loaded)
        completes: ``error`` if it failed, VMTimeoutError after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = await self._qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                name = "migration" if what == "snapshot" else what
                raise error(f"{name} {status}: {info.get('error-desc', '')}")
            if loop.time() > deadline:
                raise VMTimeoutError(f"{what} did not finish within {timeout}s")
            await asyncio.sleep(poll)


def _event_time(event: dict) -> float:
    """A QMP event's timestamp (the VMM host's wall clock)."""
    ts = event.get("timestamp") or {}
    return float(ts.get("seconds", 0)) + float(ts.get("microseconds", 0)) / 1e6


def _qemu_side(spec: VMSpec, name: str) -> Path:
    """Where QEMU finds a socket of its directory (its chroot's root when confined)."""
    return Path("/") / name if spec.confinement else socket_path(spec, name)


def _host_side(spec: VMSpec, name: str) -> Path:
    """Where the daemon finds the same socket."""
    return spec.workdir / name if spec.confinement else socket_path(spec, name)


@contextlib.asynccontextmanager
async def _outbound(spec: VMSpec, name: str, channel: str, connect: Connect):  # type: ignore[no-untyped-def]
    """A socket in the VM's directory that its QEMU connects to, each connection spliced
    to ``connect(channel)``; yields the path QEMU uses."""
    relays: set[asyncio.Task] = set()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        relays.add(task)
        try:
            try:
                other = await connect(channel)
            except BaseException:
                writer.close()  # QEMU sees its stream end: its migration or mirror fails
                raise
            await streams.splice((reader, writer), other)
        finally:
            relays.discard(task)

    path = _host_side(spec, name)
    server = await streams.listen_unix(path, relay)
    failed = True
    try:
        confine.chown_private(path, spec.confinement)
        yield _qemu_side(spec, name)
        failed = False
    finally:
        server.close()
        path.unlink(missing_ok=True)
        if not failed and relays:  # the stream's tail may still be on its way
            await asyncio.wait(set(relays), timeout=RELAY_DRAIN_S)
        for task in list(relays):
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)


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
