"""What a sandbox takes on the host's disk: its own files, and its snapshot.

Quotas (``max_disk_mib``), ``GET /v1/sandboxes/{id}/metrics`` and the expiry loop's
snapshot measurements all count bytes the same way, here, below the HTTP layer that
shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

from gateway.sandbox.states import State
from gateway.store.registry import Registry
from vmctl.disks import MEMORY_FILE

SNAPSHOT_REMEASURE_S = 30.0


def tree_bytes(root: Path) -> int:
    """Bytes allocated to the files under ``root`` that are its own (sparse files count
    what they use; each inode once). A sandbox's ``vm/`` chroot hard-links its disk's
    backing chain (the template's files, ``vmctl.confine.mirror_into_chroot``): a file
    there that has other links is not counted (the sandbox's own disk is, at its root)."""
    total, seen = 0, set()
    chroot = os.path.join(root, "vm")
    for dirpath, _, files in os.walk(root):
        in_chroot = dirpath == chroot or dirpath.startswith(chroot + os.sep)
        for name in files:
            try:  # a file removed while we walk
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if st.st_ino in seen or (in_chroot and st.st_nlink > 1):
                continue
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def snapshot_bytes(root: Path) -> int:
    """What a suspended sandbox's snapshot takes on disk: its snapshot directory (device
    state, and Firecracker's memory) and QEMU's guest memory file, which *is* the memory
    image while suspended (vmctl/machine.py, the directory layout)."""
    size = tree_bytes(root / "snapshot")
    with contextlib.suppress(OSError):
        size += os.lstat(root / MEMORY_FILE).st_blocks * 512
    return size


async def measure_snapshots(registry: Registry, seen: dict[str, tuple[int, float]],
                            every: float = SNAPSHOT_REMEASURE_S) -> None:
    """Record each suspended sandbox's snapshot size after each suspend, and again every
    ``every`` seconds while it sleeps (compaction, vm.compact_after, shrinks it later);
    ``seen``: id -> (suspend_count, when measured)."""
    now = time.monotonic()
    for rec in registry.list():
        last = seen.get(rec.id)
        if rec.state is not State.SUSPENDED or (
                last is not None and last[0] == rec.suspend_count and now - last[1] < every):
            continue
        size = await asyncio.to_thread(snapshot_bytes, Path(rec.root))
        seen[rec.id] = (rec.suspend_count, now)
        if size != rec.snapshot_bytes:
            registry.update(rec.id, snapshot_bytes=size)
