"""The guest kernel: Debian's cloud kernel, unpacked from its package.

Debian's ``linux-image-*-cloud-amd64`` boots under QEMU ``-M microvm`` (its
virtio-mmio devices are found through ACPI) but builds its virtio drivers as
modules, so the initramfs must insmod them; :data:`BOOT_MODULES` names what a
guest needs, and :func:`images.kmod.load_order` turns that into files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from images import debs
from images.kmod import ModuleTree
from images.proc import BuildContext, BuildError

# Block device and root file system first (the guest cannot boot without
# them), then the NIC (agent traffic) and the entropy source (fresh randomness
# after every snapshot restore). Built-in ones are skipped by load_order, so
# listing ext4's helpers keeps us right if a future kernel makes them modules.
BOOT_MODULES = (
    "virtio_ring", "virtio", "virtio_mmio", "virtio_blk",
    "crc16", "crc32c_generic", "mbcache", "jbd2", "ext4",
    "virtio_net", "virtio_rng",
)


@dataclass(frozen=True)
class Kernel:
    package: debs.DebPackage
    release: str        # `uname -r`, e.g. 6.1.0-57-cloud-amd64
    vmlinuz: Path       # bzImage
    modules: ModuleTree


def fetch_kernel(ctx: BuildContext, cache: Path, pkg: debs.DebPackage) -> Kernel:
    """Unpack the kernel package (cached per version) and locate its parts."""
    root = debs.unpacked(ctx, pkg, cache)
    images = sorted((root / "boot").glob("vmlinuz-*"))
    if len(images) != 1:
        raise BuildError(f"{pkg.key}: expected one /boot/vmlinuz-*, found {len(images)}")
    release = images[0].name.removeprefix("vmlinuz-")
    modules = root / "lib" / "modules" / release
    if not modules.is_dir():
        raise BuildError(f"{pkg.key}: no /lib/modules/{release}")
    return Kernel(pkg, release, images[0], ModuleTree(modules))
