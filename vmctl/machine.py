"""One sandbox's VM resources and the mechanics of its lifecycle.

A ``Machine`` owns: the sandbox directory, its network slot (namespace, veth,
TAP), its disk layer, its memory file, the VMM (through a driver) and the
agent client. It knows *how* to create, suspend, wake and destroy; *when* to do
so is decided by the gateway's state machine, which calls these one at a time.

Directory layout (``root``); the disk and memory files are the backend's
``Layout`` (vmctl/disks.py), the only place QEMU and Firecracker differ here::

    disk.qcow2   QEMU: copy-on-write layer over the template's golden disk
    memory       QEMU: guest RAM (the VMM maps it shared; it *is* the memory snapshot)
    disk         Firecracker: raw sparse/reflinked copy of the golden disk (no
                 memory file: the VM maps its snapshot's memory file privately)
    vm/          control socket, console and VMM logs
    snapshot/    while suspended: vmstate + manifest.json (QEMU), or vmstate,
                 memory and a hard link of disk + manifest.json (Firecracker)

``capture`` saves a *running* sandbox as a golden snapshot of its own (a user template or
a fork's shared snapshot): the VM is paused, its device state written, its memory and
disk copied (sparse/reflinked; the disk copy is a qcow2 overlay over the same backing
file), and the VM resumed, with its clock set again, by the time it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from guest.protocol import InitRequest
from vmctl import disk_grow, disks, faults, memdiff, network, ramspare, store
from vmctl.agent_client import AgentClient
from vmctl.disks import copy_sparse
from vmctl.backend import Backend
from vmctl.driver import Connect, Driver, LiveStats, SnapshotSource, kill_pid, pid_alive
from vmctl.egress import EgressPolicy
from vmctl.errors import (MigrationError, OutcomeUnknown, SnapshotError, VMGoneError,
                          VmctlError)
from vmctl.golden import Golden
from vmctl.network import NetSlot
from vmctl.spec import SnapshotFiles, VMMRecord, VMSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MachinePlan:
    """Everything that fixes where a sandbox's VM lives (persisted in the registry)."""

    vm_id: str
    root: Path
    slot: NetSlot
    golden: Golden
    egress: EgressPolicy | None = None  # None: the host's default
    # The guest's disk size (0: the golden's). The golden's RAM and vCPUs are the VM's.
    disk_mib: int = 0


class RestoreError(VmctlError):
    """A wake failed. ``guest_started``: the guest ran, so its snapshot is spent.
    ``snapshot_unusable``: the snapshot is corrupt, missing, truncated, already used,
    or its device state did not load; retrying it cannot help. ``vmm_died``: the VMM
    process ended by itself (killed, crashed) while the guest was coming up."""

    code = "restore_failed"
    status = 502

    def __init__(self, message: str, guest_started: bool,
                 snapshot_unusable: bool = False, vmm_died: bool = False,
                 disk_missing: bool = False) -> None:
        super().__init__(message)
        self.guest_started = guest_started
        self.snapshot_unusable = snapshot_unusable
        self.vmm_died = vmm_died
        self.disk_missing = disk_missing  # a cold boot found no disk: nothing can boot it


SYNC_TIMEOUT_S = 20.0  # guest filesystems flushed before a snapshot (cold-boot fallback)
REFILL_DELAY = 5.0  # seconds after a compact wake before its spare RAM file is remade


async def _settled(fut: asyncio.Future) -> BaseException | None:
    """Wait until ``fut`` is done, through cancellation too (re-raised afterwards: the
    worker thread behind it writes the sandbox's files); returns its exception."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return None if fut.cancelled() else fut.exception()


def hostname_for(vm_id: str) -> str:
    """A sandbox's hostname (a DNS label; sandbox ids are hex)."""
    return f"sbx-{vm_id}"[:63].lower()


class Machine:
    # Declared here, not only in __init__, so that the gateway's port to this class
    # (gateway/sandbox/machine_port.py) can be checked against them (typing.get_type_hints).
    plan: MachinePlan
    backend: Backend
    driver: Driver | None  # the VMM, while one runs
    agent: AgentClient | None  # the guest agent's client, while the VM runs
    paused: bool  # the vCPUs are stopped (``pause``), the VMM and its RAM kept
    # Called (synchronously) with the new VMM's record before its guest may run, so the
    # owner can persist it: after a crash, recovery must find and adopt that VMM.
    on_vmm_started: Callable[[VMMRecord], None] | None

    def __init__(self, plan: MachinePlan, backend: Backend) -> None:
        self.plan = plan
        self.backend = backend
        self.driver = None
        self.agent = None
        self._seal: asyncio.Task | None = None  # after a suspend: seal, later compact
        self._seal_cancel = threading.Event()
        self.paused = False
        self._seal_wake = asyncio.Event()
        self.on_vmm_started = None

    @property
    def spec(self) -> VMSpec:
        p, g, layout = self.plan, self.plan.golden, self.backend.layout
        workdir = p.root / "vm"
        return VMSpec(vm_id=p.vm_id, workdir=workdir, kernel=g.kernel, initrd=g.initrd,
                      cmdline=g.cmdline, disk=layout.disk(p.root), mem_file=layout.memory(p.root),
                      mem_mib=g.mem_mib, vcpus=g.vcpus, netns=p.slot.netns,
                      accel=self.backend.accel, confinement=self.backend.confinement(
                          p.slot.host_addr, p.vm_id, workdir, g.mem_mib, g.vcpus))

    @property
    def tap_owner(self) -> tuple[int, int] | None:
        c = self.spec.confinement
        return (c.uid, c.gid) if c is not None else None

    @property
    def snapshot_dir(self) -> Path:
        return self.plan.root / "snapshot"

    @property
    def spares_dir(self) -> Path | None:
        """Where spare RAM files for compact wakes live (``vmctl.ramspare``), if used."""
        if self.backend.config.ram_spares <= 0 or not self.backend.layout.compacts_memory:
            return None
        return self.plan.root.parent / ramspare.SPARES_DIR

    def vmm_record(self) -> VMMRecord | None:
        return self.driver.record() if self.driver and self.driver.pid else None

    async def create(self) -> None:
        """Materialise the sandbox from the golden snapshot and wait for its agent."""
        root, golden = self.plan.root, self.plan.golden
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        first, _ = await asyncio.gather(
            self.backend.layout.materialise(golden.snapshot, root),
            network.create(self.plan.slot, self.backend.config.network,
                           policy=self.plan.egress, tap_owner=self.tap_owner))
        await self._start_from(first, identity=True)
        if self.plan.disk_mib > self.plan.golden.disk_mib:
            await disk_grow.grow(self.require_agent(), self.driver, self.plan.disk_mib)

    async def capture(self, dest: Path, meta: dict[str, object]) -> float:
        """Write a golden snapshot of the running VM into ``dest`` (which must not exist)
        and let the VM run on; returns how long the guest was paused, in ms.

        A failure leaves the VM running (resumed) and ``dest`` for the caller to remove."""
        assert self.driver is not None
        await self._sync_guest()  # so a cold boot of a clone's disk keeps every file
        dest.mkdir(mode=0o700, parents=True)
        started = time.monotonic()
        try:
            snap = await self.driver.snapshot(dest)  # pauses; device state (+ FC memory, disk)
            files = {}
            for role, name in (("memory", "memory"), ("disk", self.backend.layout.disk_name)):
                path: Path = getattr(snap, role)
                if not path.is_relative_to(dest):  # QEMU: the VM's own files
                    await copy_sparse(path, dest / name)
                    path = dest / name
                files[role] = path
        finally:
            if self.driver is not None and self.driver.alive():
                await self.driver.resume()
        paused_ms = (time.monotonic() - started) * 1000
        if self.agent is not None:
            await self._init_guest()  # its clock stood still while it was paused
        saved = dataclasses.replace(snap, **files)
        for path in (saved.disk, saved.memory, saved.state):  # read by every clone's VMM
            if os.geteuid() == 0:  # a confined VM's files belonged to its uid
                os.chown(path, 0, 0)
            os.chmod(path, 0o444 if path == saved.disk else 0o400)
        await asyncio.to_thread(store.write_manifest, dest, saved, dict(meta),
                                hash_roles=("state",), stat_roles=("memory", "disk"))
        return paused_ms

    async def suspend(self) -> None:
        """Snapshot (device state, plus memory and disk as the layout keeps them) and let
        the VMM exit.

        The snapshot is complete (manifest written, directory renamed into place)
        *before* the VMM is stopped, so a crash in between leaves either a running
        VM or a complete snapshot of a paused one, never neither."""
        assert self.driver is not None
        await self._stop_seal()  # a spare refill still running (``_refill_spares``)
        if self.paused:  # snapshot of a paused sandbox: let it flush its filesystems first
            await self.driver.resume()
            self.paused = False
        await self._sync_guest()
        await self._close_agent()
        layout = self.backend.layout
        tmp = self.plan.root / "snapshot.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        layout.prepare_snapshot(self.plan.root, tmp)
        snap = await self.driver.snapshot(tmp)
        await asyncio.to_thread(store.write_manifest, tmp, snap, hash_roles=layout.suspend_hashed,
                                stat_roles=layout.suspend_stat_checked)
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        os.replace(tmp, self.snapshot_dir)
        faults.point("suspend.written")
        await self.driver.destroy()
        self.driver = None
        self._start_seal()

    def _start_seal(self) -> None:
        """After a suspend, in the background: hash the memory file into the manifest (a
        worker thread: hundreds of ms for 512 MiB, so not on the suspend path), then, once
        the sandbox has slept ``vm.compact_after`` seconds, store that memory as its diff
        from the golden's. A wake stops both first (``_stop_seal``)."""
        self._start_background(self._after_suspend, "seal")

    def _start_background(self, work: Callable[[threading.Event, asyncio.Event],
                                               Awaitable[None]], name: str) -> None:
        """Run ``work(cancel, woken)`` as the machine's one background task on its files,
        which ``_stop_seal`` stops (sets both) and waits for."""
        self._seal_cancel = threading.Event()
        self._seal_wake = asyncio.Event()
        self._seal = asyncio.get_running_loop().create_task(
            work(self._seal_cancel, self._seal_wake), name=f"{name} {self.plan.vm_id}")

    async def _fill_spares(self, cancel: threading.Event) -> int:
        """Make the golden's spare RAM files whole (``vmctl.ramspare``; a worker thread)."""
        if self.spares_dir is None:
            return 0
        return await asyncio.get_running_loop().run_in_executor(
            None, ramspare.fill, self.spares_dir, self.plan.golden.snapshot.memory,
            self.backend.config.ram_spares, cancel)

    async def _after_suspend(self, cancel: threading.Event, woken: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, store.seal, self.snapshot_dir, "memory", cancel)
            delay = self.backend.config.compact_after
            if delay < 0 or not self.backend.layout.compacts_memory:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), delay)
                return  # woken (or destroyed) first
            golden = self.plan.golden.snapshot.memory
            saved = await loop.run_in_executor(None, store.compact_memory, self.snapshot_dir,
                                               golden, cancel)
            if saved is not None:
                log.info("sandbox %s: memory snapshot compacted (%d MiB saved)",
                         self.plan.vm_id, saved >> 20)
            await self._fill_spares(cancel)  # so that its wake writes only the diff
        except (store.SealCancelled, memdiff.Cancelled):
            pass
        except Exception as exc:  # the snapshot stays as it was: usable, just not compact
            log.warning("sandbox %s: sealing/compacting its snapshot failed: %s",
                        self.plan.vm_id, exc)

    async def _stop_seal(self) -> None:
        """Stop the background work on the snapshot and wait until no thread touches it."""
        seal, self._seal = self._seal, None
        if seal is not None:
            self._seal_cancel.set()
            self._seal_wake.set()
            with contextlib.suppress(Exception):
                await asyncio.shield(seal)

    async def abort_suspend(self) -> None:
        """Undo a suspend that failed half-way: resume the paused VM (raises if it is gone)."""
        shutil.rmtree(self.plan.root / "snapshot.tmp", ignore_errors=True)
        if self.driver is None or not self.driver.alive():
            raise VMGoneError(f"VMM of {self.plan.vm_id} is gone")
        await self.driver.resume()
        if self.agent is None:
            self.agent = AgentClient(self.plan.slot.guest_addr)

    async def pause(self) -> None:
        """Stop the vCPUs: no guest CPU use, the VMM and the guest's RAM stay as they are."""
        if self.driver is None or not self.driver.alive():
            raise VMGoneError(f"VMM of {self.plan.vm_id} is gone")
        faults.point("pause.before_stop")
        await self.driver.pause()
        self.paused = True

    async def unpause(self) -> float:
        """Continue a paused VM and fix what the pause made stale (the guest's wall clock;
        the CRNG is reseeded too, as after a restore); returns ms to agent-ready."""
        started = time.monotonic()
        if self.driver is None or not self.driver.alive():
            raise VMGoneError(f"VMM of {self.plan.vm_id} is gone")
        faults.point("unpause.before_cont")
        await self.driver.resume()
        self.paused = False
        await self.require_agent().init(self._init_request())
        return (time.monotonic() - started) * 1000

    async def adopt_paused(self, record: VMMRecord) -> None:
        """Adopt a VMM recorded as paused and make sure its vCPUs are stopped (a daemon
        killed between recording the pause and stopping the VM left it running)."""
        await self.adopt(record)
        assert self.driver is not None
        if not await self.driver.is_paused():
            await self.driver.pause()
        self.paused = True

    async def ensure_running(self) -> None:
        """On an adopted VMM: continue it if it is stopped (a daemon killed between
        recording a wake from pause and the ``cont``)."""
        assert self.driver is not None
        if await self.driver.is_paused():
            await self.driver.resume()
            await self.require_agent().init(self._init_request())
        self.paused = False

    async def stop_vmm(self) -> None:
        """Kill the VMM (its disk and files stay: the sandbox cold-boots them later)."""
        self.paused = False
        await self._abort_start()

    async def wake(self) -> float:
        """Restore from the sandbox's own snapshot; returns ms to agent-ready.

        With ``vm.overlap_restore`` (the default) the VMM starts while the snapshot is
        rebuilt (a compact one) and verified, in a worker thread, and gets its state once
        both are done; otherwise one after the other. Raises RestoreError;
        ``guest_started`` tells whether the guest ran (after which the snapshot no longer
        matches the memory and disk it describes)."""
        started = time.monotonic()
        await self._stop_seal()
        overlap = self.backend.config.overlap_restore
        try:  # before any VMM starts: QEMU maps the memory file at its final path
            prepared = await asyncio.to_thread(store.prepare_memory, self.snapshot_dir,
                                               self.spares_dir)
            if not overlap:
                snap = await asyncio.to_thread(self._ready_snapshot, prepared, started)
        except SnapshotError as exc:
            raise RestoreError(str(exc), guest_started=False, snapshot_unusable=True) from exc
        if overlap:
            await self._start_overlapped(prepared, started)
        else:
            await self._start_from(snap, consumes=self.snapshot_dir)
        # The guest now writes to the memory file and disk the snapshot described.
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        if prepared is not None:
            self._refill_spares()
        return (time.monotonic() - started) * 1000

    def _refill_spares(self) -> None:
        """After a wake from a compact snapshot (which may have taken the golden's spare RAM
        file), make the spares whole again in the background, ``REFILL_DELAY`` later (not
        while the woken guest serves its first requests), so that the next compact wake of
        this template writes only its diff too. Stopped like the seal (``_stop_seal``)."""
        if self.spares_dir is not None:
            self._start_background(self._refill, "refill")

    async def _refill(self, cancel: threading.Event, woken: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), REFILL_DELAY)
            return  # stopped first
        try:
            made = await self._fill_spares(cancel)
        except memdiff.Cancelled:
            return
        except OSError as exc:
            log.warning("sandbox %s: refilling the spare RAM file failed: %s",
                        self.plan.vm_id, exc)
            return
        if made:
            log.info("sandbox %s: %d spare RAM file(s) refilled", self.plan.vm_id, made)

    async def _start_overlapped(self, prepared: store.Rebuild | None, started: float) -> None:
        """Start the VMM now; the snapshot work runs meanwhile in a worker thread, which
        this always waits for (it writes the memory file), whatever happens to the VMM."""
        ready = asyncio.get_running_loop().run_in_executor(
            None, self._ready_snapshot, prepared, started)
        try:
            await self._start_from(lambda: asyncio.shield(ready), consumes=self.snapshot_dir)
        except RestoreError as exc:
            # The VMM may have failed before it asked for the snapshot: an unusable one
            # is still what the caller must hear (FAILED -> cold boot, as without overlap).
            unusable = await _settled(ready)
            if not exc.guest_started and isinstance(unusable, SnapshotError):
                raise RestoreError(str(unusable), guest_started=False,
                                   snapshot_unusable=True) from unusable
            raise
        finally:
            await _settled(ready)

    def _ready_snapshot(self, prepared: store.Rebuild | None, started: float) -> SnapshotFiles:
        """(Worker thread.) Rebuild a compact snapshot's memory, then load and verify it."""
        if prepared is not None and store.expand_memory(self.snapshot_dir, prepared):
            log.info("sandbox %s: memory rebuilt from its compact snapshot in %.0f ms",
                     self.plan.vm_id, (time.monotonic() - started) * 1000)
        snap, _ = store.load(self.snapshot_dir)
        if snap.accel is not self.backend.accel:
            raise SnapshotError(f"snapshot is for {snap.accel.value}; host runs "
                                f"{self.backend.accel.value}")
        return snap

    async def cold_boot(self) -> float:
        """Boot the sandbox's own disk with a fresh kernel (its memory state is lost).

        The fallback when the memory snapshot is unusable: files survive, processes do not."""
        started = time.monotonic()
        if not self.spec.disk.exists():  # e.g. its host died before any of it was shipped
            raise RestoreError("the sandbox has no disk to boot", guest_started=False,
                               disk_missing=True)
        await self._stop_seal()
        await self._close_agent()
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        self.backend.layout.discard_memory(self.plan.root)
        driver = self.backend.new_driver()
        self.driver = driver
        try:
            await driver.boot(self.spec)
            self._announce_vmm()
            self.agent = AgentClient(self.plan.slot.guest_addr)
            await self.agent.wait_ready(self.backend.config.ready_timeout, driver.alive)
            await self._init_guest()
        except BaseException as exc:
            died = isinstance(exc, VMGoneError)
            await asyncio.shield(self._abort_start())
            if died:  # the log only: the VMM's own messages name host paths
                log.warning("sandbox %s: VMM died during its cold boot%s", self.plan.vm_id,
                            driver.exit_detail())
            if isinstance(exc, Exception):
                raise RestoreError(f"cold boot failed: {exc}", guest_started=True,
                                   vmm_died=died) from exc
            raise
        return (time.monotonic() - started) * 1000

    # -- live migration (vmctl.migrate carries the streams between hosts) ---------------

    def disk_bytes(self) -> int:
        """The guest disk's virtual size (a destination's disk must be made the same)."""
        return disks.qcow2_virtual_size(self.backend.layout.disk(self.plan.root))

    async def receive(self, disk_bytes: int) -> dict[str, Path]:
        """Be the destination of a live migration: a disk of ``disk_bytes`` over the same
        golden (the source mirrors its own layer onto it), this plan's network slot, and a
        VMM of the same shape waiting, guest held. Returns the Unix sockets the VMM listens
        on, by channel ("disk": NBD, "ram": the migration stream), for the daemon alone to
        connect to. A failure or cancellation leaves nothing (``destroy``)."""
        root, layout = self.plan.root, self.backend.layout
        if not isinstance(layout, disks.QemuLayout):
            raise MigrationError("live migration needs QEMU's disk layout")
        root.mkdir(mode=0o700, parents=True, exist_ok=False)  # never another sandbox's
        try:
            await disks.create_overlay(layout.disk(root), self.plan.golden.snapshot.disk,
                                       size_bytes=disk_bytes)
            await network.create(self.plan.slot, self.backend.config.network,
                                 policy=self.plan.egress, tap_owner=self.tap_owner)
            self.driver = self.backend.new_driver()
            return await self.driver.listen_incoming(self.spec)
        except BaseException:
            await asyncio.shield(self.destroy())
            raise

    async def finish_receive(self, timeout: float) -> None:
        """Once the whole stream is in: let the guest run here and re-initialise it (its
        clock stood still while it was stopped). On failure the caller ``destroy``s."""
        driver = self.driver
        if driver is None:
            raise VMGoneError(f"no incoming VMM for {self.plan.vm_id}")
        await driver.finish_incoming(self._announce_vmm, timeout)
        self.agent = AgentClient(self.plan.slot.guest_addr)
        await self.agent.init_when_ready(self._init_request, self.backend.config.restore_timeout,
                                         driver.alive)

    async def migrate_out(self, connect: Connect, commit: Callable[[], Awaitable[None]],
                          timeout: float, live: bool | None = None) -> LiveStats:
        """Move the running VM to another host: disk and RAM over ``connect``'s streams
        while the guest runs, then ``commit()`` starts it there, and this VMM is stopped.

        ``commit`` either returns with the destination's guest running, or raises after
        making sure it is not (then the VM runs here again, as before, and the error is
        raised), or raises ``OutcomeUnknown`` (the VM stays paused here: it must not run
        on two hosts). A failure or cancellation before the commit leaves it running.
        ``live``: see ``QemuDriver.send_live`` (None: where the VMM's dirty tracking is sound)."""
        driver = self.driver
        if driver is None or not driver.alive():
            raise VMGoneError(f"VMM of {self.plan.vm_id} is gone")
        if self.paused:
            raise MigrationError("a paused sandbox is not migrated live")
        started = time.monotonic()
        stats = await driver.send_live(connect, timeout, live)
        try:
            await commit()
        except OutcomeUnknown:
            raise
        except BaseException:
            await asyncio.shield(self._resume_after_send())
            raise
        now = time.time()
        paused = (now - stats.stopped_at) * 1000 if stats.stopped_at else None
        await self._abort_start()  # the guest runs there now: this VMM goes
        return dataclasses.replace(stats, total_ms=(time.monotonic() - started) * 1000,
                                   paused_ms=paused)

    async def _resume_after_send(self) -> None:
        assert self.driver is not None
        await self.driver.resume_after_send()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                await self._init_guest()  # its clock stood still while it was stopped

    async def adopt(self, record: VMMRecord) -> None:
        driver = self.backend.new_driver()
        await driver.adopt(record, self.spec)
        self.driver = driver
        self.agent = AgentClient(self.plan.slot.guest_addr)

    async def finish_restore(self) -> None:
        """Finish a restore a previous daemon started (the VMM is adopted): let the guest
        run if it does not yet, re-initialise it, and drop the snapshot it consumed."""
        assert self.driver is not None
        await self.driver.finish_restore(lambda: store.mark_consumed(self.snapshot_dir))
        await self.require_agent().init_when_ready(
            self._init_request, self.backend.config.restore_timeout, self.driver.alive)
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)

    async def destroy(self) -> None:
        """Remove the VMM, the namespace and every file. Idempotent."""
        try:
            await self._stop_seal()
            await self._close_agent()
            if self.driver is not None:
                await self.driver.destroy()
                self.driver = None
        finally:
            await network.destroy(self.plan.slot)
            await asyncio.to_thread(shutil.rmtree, self.plan.root, True)
            if self.backend.cgroups is not None:  # a VMM that died by itself left it
                await asyncio.to_thread(self.backend.cgroups.remove, self.plan.vm_id)

    async def kill_recorded(self, record: VMMRecord) -> None:
        """Kill a VMM left by a previous daemon that cannot be adopted."""
        if pid_alive(record.pid):
            await kill_pid(record.pid, timeout=2.0)
        if self.backend.cgroups is not None:
            await asyncio.to_thread(self.backend.cgroups.remove, self.plan.vm_id)

    # -- internals ------------------------------------------------------------------

    async def _start_from(self, snap: SnapshotFiles | SnapshotSource,
                          consumes: Path | None = None, identity: bool = False) -> None:
        """Start a VMM from ``snap`` (or from what it returns once the VMM is up: see
        ``Driver.restore_when_ready``). ``consumes``: the sandbox's own snapshot directory,
        marked consumed (durably) just before the guest first runs from it, so that
        after any crash nobody restores it again (the guest writes the memory file
        and the disk it describes). ``identity``: the sandbox's first start, so its
        guest gets its own hostname and machine-id."""
        if isinstance(snap, SnapshotFiles) and snap.accel is not self.backend.accel:
            raise RestoreError(f"snapshot is for {snap.accel.value}; host runs "
                               f"{self.backend.accel.value}", guest_started=False,
                               snapshot_unusable=True)
        driver = self.backend.new_driver()
        self.driver = driver
        def before_resume() -> None:
            self._announce_vmm()
            if consumes is not None:
                store.mark_consumed(consumes)

        try:
            if isinstance(snap, SnapshotFiles):
                await driver.restore(snap, self.spec, before_resume=before_resume)
            else:  # the VMM starts while the snapshot is still being made ready
                await driver.restore_when_ready(self.spec, snap, before_resume=before_resume)
        except Exception as exc:
            self.driver = None
            bad = isinstance(exc, SnapshotError) or isinstance(exc.__cause__, SnapshotError)
            raise RestoreError(str(exc), guest_started=bool(consumes and store.is_consumed(
                consumes)), snapshot_unusable=bad) from exc
        self.agent = AgentClient(self.plan.slot.guest_addr)
        try:
            timeout = self.backend.config.restore_timeout
            request = self._first_init_request if identity else self._init_request
            await self.agent.init_when_ready(request, timeout, driver.alive)
        except BaseException as exc:
            died = isinstance(exc, VMGoneError)
            await asyncio.shield(self._abort_start())
            if died:
                log.warning("sandbox %s: VMM died during its restore%s", self.plan.vm_id,
                            driver.exit_detail())
            if isinstance(exc, Exception):
                raise RestoreError(f"guest did not come back: {exc}",
                                   guest_started=True, vmm_died=died) from exc
            raise

    def _announce_vmm(self) -> None:
        record = self.vmm_record()
        if self.on_vmm_started is not None and record is not None:
            self.on_vmm_started(record)

    async def _sync_guest(self) -> None:
        """Flush the guest's filesystems, so a cold boot of the disk keeps every file
        (best effort: the snapshot itself keeps the page cache)."""
        if self.agent is None:
            return
        try:
            await self.agent.sync(timeout=SYNC_TIMEOUT_S)
        except Exception as exc:
            log.warning("sandbox %s: guest sync before suspend failed: %s", self.plan.vm_id, exc)

    async def _init_guest(self) -> None:
        assert self.agent is not None
        await self.agent.init(self._init_request())

    @staticmethod
    def _init_request() -> InitRequest:
        # Built per attempt: the clock value must be fresh when the guest applies it.
        return InitRequest(time_ns=time.time_ns(), entropy_hex=os.urandom(64).hex())

    def _first_init_request(self) -> InitRequest:
        """Also the sandbox's own identity: every clone of one snapshot (a built-in golden,
        a user template, a fork) would otherwise share its hostname and machine-id."""
        return dataclasses.replace(self._init_request(), hostname=hostname_for(self.plan.vm_id),
                                   machine_id=uuid.uuid4().hex)

    async def _abort_start(self) -> None:
        await self._close_agent()
        if self.driver is not None:
            await self.driver.destroy()
            self.driver = None

    async def _close_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is not None:
            await agent.aclose()

    def require_agent(self) -> AgentClient:
        if self.agent is None:
            raise VMGoneError(f"sandbox VM {self.plan.vm_id} is not running")
        return self.agent
