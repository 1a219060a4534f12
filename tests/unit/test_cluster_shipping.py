"""Shipping's logic with an in-memory store: the upload plan, the order (index last),
retries, and the fetch refusing any byte that does not match (nothing left behind).
The real object store is in tests/cluster/test_objstore.py."""

import asyncio
import hashlib
from pathlib import Path

import pytest

from gateway.cluster.objstore import ObjectStoreError
from gateway.cluster.shipping import (
    INDEX, Index, ShipFile, SnapshotRefused, describe, fetch, parse_location, plan_upload,
    upload)


class MemStore:
    def __init__(self, fail_puts=0):
        self.objects: dict[str, bytes] = {}
        self.order: list[str] = []
        self.fail_puts = fail_puts

    async def put_file(self, key, path, sha256):
        if self.fail_puts:
            self.fail_puts -= 1
            raise ObjectStoreError("HTTP 503", 503)
        data = Path(path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha256
        self.objects[key] = data
        self.order.append(key)

    async def put_bytes(self, key, data):
        self.objects[key] = data
        self.order.append(key)

    async def get_bytes(self, key, limit):
        if key not in self.objects:
            raise ObjectStoreError("HTTP 404", 404)
        return self.objects[key][:limit + 1]

    async def get_file(self, key, path, limit):
        data = self.objects[key][:limit + 1]
        Path(path).write_bytes(data)
        return hashlib.sha256(data).hexdigest()


async def shipped(tmp_path, store=None):
    d = tmp_path / "snap"
    d.mkdir()
    (d / "memory").write_bytes(b"m" * 5000)
    (d / "disk.qcow2").write_bytes(b"d" * 100)
    (d / "manifest.json").write_bytes(b"{}")
    index = Index("sb-1", "base-1", await describe(d, ["manifest.json", "memory", "disk.qcow2"]),
                  {"tenant": "t"})
    plan = plan_upload("/agentbox/", index)
    store = store or MemStore()
    await upload(store, plan, d, backoff=0)
    return store, plan, index


def test_plan_is_content_addressed_and_largest_first():
    files = (ShipFile("a", 1, "0" * 64), ShipFile("b", 9, "1" * 64))
    plan = plan_upload("/agentbox", Index("sb", "base", files))
    assert plan.prefix == f"agentbox/snapshots/sb/{plan.digest[:32]}"
    assert plan.digest == hashlib.sha256(plan.index).hexdigest()
    assert [f.name for f in plan.files] == ["b", "a"]
    assert parse_location(plan.location) == (plan.prefix, plan.digest)
    other = plan_upload("/agentbox", Index("sb", "base", (ShipFile("a", 1, "2" * 64),)))
    assert other.prefix != plan.prefix


@pytest.mark.parametrize("name", ["../x", "a/../b", "a/b/c", "/a", "a/", "", ".hidden",
                                  "a/.x", "x" * 200])
def test_file_names_cannot_escape(name):
    with pytest.raises(ValueError):
        ShipFile(name, 1, "0" * 64)


async def test_index_is_written_last_and_retries_pass(tmp_path):
    store, plan, _ = await shipped(tmp_path, MemStore(fail_puts=2))
    assert store.order[-1] == f"{plan.prefix}/{INDEX}"
    assert store.order[0] == f"{plan.prefix}/memory"  # largest first
    assert len(store.order) == 4


async def test_fetch_round_trip(tmp_path):
    store, plan, index = await shipped(tmp_path)
    assert await fetch(store, plan.location, tmp_path / "out", base="base-1") == index
    assert (tmp_path / "out" / "memory").read_bytes() == b"m" * 5000


async def test_a_corrupted_byte_is_refused_and_nothing_is_left(tmp_path):
    store, plan, _ = await shipped(tmp_path)
    key = f"{plan.prefix}/memory"
    data = bytearray(store.objects[key])
    data[4321] ^= 0x01
    store.objects[key] = bytes(data)
    with pytest.raises(SnapshotRefused, match="memory does not match"):
        await fetch(store, plan.location, tmp_path / "out", base="base-1")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.fetching").exists()


async def test_a_changed_index_is_refused(tmp_path):
    store, plan, _ = await shipped(tmp_path)
    key = f"{plan.prefix}/{INDEX}"
    store.objects[key] = store.objects[key].replace(b"base-1", b"base-2")
    with pytest.raises(SnapshotRefused, match="digest"):
        await fetch(store, plan.location, tmp_path / "out", base="base-2")


async def test_another_base_is_refused(tmp_path):
    store, plan, _ = await shipped(tmp_path)
    with pytest.raises(SnapshotRefused, match="base 'base-1', this host has 'base-9'"):
        await fetch(store, plan.location, tmp_path / "out", base="base-9")


async def test_a_cancelled_upload_never_writes_the_index(tmp_path):
    gate = asyncio.Event()

    class Slow(MemStore):
        async def put_file(self, key, path, sha256):
            await gate.wait()

    store = Slow()
    d = tmp_path / "snap"
    d.mkdir()
    (d / "memory").write_bytes(b"x")
    plan = plan_upload("p", Index("sb", "b", await describe(d, ["memory"])))
    task = asyncio.create_task(upload(store, plan, d))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert f"{plan.prefix}/{INDEX}" not in store.objects


async def test_a_small_file_replaced_while_shipping_is_sent_as_hashed(tmp_path):
    # The background seal rewrites a suspended sandbox's manifest (os.replace) while the
    # shipper works: the bytes sent must be the ones the index hashed.
    d = tmp_path / "snap"
    d.mkdir()
    (d / "manifest.json").write_bytes(b'{"before": 1}')
    (d / "memory").write_bytes(b"m" * (300 << 10))  # over HELD_BYTES: streamed from disk
    held: dict[str, bytes] = {}
    files = await describe(d, ["manifest.json", "memory"], held)
    assert set(held) == {"manifest.json"}
    (d / "manifest.json").write_bytes(b'{"after the seal": 2}')
    store = MemStore()
    plan = plan_upload("p", Index("sb", "b", files))
    location = await upload(store, plan, d, held=held)
    out = tmp_path / "out"
    await fetch(store, location, out, base="b")
    assert (out / "manifest.json").read_bytes() == b'{"before": 1}'
