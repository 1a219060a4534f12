"""The driver contract: one Driver instance controls one VMM process.

Drivers differ only where the VMMs differ (QMP vs Firecracker's REST API). The
public methods here wrap the ``_``-prefixed ones a driver implements: they keep
the process bookkeeping and guarantee that a failed start leaves no process
behind.

Lifecycle of one instance::

    boot(spec) | restore(snapshot, spec) | restore_when_ready(spec, snapshot) | adopt(record)
        -> pause() / resume() / snapshot(dest)  (any order the VMM allows)
        -> destroy()                             (idempotent; kills the VMM)

``snapshot`` leaves the VM paused; the caller decides to resume or destroy it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from vmctl.errors import MigrationError, VMGoneError, VMStartError
from vmctl.spec import Accel, SnapshotFiles, VMMRecord, VMSpec

log = logging.getLogger(__name__)

# What a restore loads, once it is ready: called (once) when the VMM is up and waiting.
SnapshotSource = Callable[[], Awaitable[SnapshotFiles]]

# Opens the stream for one channel ("disk", "ram") of a live migration to its destination.
Connect = Callable[[str], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass(frozen=True)
class LiveStats:
    """What one live migration out took (``Machine.migrate_out`` fills in the last two)."""

    mirror_ms: float  # start to the disk mirror in sync
    send_ms: float  # start to the source stopped with everything sent
    downtime_ms: float  # QEMU's own figure for the source's stop
    stopped_at: float | None  # wall clock of the source's STOP (QMP event)
    ram_bytes: int  # migration stream bytes sent
    disk_bytes: int  # the mirror's progress when it was in sync
    live: bool  # RAM was copied while the guest ran (else: stopped, then copied)
    total_ms: float = 0.0  # start to the destination's guest running
    paused_ms: float | None = None  # the source's STOP to the destination's guest running


class Driver(abc.ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        self.spec: VMSpec | None = None
        self.pid: int | None = None
        self.control_socket: Path | None = None
        self.started_at: float = 0.0
        self.last_error: BaseException | None = None
        self.log_path: Path | None = None  # the VMM's own stderr/stdout
        self._proc: asyncio.subprocess.Process | None = None

    # -- public API -------------------------------------------------------

    @property
    def accel(self) -> Accel | None:
        return self.spec.accel if self.spec else None

    async def boot(self, spec: VMSpec) -> None:
        """Start a fresh VM from its kernel and disk."""
        await self._start(spec, self._boot)

    async def restore(self, snapshot: SnapshotFiles, spec: VMSpec,
                      before_resume: Callable[[], None] | None = None) -> None:
        """Start a new VMM process from ``snapshot`` and leave the guest running.

        ``before_resume`` runs after the state has loaded and just before the guest
        may execute (the last moment the snapshot is still unused)."""
        await self.restore_when_ready(spec, lambda: _ready(snapshot), before_resume)

    async def restore_when_ready(self, spec: VMSpec, snapshot: SnapshotSource,
                                 before_resume: Callable[[], None] | None = None) -> None:
        """``restore``, with the VMM started before its snapshot is ready: the process
        starts (and waits, loading nothing) while the caller still rebuilds or verifies
        the snapshot; ``snapshot()`` is awaited once the VMM is up, and its files are
        handed over only then. If it raises, the VMM is killed and the error propagates
        (a SnapshotError stays recognisable as the cause)."""
        await self._start(spec, lambda s: self._restore(snapshot, s, before_resume or _nothing))

    async def finish_restore(self, before_resume: Callable[[], None]) -> None:
        """On an adopted VMM that was restoring: wait for the load, then let the guest run."""
        await self._finish_restore(before_resume)

    async def adopt(self, record: VMMRecord, spec: VMSpec) -> None:
        """Take control of a VMM that a previous daemon started (raises VMGoneError if dead)."""
        if not pid_alive(record.pid):
            raise VMGoneError(f"VMM pid {record.pid} is not running")
        self.spec, self.pid = spec, record.pid
        self.control_socket = Path(record.control_socket)
        self.started_at = record.started_at
        await self._adopt(record)

    async def pause(self) -> None:
        await self._pause()

    async def resume(self) -> None:
        await self._resume()

    async def is_paused(self) -> bool:
        """Whether the VM's vCPUs are stopped (by ``pause``, or a load that has not resumed)."""
        return await self._is_paused()

    async def snapshot(self, dest: Path) -> SnapshotFiles:
        """Pause the VM and save device state (+ memory where the VMM needs it) under dest."""
        dest.mkdir(parents=True, exist_ok=True)
        return await self._snapshot(dest)

    async def resize_disk(self, size_bytes: int) -> None:
        """Grow the VM's disk to ``size_bytes`` while it runs, telling the guest."""
        from vmctl.disks import DiskError
        raise DiskError(f"{self.name}: growing a running VM's disk is not supported")

    # Live migration: QEMU only (vmctl/drivers/qemu.py says how).

    async def listen_incoming(self, spec: VMSpec) -> dict[str, Path]:
        raise MigrationError(f"{self.name}: live migration is not supported")

    async def finish_incoming(self, before_resume: Callable[[], None], timeout: float) -> None:
        raise MigrationError(f"{self.name}: live migration is not supported")

    async def send_live(self, connect: Connect, timeout: float,
                        live: bool | None = None) -> LiveStats:
        raise MigrationError(f"{self.name}: live migration is not supported")

    async def resume_after_send(self) -> None:
        raise MigrationError(f"{self.name}: live migration is not supported")

    async def destroy(self) -> None:
        """Stop the VMM for good. Idempotent, safe under cancellation."""
        try:
            await asyncio.shield(self._destroy())
        finally:
            self.pid = None

    def record(self) -> VMMRecord:
        assert self.spec and self.pid and self.control_socket
        return VMMRecord(self.name, self.pid, str(self.control_socket), str(self.spec.workdir),
                         self.spec.accel.value, self.started_at)

    def alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)

    def exit_detail(self) -> str:
        """How a VMM we started ended (exit status or signal, and the tail of its log), for
        error messages: a VMM that dies by itself is the first thing an operator asks about."""
        rc = self._proc.returncode if self._proc is not None else None
        how = "" if rc is None else (f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}")
        tail = ""
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                tail = self.log_path.read_bytes()[-400:].decode(errors="replace").strip()
        parts = [p for p in (how, f"log: {tail}" if tail else "") if p]
        return f" ({'; '.join(parts)})" if parts else ""

    # -- shared mechanics ---------------------------------------------------

    async def _start(self, spec: VMSpec, how) -> None:  # type: ignore[no-untyped-def]
        self.spec = spec
        spec.workdir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        try:
            await how(spec)
        except BaseException as exc:
            self.last_error = exc
            await asyncio.shield(self._destroy())
            self.pid = None
            if isinstance(exc, VMStartError) or not isinstance(exc, Exception):
                raise
            raise VMStartError(f"{self.name}: {exc}") from exc

    async def _destroy(self) -> None:
        """Ask the VMM to quit, then make sure the process is gone."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._quit(), 2.0)
        await self._reap(timeout=3.0)
        self._cleanup_files()

    async def _reap(self, timeout: float) -> None:
        pid = self.pid
        if pid is None:
            return
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
            return
        await kill_pid(pid, timeout)

    def _cleanup_files(self) -> None:
        if self.control_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.control_socket.unlink()

    # -- what each VMM implements ------------------------------------------------

    @abc.abstractmethod
    async def _boot(self, spec: VMSpec) -> None: ...

    @abc.abstractmethod
    async def _restore(self, snapshot: SnapshotSource, spec: VMSpec,
                       before_resume: Callable[[], None]) -> None:
        """Start the VMM waiting for its state, then ``await snapshot()`` and load it."""

    @abc.abstractmethod
    async def _finish_restore(self, before_resume: Callable[[], None]) -> None: ...

    @abc.abstractmethod
    async def _adopt(self, record: VMMRecord) -> None: ...

    @abc.abstractmethod
    async def _pause(self) -> None: ...

    @abc.abstractmethod
    async def _resume(self) -> None: ...

    @abc.abstractmethod
    async def _is_paused(self) -> bool: ...

    @abc.abstractmethod
    async def _snapshot(self, dest: Path) -> SnapshotFiles: ...

    @abc.abstractmethod
    async def _quit(self) -> None:
        """Ask the VMM to exit (best effort; the base class kills it if this fails)."""


def _nothing() -> None:
    pass


async def _ready(snapshot: SnapshotFiles) -> SnapshotFiles:
    return snapshot


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except (FileNotFoundError, IndexError):
        return False


async def kill_pid(pid: int, timeout: float) -> None:
    """Wait for a non-child pid to exit; SIGTERM then SIGKILL if it does not."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                return
            await asyncio.sleep(0.02)
    log.error("pid %d survived SIGKILL", pid)
