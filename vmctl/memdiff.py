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

import ctypes
import errno
import fcntl
import functools
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
_ZERO_PAGE = bytes(PAGE)
_SYNC_FILE_RANGE_WRITE = 2
_WRITEBACK = 8 << 20
_FALLOC_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
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
    golden_runs(golden)  # computed here, in the background, for the wake that rebuilds it
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
    ``diff``: the golden's non-zero pages (unless ``cloned``; zero pages stay holes), then
    the diff's pages, copied in the kernel. The writes go through the page cache, so a VMM
    that has the file mapped shared sees them; the caller fsyncs (writeback is started as
    the copy goes: the disk, not the copy, is what a rebuild waits for). Not atomic:
    ``out`` is usable only once this returns."""
    size, count = read_header(diff)
    if golden.stat().st_size != size:
        raise DiffError(f"diff is for {size} bytes of RAM, the golden has {golden.stat().st_size}")
    fd = os.open(out, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != size:
            raise DiffError(f"{out.name} is {os.fstat(fd).st_size} bytes, not {size}")
        index = _read_index(diff, count, size)
        if not cloned:
            _copy_golden_into(golden, fd)
        _apply(diff, index, fd)
    finally:
        os.close(fd)


def copy_golden(golden: Path, out: Path, cancel: threading.Event | None = None) -> None:
    """Make ``out`` a durable copy of ``golden`` (a reflink, or its non-zero pages in a
    file of holes), mode 0600: a spare RAM file (``vmctl.ramspare``)."""
    if not prepare(golden, out):
        fd = os.open(out, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _copy_golden_into(golden, fd, cancel)
        finally:
            os.close(fd)
    fd = os.open(out, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_golden_into(golden: Path, fd: int, cancel: threading.Event | None = None) -> None:
    """Copy the golden's non-zero pages to the same offsets of ``fd``."""
    gfd = os.open(golden, os.O_RDONLY | os.O_CLOEXEC)
    try:
        since = 0  # writeback is started every _WRITEBACK bytes, as the copy goes
        for start, end in golden_runs(golden):
            for off in range(start, end, _WRITEBACK):
                if cancel is not None and cancel.is_set():
                    raise Cancelled(str(golden))
                _copy_range(gfd, fd, off, off, min(_WRITEBACK, end - off))
            if end - since >= _WRITEBACK:
                _start_writeback(fd, since, end - since)
                since = end
    finally:
        os.close(gfd)


_runs: dict[tuple[str, int, int, int], list[tuple[int, int]]] = {}


def golden_runs(golden: Path) -> list[tuple[int, int]]:
    """(start, end) byte ranges of a golden memory file's non-zero pages. A golden file
    never changes, so this is computed once per (path, inode, size, mtime): ``compact``
    computes it in the background, so a wake finds it ready."""
    st = golden.stat()
    key = (str(golden), st.st_ino, st.st_size, st.st_mtime_ns)
    runs = _runs.get(key)
    if runs is not None:
        return runs
    fd = os.open(golden, os.O_RDONLY | os.O_CLOEXEC)
    try:
        runs = _nonzero_runs(fd, st.st_size)
    finally:
        os.close(fd)
    _runs[key] = runs
    return runs


def _nonzero_runs(fd: int, size: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for start, end in _data_ranges(fd, size):
        for block in range(start, end, _BLOCK):
            data = memoryview(_read(fd, block, min(_BLOCK, end - block)))
            if data == _ZERO_BLOCK[:len(data)]:
                continue
            for p in range(0, len(data), PAGE):
                if data[p:p + PAGE] == _ZERO_PAGE[:len(data) - p]:
                    continue
                at = block + p
                if runs and runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], at + min(PAGE, len(data) - p))
                else:
                    runs.append((at, at + min(PAGE, len(data) - p)))
    return runs


def punch_zero_pages(path: Path) -> int:
    """Make every all-zero page of ``path`` a hole (same contents, fewer blocks; fsynced);
    returns the bytes of blocks it gave back (0 where the filesystem cannot punch holes).
    A golden's RAM file needs it: its guest zeroes every page it frees (``init_on_free``),
    so every page it ever freed, at boot all of RAM, is written zeros, which each sandbox's
    copy and each compaction would otherwise read."""
    libc = _libc()
    if libc is None:
        return 0
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size, before = os.fstat(fd).st_size, os.fstat(fd).st_blocks * 512
        at = 0
        for start, end in [*_nonzero_runs(fd, size), (size, size)]:
            if start > at and libc.fallocate(fd, _FALLOC_PUNCH_HOLE_KEEP_SIZE,
                                             ctypes.c_int64(at), ctypes.c_int64(start - at)):
                err = ctypes.get_errno()
                if err == errno.EOPNOTSUPP:
                    return 0
                raise OSError(err, f"cannot punch holes in {path}: {os.strerror(err)}")
            at = end
        os.fsync(fd)
        return before - os.fstat(fd).st_blocks * 512
    finally:
        os.close(fd)


def _start_writeback(fd: int, off: int = 0, n: int = 0) -> None:
    """Start writing dirty pages (``n`` = 0: to the end) to disk without waiting for them
    (sync_file_range), so the disk works while we copy and the caller's fsync has less
    left to wait for; best effort."""
    libc = _libc()
    if libc is not None:
        libc.sync_file_range(fd, ctypes.c_int64(off), ctypes.c_int64(n), _SYNC_FILE_RANGE_WRITE)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sync_file_range  # noqa: B018 - present on Linux
    except (OSError, AttributeError):
        return None
    return libc


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


def _copy_range(src: int, dst: int, src_off: int, dst_off: int, n: int) -> None:
    """Copy ``n`` bytes from ``src_off`` to ``dst_off``: in the kernel where it can
    (copy_file_range), else through a buffer."""
    while n > 0:
        try:
            done = os.copy_file_range(src, dst, min(n, 1 << 30), src_off, dst_off)
        except OSError:  # EXDEV (older kernels), EINVAL, ENOSYS: copy it ourselves
            break
        if done == 0:
            break
        src_off, dst_off, n = src_off + done, dst_off + done, n - done
    while n > 0:
        data = os.pread(src, min(n, _BLOCK), src_off)
        if not data:
            raise DiffError("a file being copied is shorter than it was")
        os.pwrite(dst, data, dst_off)
        src_off, dst_off, n = src_off + len(data), dst_off + len(data), n - len(data)


def _read_index(diff: Path, count: int, size: int) -> tuple[int, ...]:
    """The diff's page numbers, checked: ascending and inside the RAM."""
    with open(diff, "rb") as d:
        d.seek(_HEADER.size + count * PAGE)
        raw = d.read(4 * count)
    if len(raw) != 4 * count:
        raise DiffError(f"{diff.name} is truncated")
    index = struct.unpack(f"<{count}I", raw)
    if any(a >= b for a, b in zip(index, index[1:], strict=False)):
        raise DiffError(f"{diff.name}: its page numbers are not ascending")
    if index and (index[-1] + 1) * PAGE > size:
        raise DiffError(f"{diff.name} has a page beyond the RAM's {size} bytes")
    return index


def _apply(diff: Path, index: tuple[int, ...], fd: int) -> None:
    """Write the diff's pages where they belong; runs of consecutive pages in one copy."""
    dfd = os.open(diff, os.O_RDONLY | os.O_CLOEXEC)
    try:
        i, count = 0, len(index)
        while i < count:
            j = i + 1
            while j < count and index[j] == index[j - 1] + 1:
                j += 1
            _copy_range(dfd, fd, _HEADER.size + i * PAGE, index[i] * PAGE, (j - i) * PAGE)
            i = j
    finally:
        os.close(dfd)
