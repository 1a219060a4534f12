"""Golden snapshots: a template booted once, warmed, and saved, so that every
new sandbox is a restore (tens of ms) instead of a boot (seconds).

Layout under the template's image directory::

    golden-<driver>-<accel>[-<vcpus>c]-<mem>M-r<recipe>/   (one per shape; "-<n>c"
                                                     only when vcpus != 1, so 1-vCPU names
                                                     are those of before shapes)
        disk.qcow2      QEMU: overlay over the template's read-only rootfs (read-only from now on)
        disk            Firecracker: raw sparse/reflinked copy of the rootfs (read-only from now on)
        memory          guest RAM (QEMU: copied, sparse/reflinked, into each new sandbox;
                        Firecracker: mapped MAP_PRIVATE by every sandbox restored from it)
        vmstate         device state
        manifest.json   written last: a directory without it is discarded

What the golden VM boots, and how its disk is made, is the backend's choice
(``Backend.boot_files``, ``Backend.layout``): QEMU boots the template's Debian
kernel and initramfs, Firecracker the vmlinux built from images/firecracker with
no initrd. The manifest records the kernel, initrd and command line, so cold
boots of its sandboxes use the same ones.

It is built in a temporary directory and renamed into place, so a crash never
leaves a half-built golden snapshot that looks complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from guest.protocol import DEFAULT_CONTEXT, CreateContextRequest, ExecRequest
from vmctl import agent_interp, memdiff, network, store
from vmctl.agent_client import AgentClient
from vmctl.backend import Backend
from vmctl.errors import ImageError
from vmctl.spec import SnapshotFiles, VMSpec

log = logging.getLogger(__name__)

# Slots at the top of the pool are reserved for golden builds (one per concurrent build).
BUILD_SLOTS = 8


@dataclass(frozen=True)
class Golden:
    template: str
    dir: Path
    snapshot: SnapshotFiles
    kernel: Path
    initrd: Path | None
    cmdline: str
    mem_mib: int
    vcpus: int = 1
    disk_mib: int = 0  # the virtual size of the golden disk (0: unknown, an old build)


# Bumped whenever what goes into a golden snapshot changes (e.g. how it is warmed). A new
# name, not an overwrite: existing sandboxes' disks use the old one as their backing file.
GOLDEN_RECIPE = 3  # 3: built by a confined VMM (root-owned, read-only files)


def golden_dir(image_dir: Path, backend: Backend, mem_mib: int, vcpus: int = 1) -> Path:
    """Where the golden snapshot of one shape lives: a restore needs the vCPU count and
    RAM size it was saved with, so each (vcpus, mem) pair has its own. The disk size is
    not part of the name: a sandbox's disk is grown after its restore (Machine)."""
    cpus = "" if vcpus == 1 else f"-{vcpus}c"
    return image_dir / f"golden-{backend.key}{cpus}-{mem_mib}M-r{GOLDEN_RECIPE}"


async def ensure_golden(image, backend: Backend,  # type: ignore[no-untyped-def]
                        progress: Callable[[str], None] = print, build_slot: int = 0,
                        mem_mib: int | None = None, vcpus: int | None = None) -> Golden:
    """Return the template's golden snapshot of a shape (default: the template's RAM and
    the config's vCPUs), building it first if needed."""
    mem_mib = mem_mib or image.mem_mib
    vcpus = vcpus or backend.config.vcpus
    final = golden_dir(image.dir, backend, mem_mib, vcpus)
    if not (final / store.MANIFEST).is_file():
        await _build(image, backend, final, progress, build_slot, mem_mib, vcpus)
    snap, _ = await asyncio.to_thread(store.load, final)
    boot = backend.boot_files(image)
    return Golden(image.name, final, snap, boot.kernel, boot.initrd, boot.cmdline,
                  mem_mib, vcpus, _size_mib(image.rootfs))


def _size_mib(path: Path) -> int:
    try:
        return os.stat(path).st_size >> 20
    except OSError:
        return 0


async def _warm(agent: AgentClient, image) -> None:  # type: ignore[no-untyped-def]
    """Run the template's warm-up and start the default interpreter context, so every
    sandbox restored from this snapshot has a live interpreter (its first run_code does not
    pay for starting Python under emulation) whose execution count still starts at 1."""
    if image.warmup:
        res = await agent.execute(ExecRequest(code=image.warmup, timeout=300))
        if res.exit_code != 0:
            raise ImageError(f"warm-up of {image.name} failed: {res.stderr[-500:]}")
    await agent_interp.create_context(agent, CreateContextRequest(name=DEFAULT_CONTEXT))


def load_golden_dir(directory: Path) -> Golden:
    """Load a golden snapshot from its directory alone (for sandboxes made from an older
    build of a template than the one currently served)."""
    snap, manifest = store.load(directory, verify=False)
    meta = manifest.meta
    image_dir = directory.parent
    # A recorded None means "boots without one" (Firecracker); absent means an old manifest.
    initrd = meta["initrd"] if "initrd" in meta else image_dir / "initrd.img"
    return Golden(template=meta.get("template", image_dir.parent.name), dir=directory,
                  snapshot=snap, kernel=Path(meta.get("kernel") or image_dir / "vmlinuz"),
                  initrd=Path(initrd) if initrd and Path(initrd).exists() else None,
                  cmdline=meta.get("cmdline") or _image_cmdline(image_dir),
                  mem_mib=int(meta.get("mem_mib") or _mem_from_name(directory.name)),
                  vcpus=int(meta.get("vcpus") or _vcpus_from_name(directory.name)),
                  disk_mib=int(meta.get("disk_mib") or 0))


def _image_cmdline(image_dir: Path) -> str:
    try:
        return str(json.loads((image_dir / "manifest.json").read_text())["cmdline"])
    except (OSError, ValueError, KeyError):
        return "console=ttyS0 reboot=k panic=1 root=/dev/vda rw quiet"


def _mem_from_name(name: str) -> int:
    match = re.search(r"-(\d+)M(?:-r\d+)?$", name)
    if match is None:
        raise ImageError(f"cannot tell the guest memory size from {name!r}")
    return int(match.group(1))


def _vcpus_from_name(name: str) -> int:
    match = re.search(r"-(\d+)c-\d+M(?:-r\d+)?$", name)
    return int(match.group(1)) if match else 1


async def _build(image, backend: Backend, final: Path,  # type: ignore[no-untyped-def]
                 progress: Callable[[str], None], build_slot: int, mem_mib: int,
                 vcpus: int) -> None:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    tmp.mkdir(parents=True)
    vm_id = f"golden-{uuid.uuid4().hex[:8]}"
    cfg = backend.config.network
    slot = network.slot_for(cfg.capacity - 1 - build_slot % BUILD_SLOTS, vm_id, cfg)
    driver = backend.new_driver()
    boot, layout = backend.boot_files(image), backend.layout
    started = time.monotonic()
    try:
        disk = await layout.golden_disk(image.rootfs, tmp)
        confinement = backend.confinement(slot.host_addr, vm_id, tmp / "vm", mem_mib, vcpus)
        await network.create(slot, cfg, tap_owner=(confinement.uid, confinement.gid)
                             if confinement else None)
        spec = VMSpec(vm_id=vm_id, workdir=tmp / "vm", kernel=boot.kernel, initrd=boot.initrd,
                      cmdline=boot.cmdline, disk=disk, mem_file=layout.memory(tmp),
                      mem_mib=mem_mib, vcpus=vcpus, netns=slot.netns,
                      accel=backend.accel, confinement=confinement)
        progress(f"golden[{image.name}]: booting ({backend.key}, {vcpus} vCPU, {mem_mib} MiB)")
        await driver.boot(spec)
        agent = AgentClient(slot.guest_addr)
        try:
            await agent.wait_ready(backend.config.ready_timeout)
            progress(f"golden[{image.name}]: agent ready after {time.monotonic() - started:.1f}s")
            await _warm(agent, image)
            # Flush the guest's dirty page cache so the disk layer is self-consistent.
            await agent.execute(ExecRequest(command="sync", timeout=60))
        finally:
            await agent.aclose()
        snap = await driver.snapshot(tmp)
        await driver.destroy()
        await asyncio.to_thread(memdiff.punch_zero_pages, snap.memory)
        if backend.confined:
            _give_back_to_root(snap)
        meta = {"template": image.name, "kernel": str(boot.kernel), "cmdline": boot.cmdline,
                "initrd": str(boot.initrd) if boot.initrd else None, "mem_mib": mem_mib,
                "vcpus": vcpus, "disk_mib": _size_mib(image.rootfs)}
        await asyncio.to_thread(store.write_manifest, tmp, snap, meta)
        shutil.rmtree(tmp / "vm", ignore_errors=True)
        os.replace(tmp, final)
        progress(f"golden[{image.name}]: snapshot saved in {time.monotonic() - started:.1f}s")
    except BaseException:
        await asyncio.shield(driver.destroy())
        console = tmp / "vm" / "console.log"
        if console.exists():
            tail = console.read_bytes()[-3000:].decode(errors="replace")
            log.error("golden[%s] build failed; guest console:\n%s", image.name, tail)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        await asyncio.shield(network.destroy(slot))


def _give_back_to_root(snap: SnapshotFiles) -> None:
    """The build VM's files belonged to its uid; a golden snapshot is read by every
    sandbox of its template, so it must belong to no sandbox's uid."""
    for path in (snap.disk, snap.memory, snap.state):
        if path.exists():
            os.chown(path, 0, 0)
            os.chmod(path, 0o444 if path == snap.disk else 0o400)
