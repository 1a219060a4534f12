"""The object store for real: a SeaweedFS ``weed server`` on loopback, a snapshot
directory made here (sparse and odd-sized files, a few MiB), uploaded and fetched back
byte for byte through gateway.cluster.shipping, and the refusals on real objects."""

from __future__ import annotations

import hashlib
import os

import pytest

from gateway.cluster.objstore import ObjectStoreError
from gateway.cluster.shipping import (
    INDEX, Index, SnapshotRefused, describe, fetch, plan_upload, upload)
from tests.cluster.weed_env import weed_s3

pytestmark = pytest.mark.timeout(180)


def make_snapshot(d):
    """A sandbox root as QemuLayout leaves it: the RAM file beside ``snapshot/``."""
    (d / "snapshot").mkdir(parents=True)
    (d / "memory").write_bytes(os.urandom(3 << 20) + b"tail")  # > one 1 MiB chunk, odd size
    (d / "snapshot" / "disk.qcow2").write_bytes(os.urandom(1 << 20))
    (d / "snapshot" / "state").write_bytes(b"device state")
    (d / "snapshot" / "empty").write_bytes(b"")
    (d / "snapshot" / "manifest.json").write_bytes(b'{"driver": "test"}')
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


async def test_upload_and_fetch_byte_for_byte(tmp_path):
    names = make_snapshot(tmp_path / "snap")
    files = await describe(tmp_path / "snap", names)
    index = Index("sb-1", base="tmpl-base-abc", files=files,
                  meta={"tenant": "t1", "template": "python"})
    plan = plan_upload("/agentbox", index)
    async with weed_s3(tmp_path / "weed") as store:
        location = await upload(store, plan, tmp_path / "snap", concurrency=2)
        assert location == plan.location
        got = await fetch(store, location, tmp_path / "restored", base="tmpl-base-abc")
        assert got == index
        for name in names:
            assert (tmp_path / "restored" / name).read_bytes() == \
                (tmp_path / "snap" / name).read_bytes(), name

        # Another base image: refused before any file is fetched.
        with pytest.raises(SnapshotRefused, match="base"):
            await fetch(store, location, tmp_path / "other", base="tmpl-base-OTHER")
        assert not (tmp_path / "other").exists()

        # A byte changed in the store: refused, nothing left behind.
        memory = (tmp_path / "snap" / "memory").read_bytes()
        bad = memory[:1000] + bytes([memory[1000] ^ 1]) + memory[1001:]
        bad_path = tmp_path / "bad"
        bad_path.write_bytes(bad)
        await store.put_file(f"{plan.prefix}/memory", bad_path,
                             hashlib.sha256(bad).hexdigest())
        with pytest.raises(SnapshotRefused, match="memory"):
            await fetch(store, location, tmp_path / "again", base="tmpl-base-abc")
        assert not (tmp_path / "again").exists()
        assert not (tmp_path / "again.fetching").exists()

        # A record naming an index that is not there (the upload never finished).
        await store.delete(f"{plan.prefix}/{INDEX}")
        with pytest.raises(ObjectStoreError):
            await fetch(store, location, tmp_path / "gone", base="tmpl-base-abc")



async def test_a_suspend_is_shipped_and_named_in_the_record(tmp_path):
    """The shipper end to end against the real store: SUSPENDED heard -> files and index
    uploaded -> the record names them -> a fetch elsewhere gets the same bytes."""
    import asyncio

    from gateway.cluster.records import SandboxRecord
    from gateway.cluster.shipper import LocalSnapshot, Shipper
    from gateway.sandbox.states import State
    from gateway.store.feed import Transition
    from tests.unit.test_cluster_shipper import FakeOwnership

    names = make_snapshot(tmp_path / "snap")
    own = FakeOwnership(SandboxRecord("sb-2", "h1", State.SUSPENDED))

    async def local(sandbox_id):
        return LocalSnapshot(tmp_path / "snap", names, "base-x", {"tenant": "t"})

    async with weed_s3(tmp_path / "weed") as store:
        shipper = Shipper(store, own, "h1", lambda: 7, local, key_prefix="/agentbox")
        try:
            shipper.heard(Transition(1, "sb-2", "t", "suspending", "suspended", "x", "", 0.0))
            async with asyncio.timeout(60):
                while shipper.uploading:
                    await asyncio.sleep(0.05)
            assert shipper.failures == 0
            location = own.current.record.snapshot
            index = await fetch(store, location, tmp_path / "elsewhere", base="base-x")
        finally:
            await shipper.aclose()
    assert index.meta == {"tenant": "t"}
    for name in names:
        assert (tmp_path / "elsewhere" / name).read_bytes() == \
            (tmp_path / "snap" / name).read_bytes()
