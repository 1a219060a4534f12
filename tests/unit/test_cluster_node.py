"""The daemon's cluster node without etcd: off creates nothing; the load it publishes."""

from __future__ import annotations

import pytest

from gateway.cluster.config import ClusterConfig
from gateway.cluster.node import ClusterNode, load_of, parse_meminfo, start_if_enabled
from gateway.sandbox.states import State

MEMINFO = "MemTotal:       24576000 kB\nMemFree:  1000 kB\nMemAvailable:   8192000 kB\n"


async def test_off_means_nothing_is_created() -> None:
    def never():
        raise AssertionError("the load is not even measured")
    assert await start_if_enabled(ClusterConfig(), never) is None
    with pytest.raises(ValueError, match="enabled"):
        ClusterNode(ClusterConfig(), never)


def test_meminfo() -> None:
    assert parse_meminfo(MEMINFO) == (24000, 8000)
    assert parse_meminfo("garbage\n") == (0, 0)


def test_load_counts_awake_sandboxes_and_their_vcpus() -> None:
    sandboxes = [(State.RUNNING, 2), (State.PAUSED, 1), (State.SUSPENDED, 4),
                 (State.FAILED, 8), (State.RESTORING, 1)]
    load = load_of(MEMINFO, 8, sandboxes)
    assert (load.total_mib, load.free_mib) == (24000, 8000)
    assert load.awake == 3 and load.free_vcpus == 4 and load.total_vcpus == 8
    assert load_of(MEMINFO, 2, sandboxes).free_vcpus == 0  # overcommitted: none free


async def test_the_shipper_exists_only_with_an_object_store() -> None:
    base = dict(enabled=True, endpoints=["http://127.0.0.1:1"], host="h1",
                advertise="127.0.0.1:8080")
    plain = ClusterNode(ClusterConfig(**base), lambda: None)  # type: ignore[arg-type]
    assert plain.shipper is None
    await plain.aclose()
    node = ClusterNode(ClusterConfig(
        **base, objstore_endpoint="http://127.0.0.1:2", objstore_bucket="snaps",
        objstore_access_key="AK", objstore_secret_key="SK"), lambda: None)  # type: ignore[arg-type]
    assert node.shipper is not None and node.shipper.concurrency == 2
    assert await node.shipper.describe_local("sb") is None  # until the app sets it
    await node.aclose()


async def test_a_sync_keeps_records_to_adopt_and_failed_reasons_and_publishes_bases() -> None:
    from gateway.cluster.node import Load
    from gateway.cluster.records import SandboxRecord

    snap = "p/snapshots/s/0#" + "a" * 64
    node = ClusterNode(ClusterConfig(
        enabled=True, endpoints=["http://127.0.0.1:1"], host="h1", advertise="127.0.0.1:8080",
        objstore_endpoint="http://127.0.0.1:2", objstore_bucket="snaps",
        objstore_access_key="AK", objstore_secret_key="SK"),
        lambda: Load(100, 50, 2, 2, 0), bases=lambda: {"c" * 64, "b" * 64})
    assert node.record().bases == ("b" * 64, "c" * 64)
    table = node.routes.table.sandboxes
    table.update({
        "moved": SandboxRecord("moved", "h1", State.SUSPENDED, 2, snap),  # to adopt
        "dead": SandboxRecord("dead", "h1", State.FAILED, 2, reason="host died"),
        "gone": SandboxRecord("gone", "h1", State.SUSPENDED, 1, snap),  # destroyed here
        "mine": SandboxRecord("mine", "h1", State.RUNNING),
        "other": SandboxRecord("other", "h2", State.RUNNING)})
    node.adoptable = lambda sandbox_id: sandbox_id == "moved"
    noted = []
    node.publisher.sync = lambda items: noted.extend(items)
    node.publish_local(lambda: [("mine", State.RUNNING)])
    assert noted == [("mine", State.RUNNING), ("gone", State.DESTROYED)]
    await node.aclose()


async def test_records_naming_this_host_are_remembered_as_published() -> None:
    """What the route cache shows naming this host (at a sync, a listing, a watch event:
    e.g. a record a drain moved here) is remembered, so its later absence means it was
    deleted by the host it moved to; records of other hosts are not."""
    from gateway.cluster import wire
    from gateway.cluster.node import Load
    from gateway.cluster.records import SandboxRecord

    node = ClusterNode(ClusterConfig(
        enabled=True, endpoints=["http://127.0.0.1:1"], host="h1", advertise="127.0.0.1:8080"),
        lambda: Load(100, 50, 2, 2, 0))
    marked: list[str] = []
    table = node.routes.table.sandboxes
    table.update({"mine": SandboxRecord("mine", "h1", State.RUNNING),
                  "other": SandboxRecord("other", "h2", State.RUNNING)})
    node._routes_changed(None)  # the route cache's first listing, before the app wires it
    node.publisher.landed = lambda sandbox_id, mark: marked.append(sandbox_id)
    node.publisher.epoch = "e1"  # learnt from etcd before its first write
    node.publisher.sync = lambda items: None
    node.publish_local(lambda: [("mine", State.RUNNING), ("other", State.RUNNING)])
    assert marked == ["mine"]
    table["drained"] = SandboxRecord("drained", "h1", State.RUNNING, 2)
    key = (node.keys.sandboxes + "drained").encode()
    node._routes_changed((wire.Event(wire.EventType.PUT, wire.KeyValue(key, b"", 0, 0, 0, 0)),))
    table["listed"] = SandboxRecord("listed", "h1", State.SUSPENDED, 3)
    node._routes_changed(None)
    assert marked == ["mine", "drained", "listed"]  # each once
    await node.aclose()
