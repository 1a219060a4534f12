"""Spare RAM files: durable copies of a golden's memory, made ahead of the wakes that need one.

A wake from a compact snapshot (``vmctl.memdiff``) must make the rebuilt RAM file durable
before the restore. Where the filesystem has no reflinks (ext4), that is writing the
golden's data (~150 MiB for ``python``) to disk on the wake path, which costs far more
than the VMM start it overlaps with. A spare is that copy, made in the background (after
a compaction, the event that creates the need) and fsynced: a wake renames it into
place as the sandbox's RAM file (same filesystem; the old file, whatever a crashed
rebuild left, goes with the rename) and writes and fsyncs only the diff's pages.

Layout (``directory`` is ``<sandboxes dir>/.ram-spares``)::

    <key>/golden        symlink to the golden memory file the spares copy
    <key>/<uuid>.ram    ready: complete, fsynced, mode 0600
    <key>/.<uuid>.tmp   being written (removed when found by the next fill)
    <key>/.lock         held (flock) by the one fill at a time
    .<uuid>.tmp/        a <key> directory being made (renamed into place whole)

``key`` names the golden file (path, inode, size, mtime), so a rebuilt golden never
hands out a spare of its predecessor; ``fill`` removes the spares of goldens that
changed or are gone. Disk: ``count`` x the golden's data per golden in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

from images.manifest import fsync_dir
from vmctl import memdiff

SPARES_DIR = ".ram-spares"
_READY, _TMP = ".ram", ".tmp"


def key(golden: Path) -> str:
    st = golden.stat()
    ident = f"{golden.resolve()}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def take(directory: Path, golden: Path, dest: Path) -> bool:
    """Move a ready spare of ``golden`` to ``dest`` (replacing what is there; durable when
    this returns); False if there is none."""
    try:
        sub = directory / key(golden)
        names = sorted(n for n in os.listdir(sub) if n.endswith(_READY))
    except OSError:
        return False
    for name in names:
        try:
            os.rename(sub / name, dest)
        except FileNotFoundError:  # another wake took it first
            continue
        fsync_dir(dest.parent)
        return True
    return False


def ready(directory: Path, golden: Path) -> int:
    """How many spares of ``golden`` are ready."""
    try:
        return sum(n.endswith(_READY) for n in os.listdir(directory / key(golden)))
    except OSError:
        return 0


def fill(directory: Path, golden: Path, count: int,
         cancel: threading.Event | None = None) -> int:
    """Make spares of ``golden`` until ``count`` are ready; returns how many were made (0
    also when another fill holds the lock). Blocking (a worker thread); ``cancel`` stops
    it between copies and removes the unfinished one."""
    if count <= 0:
        return 0
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    prune(directory)
    sub = directory / key(golden)
    if not sub.is_dir():  # made whole (with its golden link) and renamed into place
        tmpdir = directory / f".{uuid.uuid4().hex}{_TMP}"
        tmpdir.mkdir(mode=0o700)
        (tmpdir / "golden").symlink_to(golden.resolve())
        try:
            os.rename(tmpdir, sub)
        except OSError:  # another fill made it first
            shutil.rmtree(tmpdir, ignore_errors=True)
    with open(sub / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        for stale in sub.glob("." + "*" + _TMP):  # left by a fill that died
            stale.unlink(missing_ok=True)
        made = 0
        while ready(directory, golden) < count:
            if cancel is not None and cancel.is_set():
                break
            tmp = sub / f".{uuid.uuid4().hex}{_TMP}"
            try:
                memdiff.copy_golden(golden, tmp, cancel)
                os.rename(tmp, sub / (tmp.name[1:-len(_TMP)] + _READY))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(sub)
            made += 1
        return made


def prune(directory: Path) -> None:
    """Remove the spares of goldens that changed or are gone (and what a fill that died
    while making a directory left, after a minute)."""
    with contextlib.suppress(FileNotFoundError):
        for sub in directory.iterdir():
            if sub.name.startswith("."):
                with contextlib.suppress(OSError):
                    if time.time() - sub.stat().st_mtime > 60:
                        shutil.rmtree(sub, ignore_errors=True)
                continue
            try:
                target = Path(os.readlink(sub / "golden"))
                current = key(target) == sub.name
            except OSError:
                current = False
            if not current:
                shutil.rmtree(sub, ignore_errors=True)
