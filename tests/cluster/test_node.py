"""The daemon's cluster node against real etcd, in a host namespace: joins with its load,
republishes when the load changes, is fenced when its link is cut, leaves at once on close,
and after a crash waits out its old record before joining again."""

from __future__ import annotations

import time

from gateway.cluster.config import ClusterConfig
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.node import ClusterNode, Load
from gateway.cluster.records import HostRecord
from tests.cluster.etcd_env import EtcdCluster

TTL = 2


def test_node_joins_publishes_leaves_and_rejoins_after_a_crash(etcd3: EtcdCluster) -> None:
    member = etcd3.members[0]
    config = ClusterConfig(enabled=True, endpoints=tuple(etcd3.endpoints), host="host-a",
                           advertise=f"{member.ip}:8080", lease_ttl=TTL,
                           key_prefix=f"/{etcd3.prefix}")
    load = [Load(16000, 12000, 8, 8, 0)]
    host_loop, observer = etcd3.loop(member.netns), etcd3.loop()
    reader = EtcdClient(etcd3.endpoints)

    def published() -> HostRecord | None:
        kv = observer.run(reader.get(config.keys.host("host-a")))
        return None if kv is None else HostRecord.decode(kv.value)

    async def start() -> ClusterNode:
        node = ClusterNode(config, lambda: load[0], publish_every=0.1)
        await node.start()
        return node

    node = host_loop.run(start())
    try:
        assert published() == HostRecord("host-a", f"{member.ip}:8080", 16000, 12000, 8, 8, 0)
        assert set(node.routes.table.hosts) == {"host-a"}  # its own route cache sees itself
        load[0] = Load(16000, 9000, 8, 6, 2)
        deadline = time.monotonic() + 3
        while published().awake != 2:
            assert time.monotonic() < deadline, "the new load was never published"
            time.sleep(0.05)
        host_loop.run(node.aclose())
        assert published() is None  # left at once: the lease was revoked
        # A crash: the next incarnation finds its old record alive and waits it out.
        host_loop.run(_crash(host_loop.run(start())))
        t0 = time.monotonic()
        node = host_loop.run(start())
        took = time.monotonic() - t0
        print(f"\n[node] restarted after a crash; joined {took:.2f} s later")
        assert TTL - 1 <= took <= TTL + 4 and published() is not None
        # Cut off: fenced within the TTL.
        etcd3.link(member, up=False)
        deadline = time.monotonic() + TTL + 1
        while node.fenced is None:
            assert time.monotonic() < deadline, "never fenced"
            time.sleep(0.05)
    finally:
        host_loop.run(node.aclose())
        observer.run(reader.aclose())


async def _crash(node: ClusterNode) -> None:
    """What a SIGKILL leaves behind: tasks gone, the lease neither renewed nor revoked."""
    assert node._publisher is not None and node.membership is not None
    node._publisher.cancel()
    await node.routes.aclose()
    await node.membership._keeper.aclose()  # type: ignore[union-attr]
    await node.client.aclose()
