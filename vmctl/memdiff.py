"""Compact memory snapshots: a sandbox's guest RAM stored as the pages that differ
from its golden snapshot's.

A QEMU sandbox's RAM file starts as a copy of the golden memory file and the
guest dirties a small part of it, so a suspended sandbox that ran a few commands
needs only those pages on disk. ``compact`` writes them to a diff file; ``expand``
rebuilds the RAM file from the golden file (a reflink where the filesystem has
them, else a sparse copy: that copy is what a wake from a compact snapshot pays)
plus the diff.

Diff file format (little-endian)::

    magic "ABMEMDF1", u32 page size, u64 RAM size, u64 page count N,
    N pages of data, then their N x u32 page numbers (ascending).

Only whole pages are compared; a page the guest zeroed where the golden has
data is stored like any other differing page.
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"ABMEMDF1"
PAGE = 4096
_HEADER = struct.Struct("<8sIQQ")
_BLOCK = 1 << 20  # compared whole first; pages only inside blocks that differ
_ZERO_BLOCK = bytes(_BLOCK)


class DiffError(Exception):
    """A diff file is unreadable or does not fit the RAM size it is applied to."""


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class DiffStats:
    ram_bytes: int
    pages: int  # pages stored
    diff_bytes: int  # size of the diff file


def _data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the file's data extents (SEEK_DATA/SEEK_HOLE)."""
    ranges, off = [], 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after off
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        ranges.append((start, end))
        off = end
    return ranges


def _read(fd: int, off: int, n: int) -> bytes:
    data = os.pread(fd, n, off)
    return data + bytes(n - len(data)) if len(data) < n else data


def compact(memory: Path, golden: Path, out: Path,
            cancel: threading.Event | None = None) -> DiffStats:
    """Write ``out`` (atomically, fsynced): the pages of ``memory`` that differ from
    ``golden``. Reads only the data extents of ``memory`` plus, where ``memory`` has a
    hole, the golden's data there (which the hole zeroed)."""
    size = memory.stat().st_size
    if golden.stat().st_size != size:
        raise DiffError(f"RAM file is {size} bytes, its golden {golden.stat().st_size}")
    pages: list[int] = []
    tmp = out.with_name(out.name + ".tmp")
    mfd = os.open(memory, os.O_RDONLY | os.O_CLOEXEC)
    gfd = os.open(golden, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Blocks to compare: wherever either file has data (both holes: both zero).
        starts: set[int] = set()
        for fd in (mfd, gfd):
            for start, end in _data_ranges(fd, size):
                starts.update(range(start - start % _BLOCK, end, _BLOCK))
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, PAGE, size, 0))
            for block in sorted(starts):
                if cancel is not None and cancel.is_set():
                    raise Cancelled(str(memory))
                n = min(_BLOCK, size - block)
                mine, theirs = _read(mfd, block, n), _read(gfd, block, n)
                if mine == theirs:
                    continue
                for p in range(0, n, PAGE):
                    page = mine[p:p + PAGE]
                    if page != theirs[p:p + PAGE]:
                        pages.append((block + p) // PAGE)
                        f.write(page)
            f.write(struct.pack(f"<{len(pages)}I", *pages))
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, PAGE, size, len(pages)))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(mfd)
        os.close(gfd)
    os.replace(tmp, out)
    return DiffStats(size, len(pages), out.stat().st_size)


def read_header(diff: Path) -> tuple[int, int]:
    """(RAM size, page count) of a diff file; DiffError if it is not one."""
    with open(diff, "rb") as f:
        raw = f.read(_HEADER.size)
        if len(raw) != _HEADER.size:
            raise DiffError(f"{diff.name} is truncated")
        magic, page, size, count = _HEADER.unpack(raw)
        if magic != MAGIC or page != PAGE:
            raise DiffError(f"{diff.name} is not a memory diff")
        if os.fstat(f.fileno()).st_size != _HEADER.size + count * (4 + PAGE):
            raise DiffError(f"{diff.name} has the wrong length for {count} pages")
        return size, count


def expand(diff: Path, golden: Path, out: Path) -> None:
    """Rebuild the RAM file ``out`` (atomically; mode 0600) from ``golden`` and ``diff``."""
    size, count = read_header(diff)
    if golden.stat().st_size != size:
        raise DiffError(f"diff is for {size} bytes of RAM, the golden has {golden.stat().st_size}")
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        # cp: a reflink where the filesystem can (no data copied), else only the data blocks.
        proc = subprocess.run(["cp", "--reflink=auto", "--sparse=always", str(golden), str(tmp)],
                              capture_output=True, check=False)
        if proc.returncode != 0:
            raise DiffError(f"copying the golden memory failed: {proc.stderr.decode().strip()}")
        os.chmod(tmp, 0o600)
        with open(diff, "rb") as d:
            d.seek(_HEADER.size + count * PAGE)
            index = struct.unpack(f"<{count}I", d.read(4 * count))
            d.seek(_HEADER.size)
            fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            try:
                # Runs of consecutive pages go out in one write.
                i = 0
                while i < count:
                    j = i + 1
                    while j < count and index[j] == index[j - 1] + 1 and j - i < 256:
                        j += 1
                    data = d.read((j - i) * PAGE)
                    if len(data) != (j - i) * PAGE:
                        raise DiffError(f"{diff.name} is truncated")
                    os.pwrite(fd, data, index[i] * PAGE)
                    i = j
            finally:
                os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
