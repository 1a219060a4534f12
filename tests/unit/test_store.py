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
