"""The initramfs: busybox, the boot modules and ``init.sh``, as gzip'd cpio.

The archive is written here rather than with cpio(1) so it needs no root
(``/dev/console`` is a device node) and is byte-for-byte reproducible (fixed
owners, mtimes and order), which keeps content hashes honest.
"""

from __future__ import annotations

import gzip
import io
import stat
from dataclasses import dataclass
from pathlib import Path

from images.kernel import BOOT_MODULES, Kernel
from images.kmod import load_order

INIT_SCRIPT = Path(__file__).with_name("init.sh")


@dataclass(frozen=True)
class Entry:
    """One archive member; ``data`` is file content or a symlink's target."""

    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def newc(entries: list[Entry]) -> bytes:
    """Serialise entries as a ``newc`` cpio archive (what the kernel unpacks)."""
    out = io.BytesIO()
    for ino, entry in enumerate([*entries, Entry("TRAILER!!!", 0)], start=1):
        name = entry.name.encode() + b"\0"
        fields = (ino, entry.mode, 0, 0, 1, 0, len(entry.data), 0, 0,
                  entry.rdev[0], entry.rdev[1], len(name), 0)
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + name)
        out.write(b"\0" * (-out.tell() % 4))
        out.write(entry.data)
        out.write(b"\0" * (-out.tell() % 4))
    return out.getvalue()


def entries(kernel: Kernel, busybox: Path) -> tuple[list[Entry], list[str]]:
    """Archive members for ``kernel``; also returns the module names, in load order."""
    dirs = ["dev", "proc", "sys", "newroot", "bin", "sbin", "usr", "usr/bin", "usr/sbin",
            "lib", "lib/modules", "tmp"]
    members = [Entry(d, stat.S_IFDIR | 0o755) for d in dirs]
    members.append(Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    members.append(Entry("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes()))
    members.append(Entry("bin/sh", stat.S_IFLNK | 0o777, b"busybox"))
    members.append(Entry("init", stat.S_IFREG | 0o755, INIT_SCRIPT.read_bytes()))
    kos = load_order(kernel.modules, list(BOOT_MODULES))
    for ko in kos:
        members.append(Entry(f"lib/modules/{ko.name}", stat.S_IFREG | 0o644, ko.read_bytes()))
    order = "".join(ko.name + "\n" for ko in kos).encode()
    members.append(Entry("lib/modules/load-order", stat.S_IFREG | 0o644, order))
    return members, [ko.name.removesuffix(".ko") for ko in kos]


def build_initramfs(kernel: Kernel, busybox: Path, dest: Path) -> list[str]:
    """Write the gzip'd initramfs to ``dest``; return the modules it loads."""
    members, modules = entries(kernel, busybox)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(newc(members))
    tmp.rename(dest)
    return modules
