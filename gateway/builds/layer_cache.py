"""The Dockerfile build cache's size bound: the least recently used entries go first.

Entries of ``DATA_DIR/build-cache`` (``gateway.builds.service``): step layers ``<key>.qcow2``
(qcow2 overlays chained through their backing files) and finished goldens
``golden-<key>/``. A build touches (mtime) every entry it uses, so an entry's mtime is
its last use. ``collect`` removes entries, oldest first, until what the cache alone
holds fits ``[build] cache_max_mib``; it never removes a layer that a template's disk
(anything under ``DATA_DIR/templates``, where a build's template is a hard-linked copy
of its golden) or a kept entry stands on. A golden's files are shared with its template
(hard links), so they count only when nothing else links them: removing such a golden
frees nothing and costs only a cache hit. Without a bound, one key's builds could fill
the host's disk with layers nobody uses.

``plan`` decides (no I/O); ``collect`` measures, calls it and removes. Called with no
build running (at start-up, and by the build runner after each build, under its
one-at-a-time lock).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vmctl.confine import backing_chain

log = logging.getLogger("agentbox.build_cache")


@dataclass(frozen=True)
class Entry:
    path: Path
    mtime: float  # last use
    size: int  # bytes removing it frees (files nothing else links)
    under: frozenset[Path]  # the layers it stands on (not itself)
    pinned: bool = False  # a template's disk stands on it


def plan(entries: Iterable[Entry], budget: int) -> list[Entry]:
    """The entries to remove, in order, so that the rest fit ``budget`` bytes (as far as
    possible without removing what something kept stands on)."""
    alive = {e.path: e for e in entries}
    total = sum(e.size for e in alive.values())
    removed: list[Entry] = []
    while total > budget:
        needed = {p for e in alive.values() for p in e.under}
        free = [e for e in alive.values() if not e.pinned and e.path not in needed]
        if not free:
            break
        victim = min(free, key=lambda e: (e.mtime, str(e.path)))
        del alive[victim.path]
        removed.append(victim)
        total -= victim.size
    return removed


def touch(path: Path) -> None:
    """Record a use of a cache entry (its mtime orders eviction)."""
    try:
        os.utime(path)
    except OSError:
        pass


def collect(cache: Path, templates: Path, budget: int) -> list[Path]:
    """Remove least recently used entries of ``cache`` until it fits ``budget`` bytes;
    returns what was removed."""
    if not cache.is_dir():
        return []
    pinned = {p for disk in _disks(templates) for p in _chain(disk)}
    entries = []
    for path in cache.iterdir():
        if path.name.startswith("."):  # a build's work in progress
            continue
        if path.is_dir() and path.name.startswith("golden-"):
            under = {p for disk in path.glob("*.qcow2") for p in _chain(disk)}
        elif path.suffix == ".qcow2" and path.is_file():
            under = _chain(path)
            under.discard(path)
        else:
            continue
        entries.append(Entry(path, path.stat().st_mtime, _freeable(path), frozenset(under),
                             pinned=path in pinned))
    removed = plan(entries, budget)
    for entry in removed:
        log.info("build cache: removing %s (%d MiB, last used %.0f)", entry.path.name,
                 entry.size >> 20, entry.mtime)
        if entry.path.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            entry.path.unlink(missing_ok=True)
    return [e.path for e in removed]


def _disks(root: Path) -> list[Path]:
    """Every template's disks (``<id>/*.qcow2``)."""
    return list(root.glob("*/*.qcow2")) if root.is_dir() else []


def _chain(disk: Path) -> set[Path]:
    try:
        return set(backing_chain(disk)) if disk.is_file() else set()
    except (OSError, UnicodeDecodeError):
        return set()


def _freeable(path: Path) -> int:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    total = 0
    for f in files:
        st = f.lstat()
        if st.st_nlink == 1:
            total += st.st_blocks * 512
    return total
