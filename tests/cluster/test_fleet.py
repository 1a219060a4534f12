"""API keys, placement and quotas across two gateways on real etcd (issue 23).

Host A and host B, each in its own namespace with a real Registry (keys, auth), the real
cluster middleware, forwarder, key ring and fleet quota, in front of a fake sandbox
service (tests/unit/fleet_gateways.py). A publishes much more free RAM than B, so
placement (2 hosts, best-of-2, seeded) chooses A for every create.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.cluster.config import ClusterConfig
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.node import ClusterNode, Load
from gateway.cluster.quota import FleetQuota
from gateway.errors import QuotaExceeded
from gateway.store.registry import Registry
from gateway.tenancy import quotas
from tests.cluster.etcd_env import EtcdCluster, Member
from tests.unit.fleet_gateways import FleetHost

TTL = 2
PORT = 18081


def _wait(check: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out: {what}"
        time.sleep(0.01)
    return time.monotonic() - start


def _config(etcd3: EtcdCluster, name: str, member: Member) -> ClusterConfig:
    return ClusterConfig(enabled=True, endpoints=tuple(etcd3.endpoints), host=name,
                         advertise=f"{member.ip}:{PORT}", lease_ttl=TTL, timeout=2.0,
                         key_prefix=f"/{etcd3.prefix}")


async def _start(etcd3: EtcdCluster, name: str, member: Member, registry: Registry,
                 free_mib: int) -> tuple[FleetHost, web.AppRunner]:
    node = ClusterNode(_config(etcd3, name, member),
                       lambda: Load(16000, free_mib, 8, 8, 0), rng=random.Random(7))
    await node.start()
    host = FleetHost(node, registry)
    node.publish_local(lambda: [])
    await host.start_sharing()
    runner = web.AppRunner(host.app())
    await runner.setup()
    await web.TCPSite(runner, member.ip, PORT).start()
    return host, runner


async def _stop(host: FleetHost, runner: web.AppRunner) -> None:
    await runner.cleanup()
    await host.node.aclose()


async def _call(method: str, url: str, secret: str, **headers: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, json={} if method == "POST" else None,
                                headers={"Authorization": f"Bearer {secret}", **headers},
                                timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return resp.status, await resp.json()


def test_keys_placement_and_quotas_hold_across_hosts(etcd3: EtcdCluster,
                                                     tmp_path: Path) -> None:
    m_a, m_b, _ = etcd3.members
    loop_a, loop_b, client = etcd3.loop(m_a.netns), etcd3.loop(m_b.netns), etcd3.loop()
    reg_a, reg_b = Registry(tmp_path / "a.db"), Registry(tmp_path / "b.db")
    # A key B had before it joined: published at join, so it works on A too.
    _, early = reg_b.create_key("early")
    host_a, runner_a = loop_a.run(_start(etcd3, "host-a", m_a, reg_a, 12000))
    try:
        host_b, runner_b = loop_b.run(_start(etcd3, "host-b", m_b, reg_b, 2000))
        try:
            _wait(lambda: reg_a.lookup_key(early) is not None, 3, "B's early key on A")
            _wait(lambda: len(host_b.node.routes.table.hosts) == 2, 5, "B sees both hosts")

            # Minted on A (max 1 sandbox): authenticates on B.
            key, secret = reg_a.create_key("tenant", limits={"max_sandboxes": 1})
            took = _wait(lambda: reg_b.lookup_key(secret) is not None, 3, "key on B")
            print(f"\n[fleet] a key minted on A authenticates on B after {took * 1000:.0f} ms")
            url_a, url_b = f"http://{m_a.ip}:{PORT}", f"http://{m_b.ip}:{PORT}"
            assert client.run(_call("GET", url_b + "/v1/sandboxes/nope", secret))[0] == 404
            assert client.run(_call("GET", url_b + "/v1/sandboxes/nope", "ab_x"))[0] == 401

            # A create sent to B is placed on A: A has it, B forwards later requests.
            status, body = client.run(_call("POST", url_b + "/v1/sandboxes", secret))
            assert (status, body["host"]) == (201, "host-a"), body
            sandbox_id = body["id"]
            assert host_a.sandboxes == {sandbox_id: key.id} and not host_b.sandboxes
            _wait(lambda: host_b.node.routes.route(sandbox_id) is not None, 3, "B routes it")
            status, body = client.run(_call("GET", f"{url_b}/v1/sandboxes/{sandbox_id}",
                                            secret))
            assert (status, body["host"]) == (200, "host-a")

            # The tenant is at its limit (1, on A): a create B serves itself is refused.
            _wait(lambda: host_a.quota._written.get(key.id) == quotas.Usage(1, 1), 3,
                  "A published the tenant's usage")
            status, body = client.run(_call("POST", url_b + "/v1/sandboxes", secret,
                                            **{"X-AgentBox-Forwarded": "host-a"}))
            assert (status, body["error"]["code"]) == (409, "quota_exceeded"), body
            assert not host_b.sandboxes

            # Revoked on A: refused on B within a second.
            reg_a.revoke_key(key.id)
            took = _wait(lambda: reg_b.lookup_key(secret) is None, 1.0, "revoked on B")
            print(f"[fleet] a key revoked on A is refused on B after {took * 1000:.0f} ms")
            assert client.run(_call("GET", f"{url_b}/v1/sandboxes/{sandbox_id}",
                                    secret))[0] == 401
            assert client.run(_call("GET", f"{url_a}/v1/sandboxes/{sandbox_id}",
                                    secret))[0] == 401
        finally:
            loop_b.run(_stop(host_b, runner_b))
    finally:
        loop_a.run(_stop(host_a, runner_a))
        reg_a.close()
        reg_b.close()


def test_two_hosts_creating_at_once_cannot_both_pass_the_limit(etcd3: EtcdCluster) -> None:
    """The reservation is a transaction: of two concurrent checks for a tenant with room
    for one more, on two hosts or on one, exactly one passes, every time."""
    async def race() -> list[bool]:
        client = EtcdClient(etcd3.endpoints, timeout=2.0)
        keys = Keys(f"/{etcd3.prefix}")
        limits = quotas.Limits(max_sandboxes=1)
        outcomes = []
        try:
            for round_ in range(10):
                tenant = f"key_race{round_}"
                hosts = [FleetQuota(client, keys, name, lambda t: quotas.Usage(),
                                    lambda: set()) for name in ("host-a", "host-b")]
                if round_ % 2:  # two creates in flight on one host: its record counts
                    hosts = [hosts[0], hosts[0]]
                results = await asyncio.gather(
                    *(q.check(tenant, limits, quotas.Usage()) for q in hosts),
                    return_exceptions=True)
                assert all(r is None or isinstance(r, QuotaExceeded) for r in results), results
                outcomes.append(sum(r is None for r in results) == 1)
        finally:
            await client.aclose()
        return outcomes

    assert etcd3.loop().run(race()) == [True] * 10


def test_the_daemon_wiring_shares_keys_and_checks_quotas(etcd3: EtcdCluster,
                                                         tmp_path: Path) -> None:
    """app._share_keys_and_quotas as the daemon calls it: the ring publishes the host's
    keys and the service's create hook counts the fleet."""
    from types import SimpleNamespace

    from gateway.http.app import _share_keys_and_quotas

    registry = Registry(tmp_path / "r.db")
    key, _ = registry.create_key("t", limits={"max_sandboxes": 1})
    m_a = etcd3.members[0]

    async def run() -> None:
        node = ClusterNode(_config(etcd3, "host-a", m_a), lambda: Load(16000, 8000, 8, 8, 0))
        await node.start()
        service = SimpleNamespace(registry=registry, fleet_quota=None)
        stale = node.keys.usage("key_gone", "host-a")  # from before a crash: none here now
        await node.client.put(stale, b'{"sandboxes": 2, "awake": 0}')
        try:
            await _share_keys_and_quotas(service, node)  # type: ignore[arg-type]
            got = None
            for _ in range(100):
                got = await node.client.get(node.keys.api_key(key.id))
                if got is not None:
                    break
                await asyncio.sleep(0.02)
            assert got is not None and b"ab_" not in got.value
            for _ in range(100):
                if await node.client.get(stale) is None:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("this host's stale usage record was not removed")
            other = node.keys.usage(key.id, "host-z")
            await node.client.put(other, b'{"sandboxes": 1, "awake": 1}')
            limits = quotas.Limits(max_sandboxes=1)
            try:
                await service.fleet_quota(key.id, limits, quotas.Usage())
            except QuotaExceeded:
                pass
            else:
                raise AssertionError("host-z's sandbox was not counted")
        finally:
            await node.aclose()

    etcd3.loop(m_a.netns).run(run())
    registry.close()
