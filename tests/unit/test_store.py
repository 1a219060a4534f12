import threading

import pytest

from vmctl import store
from vmctl.errors import SnapshotError
from vmctl.spec import Accel, SnapshotFiles


def _snapshot(tmp_path):
    d = tmp_path / "snap"
    d.mkdir()
    (d / "vmstate").write_bytes(b"state" * 100)
    mem = tmp_path / "memory"
    mem.write_bytes(b"\0" * 4096 + b"ram")
    disk = tmp_path / "disk.qcow2"
    disk.write_bytes(b"disk")
    snap = SnapshotFiles(state=d / "vmstate", memory=mem, disk=disk, accel=Accel.TCG,
                         driver="qemu")
    return d, snap


def test_manifest_round_trip_with_relative_and_absolute_paths(tmp_path):
    d, snap = _snapshot(tmp_path)
    store.write_manifest(d, snap, hash_roles=("state",))
    renamed = tmp_path / "moved"
    d.rename(renamed)  # files inside the directory are recorded relative to it
    loaded, manifest = store.load(renamed)
    assert loaded.state == renamed / "vmstate" and loaded.memory == snap.memory
    assert "sha256" in manifest.files["state"] and "sha256" not in manifest.files["memory"]


def test_corrupt_state_is_refused(tmp_path):
    d, snap = _snapshot(tmp_path)
    store.write_manifest(d, snap, hash_roles=("state",))
    (d / "vmstate").write_bytes(b"tampered")
    with pytest.raises(SnapshotError, match="SHA256"):
        store.load(d)


def test_sealed_memory_is_verified(tmp_path):
    d, snap = _snapshot(tmp_path)
    store.write_manifest(d, snap, hash_roles=("state",))
    store.seal(d, "memory", threading.Event())
    _, manifest = store.load(d)
    assert manifest.files["memory"]["sha256"]
    with open(snap.memory, "r+b") as f:
        f.seek(10)
        f.write(b"X")
    with pytest.raises(SnapshotError, match="memory"):
        store.load(d)


def test_cancelled_seal_leaves_manifest_unchanged(tmp_path):
    d, snap = _snapshot(tmp_path)
    store.write_manifest(d, snap, hash_roles=("state",))
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(store.SealCancelled):
        store.seal(d, "memory", cancel)
    assert "sha256" not in store.load(d)[1].files["memory"]


def test_directory_without_manifest_is_incomplete(tmp_path):
    d, _ = _snapshot(tmp_path)
    with pytest.raises(SnapshotError, match="no complete snapshot"):
        store.load(d)


def _compact_snapshot(tmp_path):
    """A suspend snapshot whose memory (4 MiB, mostly the golden's) is stored as a diff."""
    import os
    golden = tmp_path / "golden"
    with open(golden, "wb") as f:
        f.truncate(4 << 20)
        f.write(os.urandom(1 << 20))
    d = tmp_path / "snap"
    d.mkdir()
    (d / "vmstate").write_bytes(b"state" * 100)
    mem, disk = tmp_path / "memory", tmp_path / "disk.qcow2"
    mem.write_bytes(golden.read_bytes())
    with open(mem, "r+b") as f:
        f.seek(3 << 20)
        f.write(b"dirtied by the guest")
    disk.write_bytes(b"disk")
    snap = SnapshotFiles(state=d / "vmstate", memory=mem, disk=disk, accel=Accel.TCG,
                         driver="qemu")
    store.write_manifest(d, snap, hash_roles=("state",), stat_roles=("memory", "disk"))
    want = mem.read_bytes()
    store.compact_memory(d, golden, threading.Event())
    assert not mem.exists()
    return d, mem, want


def _memory_entry(d):
    import json
    return json.loads((d / store.MANIFEST).read_text())["files"]["memory"]


def test_a_wake_prepares_the_memory_file_then_rebuilds_it_in_place(tmp_path):
    d, mem, want = _compact_snapshot(tmp_path)
    prepared = store.prepare_memory(d)
    assert prepared is not None and mem.stat().st_size == len(want)
    assert mem.stat().st_mode & 0o777 == 0o600
    inode = mem.stat().st_ino
    assert "diff" in _memory_entry(d)  # nothing is recorded before the file is durable
    with pytest.raises(SnapshotError, match="compact"):
        store.load(d)
    assert store.expand_memory(d, prepared)
    assert mem.stat().st_ino == inode  # in place: a VMM that mapped it sees the rebuild
    assert mem.read_bytes() == want and "diff" not in _memory_entry(d)
    assert not (d / store.MEMORY_DIFF).exists()
    store.load(d)  # size and mtime as recorded
    assert store.prepare_memory(d) is None and not store.expand_memory(d)


def test_a_rebuild_that_failed_half_way_is_redone_from_scratch(tmp_path, monkeypatch):
    from vmctl import memdiff
    d, mem, want = _compact_snapshot(tmp_path)
    real_apply = memdiff._apply

    def dies(diff, index, fd):  # the golden's pages are in, the diff's not yet
        raise OSError(5, "I/O error")

    monkeypatch.setattr(memdiff, "_apply", dies)
    with pytest.raises(SnapshotError, match="rebuild"):
        store.expand_memory(d)
    assert "diff" in _memory_entry(d) and mem.read_bytes() != want
    monkeypatch.setattr(memdiff, "_apply", real_apply)
    with open(mem, "r+b") as f:  # and whatever else a crash left there
        f.write(b"junk" * 1000)
    assert store.expand_memory(d)
    assert mem.read_bytes() == want


def test_a_damaged_diff_is_found_before_the_memory_file_is_touched(tmp_path):
    d, mem, _ = _compact_snapshot(tmp_path)
    with open(d / store.MEMORY_DIFF, "r+b") as f:
        f.write(b"X")  # same size, new mtime
    with pytest.raises(SnapshotError, match="changed since"):
        store.prepare_memory(d)
    assert not mem.exists()
