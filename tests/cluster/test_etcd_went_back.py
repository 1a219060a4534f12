"""An etcd that lost its data never makes a host destroy what it published (issue 23): a
real 3-member etcd (tests/cluster/etcd_env.py) is wiped under a live cluster node (in a host
namespace, with a real registry; the sandboxes are only rows: no VM is needed to decide).

The node publishes two sandboxes and remembers, in its registry, that etcd held their
records (with the fleet epoch and revision). Every member is then killed, its data dir
removed, and a new cluster started at the same addresses with the same token (so even its
cluster id is the same). The node is fenced (its lease is gone), rejoins, and finds its
published records absent: instead of destroying its copies (what a delete after a move
means) it sees that etcd holds no fleet epoch, publishes both again, writes a new epoch,
marks them under it and logs one error. Without the guard the node discards both
(checked: with ``went_back`` always False this test fails on the discards).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

from gateway.cluster.config import ClusterConfig
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.node import ClusterNode, Load
from gateway.cluster.records import SandboxRecord
from gateway.sandbox.states import State
from gateway.store.registry import Registry
from tests.cluster.etcd_env import EtcdCluster

TTL = 2
LOCAL = [("sbx-wipe-a", State.RUNNING), ("sbx-wipe-b", State.SUSPENDED)]


def test_a_wiped_etcd_makes_the_host_republish_never_discard(
        etcd3: EtcdCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="gateway.cluster.publisher")
    member = etcd3.members[0]
    prefix = f"/{etcd3.prefix}"
    config = ClusterConfig(enabled=True, endpoints=tuple(etcd3.endpoints), host="host-a",
                           advertise=f"{member.ip}:8080", lease_ttl=TTL, key_prefix=prefix)
    host_loop, observer = etcd3.loop(member.netns), etcd3.loop()
    reader = EtcdClient(etcd3.endpoints)
    registry = Registry(tmp_path / "registry.sqlite")
    discarded: list[str] = []

    def record(sandbox_id: str) -> SandboxRecord | None:
        kv = observer.run(reader.get(config.keys.sandbox(sandbox_id)))
        return None if kv is None else SandboxRecord.decode(kv.value)

    def epoch() -> str | None:
        kv = observer.run(reader.get(config.keys.epoch))
        return None if kv is None else kv.value.decode()

    def wait_for(what: str, check: object, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out: {what}"
            time.sleep(0.1)

    async def start() -> ClusterNode:
        node = ClusterNode(config, lambda: Load(16000, 12000, 8, 8, 0), publish_every=0.2)
        node.publisher.landed = lambda sid, mark: registry.mark_published(
            sid, prefix, mark.epoch, mark.revision, mark.term)
        node.publisher.was_published = lambda sid: registry.was_published(sid, prefix)
        node.publisher.discard = discarded.append  # what would destroy the local copy
        await node.start()
        node.publish_local(lambda: list(LOCAL))
        return node

    node = host_loop.run(start())
    try:
        wait_for("both records published", lambda: all(record(s) for s, _ in LOCAL))
        first = epoch()
        assert first
        wait_for("both marked", lambda: all(
            (registry.was_published(s, prefix) or ("",))[0] == first for s, _ in LOCAL))
        marked_at = {s: registry.was_published(s, prefix) for s, _ in LOCAL}

        # Wipe etcd: every member killed, its data gone, a new cluster at the same place.
        began = time.monotonic()
        for m in etcd3.members:
            etcd3.kill(m)
            shutil.rmtree(m.data_dir)
        for m in etcd3.members:
            etcd3.start_member(m, new=True)
        etcd3.wait_leader(30)
        observer.run(reader.aclose())
        reader = EtcdClient(etcd3.endpoints)
        assert record(LOCAL[0][0]) is None and epoch() is None

        wait_for("both republished", lambda: all(
            (r := record(s)) is not None and r.host == "host-a" and r.state is st
            for s, st in LOCAL), 90)
        took = time.monotonic() - began
        print(f"\n[went-back] etcd wiped; the node republished its sandboxes {took:.1f} s "
              f"after the wipe began")
        second = epoch()
        assert second and second != first, "a new fleet epoch was written"
        wait_for("marked anew", lambda: all(
            (registry.was_published(s, prefix) or ("",))[0] == second for s, _ in LOCAL))
        time.sleep(2 * TTL)  # any late discard would have happened by now
        assert discarded == [] and node.publisher.discarded == []
        assert sorted(node.publisher.republished) == sorted(s for s, _ in LOCAL)
        assert all(registry.was_published(s, prefix) != marked_at[s] for s, _ in LOCAL)
        errors = [r for r in caplog.records if r.levelname == "ERROR"
                  and "etcd lost data" in r.getMessage()]
        assert len(errors) == 1, [r.getMessage() for r in errors]
    finally:
        host_loop.run(node.aclose())
        observer.run(reader.aclose())
        registry.close()
