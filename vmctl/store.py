"""Snapshot store: a snapshot is a directory of files plus ``manifest.json``.

The manifest is written last, to a temp name and renamed, so a directory
without a manifest is by definition incomplete (a crash mid-snapshot) and is
discarded by whoever finds it. It records the SHA256 and size of every file;
``verify`` refuses to hand out a snapshot whose files do not match.

Hashing a 256 MiB memory file takes a noticeable fraction of a second, so
verified digests are cached per (path, inode, size, mtime, ctime): a file that
has not been touched since it was last verified is not read again. ctime is in
the key because nothing can set it back: a write that restores the mtime
afterwards still misses the cache and is hashed (and caught).

What is verified, per file: golden snapshots hash every file. A sandbox's own
(suspend) snapshot hashes the device state only (``hash_roles``); its memory
and disk are recorded with their size, and roles in ``stat_roles`` also with
their mtime, which ``load`` compares (a cheap check that nothing wrote to them
since the suspend; it does not detect same-size, same-mtime corruption).
Which roles get which check is the backend's choice (``vmctl.disks.Layout``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmctl import faults
from vmctl.errors import SnapshotError
from vmctl.spec import Accel, SnapshotFiles

MANIFEST = "manifest.json"
CONSUMED = "consumed"  # written (durably) just before a guest first runs from the snapshot
_CHUNK = 1 << 20
_verified: dict[tuple[str, int, int, int, int], str] = {}


@dataclass(frozen=True)
class Manifest:
    driver: str
    accel: str
    files: dict[str, dict[str, Any]]  # role -> {"path", "sha256", "size"}
    created_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            return cls(**raw)
        except (ValueError, TypeError) as exc:
            raise SnapshotError(f"unreadable snapshot manifest: {exc}") from exc


def _stat_key(path: Path) -> tuple[str, int, int, int, int]:
    st = path.stat()
    return (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class SealCancelled(Exception):
    pass


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    key = _stat_key(path)
    cached = _verified.get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if cancel is not None and cancel.is_set():
                raise SealCancelled(str(path))
            h.update(chunk)
    digest = h.hexdigest()
    if _stat_key(path) == key:  # only cache what did not change while we read it
        _verified[key] = digest
    return digest


def seal(directory: Path, role: str, cancel: threading.Event) -> None:
    """Add the SHA256 of ``role``'s file to a complete snapshot's manifest.

    Used for large files (guest memory) after a suspend has finished, off the
    critical path; ``cancel`` aborts it when the sandbox is woken first (that
    snapshot is then loaded with only its smaller files verified)."""
    mpath = directory / MANIFEST
    manifest = Manifest.from_json(mpath.read_bytes())
    entry = dict(manifest.files[role])
    entry["sha256"] = sha256_file(directory / entry["path"], cancel)
    files = {**manifest.files, role: entry}
    sealed = Manifest(manifest.driver, manifest.accel, files, manifest.created_at, manifest.meta)
    if cancel.is_set():
        raise SealCancelled(str(directory))
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_bytes(sealed.to_json())
    _fsync(tmp)
    os.replace(tmp, mpath)


MEMORY_DIFF = "memory.diff"


def _rewrite_manifest(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    mpath = directory / MANIFEST
    manifest = Manifest.from_json(mpath.read_bytes())
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_bytes(Manifest(manifest.driver, manifest.accel, files, manifest.created_at,
                             manifest.meta).to_json())
    _fsync(tmp)
    os.replace(tmp, mpath)
    _fsync(directory)


def compact_memory(directory: Path, golden_memory: Path, cancel: threading.Event) -> int | None:
    """Store a complete snapshot's (external) memory file as its diff from the golden's
    (``vmctl.memdiff``) and delete the memory file; returns the bytes saved, or None if the
    snapshot is already compact. Crash-safe: the manifest names the diff (fsynced) before
    the memory file goes, and ``expand_memory`` accepts either."""
    from vmctl import memdiff
    manifest = Manifest.from_json((directory / MANIFEST).read_bytes())
    entry = dict(manifest.files["memory"])
    if "diff" in entry:
        return None
    memory = directory / entry["path"]
    if "mtime_ns" in entry:
        _check_stat("memory", memory, entry)  # nothing wrote to it since the suspend
    before = memory.stat().st_blocks * 512
    stats = memdiff.compact(memory, golden_memory, directory / MEMORY_DIFF, cancel)
    if cancel.is_set():
        (directory / MEMORY_DIFF).unlink(missing_ok=True)
        raise SealCancelled(str(directory))
    diff = directory / MEMORY_DIFF
    entry["diff"] = {"path": MEMORY_DIFF, "size": stats.diff_bytes,
                     "mtime_ns": diff.stat().st_mtime_ns, "golden": str(golden_memory)}
    _rewrite_manifest(directory, {**manifest.files, "memory": entry})
    faults.point("compact.recorded")
    memory.unlink()
    return before - stats.diff_bytes


@dataclass(frozen=True)
class Rebuild:
    """A compact snapshot's memory file, made ready at its final path (``prepare_memory``)
    and not yet rebuilt."""

    memory: Path
    diff: Path
    golden: Path
    cloned: bool  # holds the golden's pages (a reflink, a spare): only the diff is left to write


def prepare_memory(directory: Path, spares: Path | None = None) -> Rebuild | None:
    """First step of a wake from a compact snapshot: check its diff and make the memory
    file at its final path, emptied (whatever a crashed rebuild left) and sized, mode
    0600, so a VMM can map it while ``expand_memory`` rebuilds it in place: a spare copy
    of the golden's memory from ``spares`` if one is ready (``vmctl.ramspare``; only the
    diff is left to write), else a reflink or holes. None if the snapshot is not compact
    (its memory file is whole)."""
    from vmctl import memdiff, ramspare
    manifest = Manifest.from_json((directory / MANIFEST).read_bytes())
    entry = manifest.files["memory"]
    diff_entry = entry.get("diff")
    if diff_entry is None:
        return None
    diff, golden = directory / diff_entry["path"], Path(diff_entry["golden"])
    if not diff.is_file():
        raise SnapshotError("the snapshot's memory diff is missing")
    _check_stat("memory diff", diff, diff_entry)
    memory = directory / entry["path"]
    try:
        size, _ = memdiff.read_header(diff)
        if golden.stat().st_size != size:
            raise memdiff.DiffError(f"the diff is for {size} bytes of RAM, the golden "
                                    f"has {golden.stat().st_size}")
        cloned = spares is not None and ramspare.take(spares, golden, memory) and \
            memory.stat().st_size == size
        if not cloned:
            cloned = memdiff.prepare(golden, memory)
    except (memdiff.DiffError, OSError) as exc:
        raise SnapshotError(f"cannot rebuild the snapshot's memory: {exc}") from exc
    return Rebuild(memory, diff, golden, cloned)


def expand_memory(directory: Path, prepared: Rebuild | None = None) -> bool:
    """Undo ``compact_memory`` before a restore: rebuild the memory file (in place, as
    ``prepare_memory`` made it; prepared here if not given) from the golden and the
    diff, fsync it, record it in the manifest, drop the diff. False if not compact.

    Crash-safe: the manifest names the diff until the rebuilt file is durable, and a
    rebuild that did not finish is redone from scratch by the next wake."""
    from vmctl import memdiff
    if prepared is None:
        prepared = prepare_memory(directory)
        if prepared is None:
            return False
    manifest = Manifest.from_json((directory / MANIFEST).read_bytes())
    entry = dict(manifest.files["memory"])
    entry.pop("diff", None)
    try:
        memdiff.rebuild(prepared.diff, prepared.golden, prepared.memory, prepared.cloned)
    except (memdiff.DiffError, OSError) as exc:
        raise SnapshotError(f"cannot rebuild the snapshot's memory: {exc}") from exc
    memory = prepared.memory
    _fsync(memory)
    faults.point("expand.rebuilt")
    st = memory.stat()
    entry.pop("sha256", None)  # a new file: checked by size and mtime like any suspend's
    entry.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    _rewrite_manifest(directory, {**manifest.files, "memory": entry})
    prepared.diff.unlink()
    return True


def write_manifest(directory: Path, snap: SnapshotFiles, meta: dict[str, Any] | None = None,
                   hash_roles: tuple[str, ...] = ("state", "memory", "disk"),
                   stat_roles: tuple[str, ...] = ()) -> Manifest:
    """Fsync the snapshot's files, hash them (``hash_roles``) or record their mtime
    (``stat_roles``), and write the manifest atomically."""
    files: dict[str, dict[str, Any]] = {}
    for role in ("state", "memory", "disk"):
        path: Path = getattr(snap, role)
        _fsync(path)
        # Files inside the snapshot directory are recorded relative to it, so the
        # directory can be renamed into place after it is complete.
        rel = path.relative_to(directory) if path.is_relative_to(directory) else path
        entry: dict[str, Any] = {"path": str(rel), "size": path.stat().st_size}
        if role in hash_roles:
            entry["sha256"] = sha256_file(path)
        elif role in stat_roles:
            entry["mtime_ns"] = path.stat().st_mtime_ns
        files[role] = entry
    manifest = Manifest(driver=snap.driver, accel=snap.accel.value, files=files,
                        meta={**snap.extra, **(meta or {})})
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_bytes(manifest.to_json())
    _fsync(tmp)
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)
    return manifest


def mark_consumed(directory: Path) -> None:
    """Record, before the guest runs, that this snapshot is being resumed from: the
    guest then writes the memory file and disk it describes, so it must never be
    restored again (a crash after this point means: cold boot the disk)."""
    path = directory / CONSUMED
    path.write_bytes(b"")
    _fsync(path)
    _fsync(directory)


def is_consumed(directory: Path) -> bool:
    return (directory / CONSUMED).exists()


def load(directory: Path, verify: bool = True) -> tuple[SnapshotFiles, Manifest]:
    """Read and (by default) verify a snapshot; raise SnapshotError if unusable."""
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise SnapshotError(f"no complete snapshot in {directory}")
    if is_consumed(directory):
        raise SnapshotError("the snapshot was already resumed from once (its guest ran)")
    manifest = Manifest.from_json(mpath.read_bytes())
    paths = {}
    for role in ("state", "memory", "disk"):
        entry = manifest.files.get(role)
        if not entry:
            raise SnapshotError(f"snapshot manifest in {directory} lacks {role!r}")
        path = directory / entry["path"]  # absolute paths stay absolute
        if "diff" in entry:  # compact memory (compact_memory): usable once expanded
            if not (directory / entry["diff"]["path"]).is_file():
                raise SnapshotError(f"snapshot {role} diff is missing")
            if verify:
                raise SnapshotError(f"snapshot {role} is compact: expand_memory first")
            paths[role] = path
            continue
        if not path.is_file():
            raise SnapshotError(f"snapshot {role} file {path} is missing")
        if verify and "sha256" in entry and sha256_file(path) != entry["sha256"]:
            raise SnapshotError(f"snapshot {role} file {path} does not match its SHA256")
        if verify and "mtime_ns" in entry:
            _check_stat(role, path, entry)
        paths[role] = path
    snap = SnapshotFiles(state=paths["state"], memory=paths["memory"], disk=paths["disk"],
                         accel=Accel(manifest.accel), driver=manifest.driver, extra=manifest.meta)
    return snap, manifest


def _check_stat(role: str, path: Path, entry: dict[str, Any]) -> None:
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) != (entry.get("size"), entry["mtime_ns"]):
        raise SnapshotError(f"snapshot {role} file {path} changed since the snapshot "
                            f"(size/mtime {st.st_size}/{st.st_mtime_ns}, "
                            f"recorded {entry.get('size')}/{entry['mtime_ns']})")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
