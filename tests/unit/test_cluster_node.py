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
