"""Kernel module metadata without kmod: read ``.modinfo`` from the ELF file.

The kernel package ships no ``modules.dep`` (depmod runs in its postinst),
and the build host need not have kmod installed. A module's ``.modinfo``
section holds NUL-separated ``key=value`` strings, among them ``depends=``,
which is all we need to insmod a handful of modules in dependency order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path


class ModuleError(RuntimeError):
    """A module is missing or its metadata is unreadable."""


@dataclass(frozen=True)
class ModuleTree:
    """One kernel's ``/lib/modules/<version>`` directory."""

    root: Path

    def builtin(self) -> set[str]:
        """Names of modules compiled into the kernel image (``=y``)."""
        path = self.root / "modules.builtin"
        lines = path.read_text().split() if path.exists() else []
        return {canonical(Path(line).name.removesuffix(".ko")) for line in lines}

    def index(self) -> dict[str, Path]:
        """Module name -> ``.ko`` file, for every loadable module."""
        out: dict[str, Path] = {}
        for ko in (self.root / "kernel").rglob("*.ko"):
            out[canonical(ko.name.removesuffix(".ko"))] = ko
        return out


def canonical(name: str) -> str:
    """Module names treat '-' and '_' alike (``virtio-rng`` is ``virtio_rng``)."""
    return name.replace("-", "_")


def modinfo(ko: Path) -> dict[str, str]:
    """Key/value pairs of a module's ``.modinfo`` section (first value per key)."""
    data = ko.read_bytes()
    section = _elf_section(data, b".modinfo")
    info: dict[str, str] = {}
    for item in section.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            info.setdefault(key.decode(), value.decode(errors="replace"))
    return info


def _elf_section(data: bytes, wanted: bytes) -> bytes:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ModuleError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, = struct.unpack_from("<I", data, shoff + i * shentsize)
        offset, size = struct.unpack_from("<QQ", data, shoff + i * shentsize + 24)
        return name, offset, size

    _, str_off, str_size = header(shstrndx)
    names = data[str_off:str_off + str_size]
    for i in range(shnum):
        name_off, offset, size = header(i)
        end = names.index(b"\0", name_off)
        if names[name_off:end] == wanted:
            return data[offset:offset + size]
    raise ModuleError(f"no {wanted.decode()} section")


def load_order(tree: ModuleTree, wanted: list[str]) -> list[Path]:
    """The ``.ko`` files to insmod, dependencies first, for ``wanted`` modules.

    Built-in modules are skipped (they need no loading); a wanted module that
    is neither built in nor present is an error, because the guest would not
    boot without it.
    """
    builtin = tree.builtin()
    index = tree.index()
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        name = canonical(name)
        if name in seen or name in builtin:
            return
        if name in chain:
            raise ModuleError(f"dependency cycle: {' -> '.join(chain + (name,))}")
        ko = index.get(name)
        if ko is None:
            raise ModuleError(f"module {name!r} is neither built in nor in {tree.root}")
        for dep in filter(None, modinfo(ko).get("depends", "").split(",")):
            visit(dep, chain + (name,))
        seen.add(name)
        order.append(ko)

    for name in wanted:
        visit(name, ())
    return order
