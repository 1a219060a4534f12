"""Compact memory snapshots: a sandbox's guest RAM stored as the pages that differ
from its golden snapshot's.

A QEMU sandbox's RAM file starts as a copy of the golden memory file and the
guest dirties a small part of it, so a suspended sandbox that ran a few commands
needs only those pages on disk. ``compact`` writes them to a diff file; a wake
rebuilds the RAM file from the golden file (a reflink where the filesystem has
them, else a copy of its data extents: that copy is what a wake from a compact
snapshot pays) plus the diff. The rebuild is in place, in two steps, so that a
VMM can start meanwhile: ``prepare`` empties and sizes the file at its final path
(before the VMM maps it), ``rebuild`` writes it; ``expand`` does both.

Diff file format (little-endian)::

    magic "ABMEMDF1", u32 page size, u64 RAM size, u64 page count N,
    N pages of data, then their N x u32 page numbers (ascending).

Only whole pages are compared; a page the guest zeroed where the golden has
data is stored like any other differing page.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"ABMEMDF1"
PAGE = 4096
_HEADER = struct.Struct("<8sIQQ")
_BLOCK = 1 << 20  # compared whole first; pages only inside blocks that differ
_ZERO_BLOCK = bytes(_BLOCK)
_FICLONE = 0x40049409  # ioctl: share all of a file's extents (a reflink)


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


def prepare(golden: Path, out: Path) -> bool:
    """Make ``out`` the RAM file a rebuild writes into, at its final path: emptied first
    (a crash mid-rebuild leaves junk, so every rebuild starts from scratch), then a reflink
    of ``golden`` where the filesystem has them, else ``golden``'s size of holes; mode 0600.
    Returns True if it is a reflink (``rebuild`` then copies nothing from the golden).

    Done before a VMM maps the file (QEMU maps its RAM file when it starts), so that the
    rebuild can proceed in place while the VMM starts."""
    size = golden.stat().st_size
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        gfd = os.open(golden, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _FICLONE, gfd)
            cloned = True
        except OSError:  # no reflinks here (ext4), or another filesystem
            cloned = False
        finally:
            os.close(gfd)
        if not cloned:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return cloned


def rebuild(diff: Path, golden: Path, out: Path, cloned: bool = False) -> None:
    """Rebuild the RAM file ``out`` in place (``prepare`` made it) from ``golden`` and
    ``diff``: the golden's data extents (unless ``cloned``), then the diff's pages. The
    writes go through the page cache, so a VMM that has the file mapped shared sees them;
    the caller fsyncs. Not atomic: ``out`` is usable only once this returns."""
    size, count = read_header(diff)
    if golden.stat().st_size != size:
        raise DiffError(f"diff is for {size} bytes of RAM, the golden has {golden.stat().st_size}")
    fd = os.open(out, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != size:
            raise DiffError(f"{out.name} is {os.fstat(fd).st_size} bytes, not {size}")
        if not cloned:
            gfd = os.open(golden, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for start, end in _data_ranges(gfd, size):
                    _copy_range(gfd, fd, start, end - start)
            finally:
                os.close(gfd)
        _apply(diff, count, fd)
    finally:
        os.close(fd)


def expand(diff: Path, golden: Path, out: Path) -> None:
    """Rebuild the RAM file ``out`` (in place; mode 0600) from ``golden`` and ``diff``;
    on failure ``out`` is removed."""
    size, _ = read_header(diff)  # not a diff (or not this golden's): fail before ``out``
    if golden.stat().st_size != size:
        raise DiffError(f"diff is for {size} bytes of RAM, the golden has {golden.stat().st_size}")
    try:
        rebuild(diff, golden, out, prepare(golden, out))
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _copy_range(src: int, dst: int, off: int, n: int) -> None:
    """Copy ``n`` bytes at ``off`` (same offset in both): in the kernel where it can
    (copy_file_range), else through a buffer."""
    end = off + n
    while off < end:
        try:
            done = os.copy_file_range(src, dst, min(end - off, 1 << 30), off, off)
        except OSError:  # EXDEV (older kernels), EINVAL, ENOSYS: copy it ourselves
            done = 0
        if done == 0:
            break
        off += done
    while off < end:
        data = os.pread(src, min(end - off, _BLOCK), off)
        if not data:
            raise DiffError("the golden memory file is shorter than it was")
        os.pwrite(dst, data, off)
        off += len(data)


def _apply(diff: Path, count: int, fd: int) -> None:
    with open(diff, "rb") as d:
        d.seek(_HEADER.size + count * PAGE)
        index = struct.unpack(f"<{count}I", d.read(4 * count))
        d.seek(_HEADER.size)
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
