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

import os

from guest.protocol import OutputFile

OUTPUT_DIR = "/output"
MAX_SCAN = 10_000
MAX_DEPTH = 16
MAX_FILES = 1000

Snapshot = dict[str, tuple[int, int, int]]


def scan(root: str = OUTPUT_DIR) -> Snapshot:
    """Regular files under ``root``: path -> (size, mtime_ns, inode). Bounded."""
    found: Snapshot = {}
    stack, seen = [(root, 0)], 0
    while stack and seen < MAX_SCAN:
        path, depth = stack.pop()
        try:
            entries = os.scandir(path)
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > MAX_SCAN:
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
    return found


def changed(before: Snapshot, after: Snapshot) -> list[OutputFile]:
    """Files new or modified between two scans (bounded, sorted by path)."""
    paths = sorted(p for p, meta in after.items() if before.get(p) != meta)
    return [OutputFile(p, after[p][0]) for p in paths[:MAX_FILES]]
