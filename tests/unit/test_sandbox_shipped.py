"""Which files of a suspend snapshot are shipped, from a manifest written by vmctl.store."""

import json

import pytest

from gateway.sandbox.shipped import shippable
from vmctl import store
from vmctl.errors import SnapshotError


def write(d, files):
    d.mkdir()
    for name in ("state", "memory.diff", "disk.qcow2"):
        (d / name).write_bytes(b"x")
    (d / store.MANIFEST).write_text(json.dumps({"driver": "qemu", "accel": "tcg",
                                               "files": files}))


def test_inside_files_are_shipped_the_golden_is_named_apart(tmp_path):
    d = tmp_path / "snapshot"
    write(d, {"state": {"path": "state", "sha256": "0", "size": 1},
              "disk": {"path": str(d / "disk.qcow2"), "size": 1},
              "memory": {"path": "memory.diff", "golden": "/var/lib/agentbox/g/memory"}})
    got = shippable(d)
    assert got.names == ["snapshot/disk.qcow2", "snapshot/memory.diff", "snapshot/state",
                         "snapshot/manifest.json"]
    assert got.outside == ["/var/lib/agentbox/g/memory"]


def test_qemus_memory_file_in_the_root_is_shipped(tmp_path):
    # QemuLayout: the RAM file is {root}/memory, beside the snapshot directory.
    d = tmp_path / "snapshot"
    write(d, {"state": {"path": "state"}, "memory": {"path": str(tmp_path / "memory")},
              "disk": {"path": "disk.qcow2"}})
    assert shippable(d).names == ["memory", "snapshot/disk.qcow2", "snapshot/state",
                                  "snapshot/manifest.json"]


def test_no_manifest_or_consumed_is_refused(tmp_path):
    d = tmp_path / "snapshot"
    d.mkdir()
    with pytest.raises(OSError):
        shippable(d)
    write(tmp_path / "s2", {"state": {"path": "state"}})
    store.mark_consumed(tmp_path / "s2")
    with pytest.raises(SnapshotError):
        shippable(tmp_path / "s2")


def test_describe_suspended_names_files_base_and_meta(tmp_path):
    import dataclasses
    import hashlib

    from gateway.sandbox.shipped import describe_suspended
    from gateway.sandbox.states import State
    from gateway.store.registry import SandboxRecord

    root, golden = tmp_path / "sb", tmp_path / "golden"
    root.mkdir()
    golden.mkdir()
    (golden / store.MANIFEST).write_text('{"golden": 1}')
    write(root / "snapshot", {"state": {"path": "state"}, "memory": {"path": "memory.diff"}})
    rec = SandboxRecord(id="sb", tenant="t1", template="python", state=State.SUSPENDED,
                        slot=3, root=str(root), golden=str(golden), idle_timeout=60.0,
                        host="h", created_at=0.0, updated_at=0.0, last_activity=0.0,
                        vcpus=2, memory_mib=512)
    got = describe_suspended(rec)
    assert got.names == ["snapshot/memory.diff", "snapshot/state", "snapshot/manifest.json"]
    assert got.directory == root
    assert got.base == hashlib.sha256(b'{"golden": 1}').hexdigest()
    assert got.meta["tenant"] == "t1" and got.meta["memory_mib"] == 512
    assert describe_suspended(dataclasses.replace(rec, state=State.RUNNING)) is None
    store.mark_consumed(root / "snapshot")
    assert describe_suspended(rec) is None
