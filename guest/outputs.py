"""``result.files``: what an execute or run_code created or changed under ``/output/``.

Before a run we note every regular file under ``OUTPUT_DIR`` (path -> size, mtime,
inode); after it, files that are new or whose size, mtime or inode differ are the
run's output files, listed as ``{"path", "size"}`` (sorted; download them with the
files API). A file written by something else while the run was in flight (another
exec, a background command) is listed too: the scan cannot tell who wrote it.

Both scans are bounded (``MAX_SCAN`` entries walked, ``MAX_DEPTH`` levels, at most
``MAX_FILES`` listed), so a tenant who fills /output with a million files slows
nothing but their own run's listing. Symlinks are not followed. PID 1
(guest/init.py) creates ``/output`` and ``/input`` (where relative uploads land).
"""

from __future__ import annotations

import asyncio
import os

from guest.protocol import OutputFile

OUTPUT_DIR = "/output"
MAX_SCAN = 10_000
MAX_DEPTH = 16
MAX_FILES = 1000

Snapshot = dict[str, tuple[int, int, int]]


def scan(root: str = OUTPUT_DIR) -> Snapshot:
    """Regular files under ``root``: path -> (size, mtime_ns, inode). Bounded."""
    return _walk(root, MAX_SCAN)[0]


def scan_small(root: str = OUTPUT_DIR, limit: int = 64) -> Snapshot | None:
    """``scan`` if ``root`` holds at most ``limit`` entries, else None. Cheap enough to
    run on the event loop, where a thread hop would cost more than the scan."""
    found, complete = _walk(root, limit)
    return found if complete else None


async def scan_async(root: str = OUTPUT_DIR) -> Snapshot:
    """``scan`` from the event loop: inline while ``root`` is small, else in a thread."""
    small = scan_small(root)
    return small if small is not None else await asyncio.to_thread(scan, root)


def _walk(root: str, limit: int) -> tuple[Snapshot, bool]:
    found: Snapshot = {}
    stack, seen = [(root, 0)], 0
    while stack and seen < limit:
        path, depth = stack.pop()
        try:
            entries = os.scandir(path)
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > limit:
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if depth + 1 < MAX_DEPTH:
                            stack.append((entry.path, depth + 1))
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found[entry.path] = (st.st_size, st.st_mtime_ns, st.st_ino)
                except OSError:
                    continue
    return found, seen <= limit and not stack


def changed(before: Snapshot, after: Snapshot) -> list[OutputFile]:
    """Files new or modified between two scans (bounded, sorted by path)."""
    paths = sorted(p for p, meta in after.items() if before.get(p) != meta)
    return [OutputFile(p, after[p][0]) for p in paths[:MAX_FILES]]
