"""The route cache against real etcd: a create, a move and a dead owner all show up in a
cache on another host, within about a TTL for the death (tests/cluster/etcd_env.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.membership import Membership
from gateway.cluster.ownership import Ownership
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.cluster.routes import RouteCache
from gateway.sandbox.states import State
from tests.cluster.etcd_env import EtcdCluster, Member

TTL = 2


def _wait(check: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError("timed out")
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_cache_on_another_host_follows_create_move_and_death(etcd3: EtcdCluster) -> None:
    keys = Keys(f"/{etcd3.prefix}")
    host_a, host_b, observer = etcd3.members

    async def join(name: str, member: Member) -> tuple[EtcdClient, Membership]:
        client = EtcdClient([member.client_url] + [m.client_url for m in etcd3.members
                                                   if m is not member],
                            timeout=2, attempt_timeout=0.5)
        host = Membership(client, keys, HostRecord(name, f"{member.ip}:8080"), TTL,
                          lambda reason: None)
        await host.join()
        return client, host

    client_a, a = etcd3.loop(host_a.netns).run(join("host-a", host_a))
    client_b, b = etcd3.loop(host_b.netns).run(join("host-b", host_b))

    async def start_cache() -> tuple[EtcdClient, RouteCache]:
        client = EtcdClient([observer.client_url], timeout=2, attempt_timeout=0.5)
        cache = RouteCache(client, keys, probe_after=0.5)
        await cache.start()
        return client, cache

    obs_client, cache = etcd3.loop(observer.netns).run(start_cache())
    try:
        assert set(cache.table.hosts) == {"host-a", "host-b"}
        own_a = Ownership(client_a, keys)
        v1 = etcd3.loop(host_a.netns).run(
            own_a.create(SandboxRecord("sb1", "host-a", State.RUNNING), a.lease))
        seen = _wait(lambda: (r := cache.route("sb1")) is not None and r.live, 2)
        assert cache.route("sb1").address == f"{host_a.ip}:8080"
        etcd3.loop(host_a.netns).run(own_a.move(v1, "host-b", State.RESTORING))
        _wait(lambda: cache.route("sb1").gen == 2, 2)
        assert cache.route("sb1").address == f"{host_b.ip}:8080"
        etcd3.link(host_b, up=False)
        dead = _wait(lambda: not cache.route("sb1").live, TTL + 4)
        print(f"\n[route cache] create in the cache {seen * 1000:.0f} ms after the writer's "
              f"answer; owner's death seen "
              f"{dead:.2f} s after its link went down")
        assert 1.0 <= dead <= TTL + 3.0  # + an election if its member led (test_etcd_cluster)
        assert cache.route("sb1").host == "host-b"  # still its record: re-homing is the reaper's
    finally:
        etcd3.loop(observer.netns).run(_close(cache, obs_client))
        etcd3.loop(host_b.netns).run(_close(b, client_b))
        etcd3.loop(host_a.netns).run(_close(a, client_a))


async def _close(*owners) -> None:
    for owner in owners:
        await owner.aclose()
