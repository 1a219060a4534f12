"""Compact memory files: keep only the pages that differ from the golden snapshot's.

Theory of operation
-------------------
A QEMU sandbox's RAM file starts as a sparse copy of its golden snapshot's memory file
(vmctl/disks.py), so a suspended sandbox holds every page the golden one had (~150 MiB
for the ``python`` template) plus what it dirtied. On a filesystem with reflinks (XFS,
btrfs) the copy shares the golden's extents and the suspended file costs only its dirtied
extents already. Elsewhere (ext4) ``compact`` punches holes where a chunk equals the golden
file's and lists those ranges; ``refill`` copies them back from the golden file before the
VMM maps the file again.

Crash safety: the range list is written (and fsync'd) *before* any hole is punched, and
``refill`` of a range that was never punched copies identical bytes: harmless. So a crash at
any point leaves a file that ``refill`` makes whole.

Not wired into suspend/wake yet: on this host (ext4, TCG, shared) a refill of ~120 MiB takes
~0.5 s, more than the 20% a wake may grow (``bench/compact.py`` measures both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from pathlib import Path

CHUNK = 64 * 1024  # compare/punch granularity (16 guest pages)
RANGES_FILE = "memory.golden-ranges.json"
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _data_extents(fd: int, size: int):  # type: ignore[no-untyped-def]
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after off
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        off = end


def identical_ranges(memory: Path, golden: Path, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """Chunks of ``memory`` that hold data and equal ``golden`` at the same offset (merged)."""
    ranges: list[list[int]] = []
    with open(memory, "rb") as m, open(golden, "rb") as g:
        size = os.fstat(m.fileno()).st_size
        for start, end in _data_extents(m.fileno(), size):
            pos = start - start % chunk
            while pos < end:
                n = min(chunk, size - pos)
                if os.pread(m.fileno(), n, pos) == os.pread(g.fileno(), n, pos):
                    if ranges and ranges[-1][1] == pos:
                        ranges[-1][1] = pos + n
                    else:
                        ranges.append([pos, pos + n])
                pos += n
    return [(a, b) for a, b in ranges]


def compact(memory: Path, golden: Path, ranges_file: Path) -> int:
    """Punch the chunks equal to ``golden`` out of ``memory``; returns bytes punched."""
    ranges = identical_ranges(memory, golden)
    tmp = ranges_file.with_name(ranges_file.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"golden": str(golden), "ranges": ranges}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ranges_file)
    fd = os.open(memory, os.O_RDWR)
    try:
        for a, b in ranges:
            if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                               ctypes.c_long(a), ctypes.c_long(b - a)) != 0:
                raise OSError(ctypes.get_errno(), f"punching {memory}")
        os.fsync(fd)
    finally:
        os.close(fd)
    return sum(b - a for a, b in ranges)


def refill(memory: Path, ranges_file: Path) -> int:
    """Copy the listed ranges back from the golden file; drop the list. Returns bytes."""
    try:
        listed = json.loads(ranges_file.read_text())
    except FileNotFoundError:
        return 0
    copied = 0
    with open(listed["golden"], "rb") as g, open(memory, "r+b") as m:
        for a, b in listed["ranges"]:
            off = a
            while off < b:
                n = os.copy_file_range(g.fileno(), m.fileno(), b - off, off, off)
                if n <= 0:
                    raise OSError(f"short copy into {memory} at {off}")
                off += n
            copied += b - a
        os.fsync(m.fileno())
    ranges_file.unlink()
    return copied
