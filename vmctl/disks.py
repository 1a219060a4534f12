"""Disk layers and memory files for sandboxes, and where each backend keeps them.

Templates are read-only; every sandbox writes to a layer of its own. How that
layer is made, and how guest memory relates to the snapshot files, is what
differs between the VMMs, so it lives here behind one small strategy, the
``Layout`` the Backend hands out (``backend.layout``):

QEMU (``QemuLayout``):
  golden disk   a qcow2 overlay over the template's raw rootfs
  sandbox disk  ``disk.qcow2``, a qcow2 overlay over the golden disk
  sandbox RAM   ``memory``, a copy of the golden memory file that QEMU maps
                ``share=on``: it *is* the memory snapshot, a suspend writes no RAM
  suspend       ``snapshot/vmstate``; memory and disk are the sandbox's own files,
                recorded by absolute path

Firecracker (``FirecrackerLayout``; it has no qcow2 and no shared memory file):
  golden disk   a raw sparse/reflinked copy of the template's rootfs
  sandbox disk  ``disk``, a raw sparse/reflinked copy of the golden disk
  sandbox RAM   nothing at create: the restore maps the golden memory file
                MAP_PRIVATE (copy-on-write), so no copy is needed
  suspend       ``snapshot/{vmstate,memory}`` written fresh by Firecracker (a Full
                snapshot), plus ``snapshot/disk``, a hard link of ``disk``

Copies use ``cp --sparse=always --reflink=auto``: on XFS/btrfs that is a reflink
(no data copied); elsewhere only the blocks that hold data are written.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import ClassVar

from vmctl.errors import VmctlError
from vmctl.spec import SnapshotFiles

MEMORY_FILE = "memory"


class DiskError(VmctlError):
    code = "disk_error"
    status = 500


async def _run(*argv: str) -> str:
    """Run ``argv``; its stdout, or DiskError with its stderr. Killed if cancelled."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        what = " ".join(argv[:2]) if argv[0] == "qemu-img" else argv[0]
        raise DiskError(f"{what} failed: {err.decode(errors='replace').strip()}")
    return out.decode()


async def backing_file(overlay: Path) -> str:
    """The backing file a qcow2 overlay's header names ("" if none)."""
    info = json.loads(await _run("qemu-img", "info", "--output=json", "-U", str(overlay)))
    return str(info.get("backing-filename") or "")


async def rebase_overlay(overlay: Path, backing: Path) -> None:
    """Point a qcow2 overlay at ``backing`` (a qcow2 holding the same bytes: the header
    only, ``qemu-img rebase -u``)."""
    await _run("qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", str(backing),
               str(overlay))


async def create_overlay(path: Path, backing: Path, backing_format: str = "qcow2",
                         size_bytes: int = 0) -> None:
    """A qcow2 layer over ``backing``, of the backing's virtual size or ``size_bytes``."""
    await _run("qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_format,
               "-b", str(backing.resolve()), str(path), *([str(size_bytes)] if size_bytes else []))


def qcow2_virtual_size(path: Path) -> int:
    """The virtual size in a qcow2 header (``block_resize`` keeps it current)."""
    with open(path, "rb") as f:
        header = f.read(32)
    if len(header) < 32 or header[:4] != b"QFI\xfb":
        raise DiskError(f"{path.name} is not a qcow2 image")
    return int.from_bytes(header[24:32], "big")


async def copy_sparse(src: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    await _run("cp", "--sparse=always", "--reflink=auto", str(src), str(tmp))
    tmp.replace(dest)


async def copy_writable(src: Path, dest: Path) -> None:
    """A sparse/reflinked copy the VM may write (template rootfs files are mode 0444)."""
    await copy_sparse(src, dest)
    os.chmod(dest, 0o644)


class Layout(abc.ABC):
    """One backend's files for a VM: its disk, its memory, and what a suspend keeps.

    Every method takes the sandbox (or golden build) directory; none starts a VMM."""

    disk_name: ClassVar[str]
    # Manifest of a sandbox's own (suspend) snapshot. The device state is always
    # hashed (small). Memory and disk are not: hashing hundreds of MiB per suspend
    # and wake costs more than the wake itself. Roles listed in
    # ``suspend_stat_checked`` are verified by size and mtime instead.
    suspend_hashed: ClassVar[tuple[str, ...]] = ("state",)
    suspend_stat_checked: ClassVar[tuple[str, ...]] = ()
    # A suspended sandbox's memory file can be stored as its diff from the golden's
    # (``store.compact_memory``): QEMU's RAM file starts as a copy of the golden's.
    compacts_memory: ClassVar[bool] = False

    def disk(self, root: Path) -> Path:
        return root / self.disk_name

    def memory(self, root: Path) -> Path:
        """``VMSpec.mem_file``: the file QEMU backs guest RAM with (unused by Firecracker)."""
        return root / MEMORY_FILE

    @abc.abstractmethod
    async def golden_disk(self, rootfs: Path, directory: Path) -> Path:
        """Make the writable disk a golden build boots (over the read-only ``rootfs``)."""

    @abc.abstractmethod
    async def materialise(self, golden: SnapshotFiles, root: Path) -> SnapshotFiles:
        """Give a new sandbox in ``root`` its own disk (and memory where needed); return
        the snapshot to hand to ``driver.restore`` for its first start."""

    def prepare_snapshot(self, root: Path, dest: Path) -> None:  # noqa: B027 - optional hook
        """Called before ``driver.snapshot(dest)`` on a suspend."""

    def discard_memory(self, root: Path) -> None:  # noqa: B027 - optional hook
        """Forget the sandbox's memory state (a cold boot replaces it)."""


class QemuLayout(Layout):
    """qcow2 overlays, and a per-sandbox RAM file QEMU maps shared (see drivers/qemu.py).

    The RAM file is the memory snapshot: a suspend records its size and mtime (and a
    background seal adds its SHA-256), so a wake refuses a file anything wrote to or
    truncated since the suspend, even before the seal has finished."""

    disk_name = "disk.qcow2"
    suspend_stat_checked = ("memory", "disk")
    compacts_memory = True

    async def golden_disk(self, rootfs: Path, directory: Path) -> Path:
        path = self.disk(directory)
        await create_overlay(path, rootfs, backing_format="raw")
        return path

    async def materialise(self, golden: SnapshotFiles, root: Path) -> SnapshotFiles:
        await asyncio.gather(create_overlay(self.disk(root), golden.disk),
                             copy_sparse(golden.memory, self.memory(root)))
        return golden  # QEMU restores onto spec.disk and spec.mem_file

    def discard_memory(self, root: Path) -> None:
        self.memory(root).unlink(missing_ok=True)


class FirecrackerLayout(Layout):
    """Raw disk copies; memory lives only in snapshot files (see drivers/firecracker.py).

    The names match the driver's snapshot files, so the driver never copies a disk
    itself on these paths: the golden VM's disk *is* the golden snapshot's disk, a
    sandbox is restored onto the copy made here, and a suspend's ``snapshot/disk``
    is a hard link of the (paused, then stopped) VM's disk. A wake resumes on that
    same inode and then drops the snapshot directory, as the QEMU path does."""

    disk_name = "disk"  # == vmctl.drivers.firecracker.DISK_FILE
    suspend_stat_checked = ("memory", "disk")

    async def golden_disk(self, rootfs: Path, directory: Path) -> Path:
        path = self.disk(directory)
        await copy_writable(rootfs, path)
        return path

    async def materialise(self, golden: SnapshotFiles, root: Path) -> SnapshotFiles:
        disk = self.disk(root)
        await copy_writable(golden.disk, disk)
        # State and memory stay the golden's: the load maps the memory MAP_PRIVATE.
        return dataclasses.replace(golden, disk=disk)

    def prepare_snapshot(self, root: Path, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        link = self.disk(dest)
        link.unlink(missing_ok=True)
        os.link(self.disk(root), link)
