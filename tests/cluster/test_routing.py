"""Routing from any host against real etcd: host A's gateway owns a sandbox and publishes
its record; host B's gateway, in another namespace, forwards HTTP and a WebSocket for it
to A through the route cache. A cut off is fenced (host_fenced), B then answers
owner_unavailable; after the link returns A rejoins and B forwards again. Both gateways
are in-process (tests/unit/cluster_gateways.py: the real middleware, forwarder and
cluster node, a fake sandbox service)."""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from gateway.cluster.config import ClusterConfig
from gateway.cluster.node import ClusterNode, Load
from gateway.sandbox.states import State
from tests.cluster.etcd_env import EtcdCluster, Member
from tests.unit.cluster_gateways import KEY, build

TTL = 2
PORT = 18080
AUTH = {"Authorization": KEY}


def _wait(check: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out: {what}"
        time.sleep(0.02)
    return time.monotonic() - start


async def _start(etcd3: EtcdCluster, name: str, member: Member,
                 sandboxes: set[str]) -> tuple[ClusterNode, web.AppRunner]:
    config = ClusterConfig(enabled=True, endpoints=tuple(etcd3.endpoints), host=name,
                           advertise=f"{member.ip}:{PORT}", lease_ttl=TTL, timeout=2.0,
                           key_prefix=f"/{etcd3.prefix}")
    node = ClusterNode(config, lambda: Load(16000, 12000, 8, 8, len(sandboxes)))
    await node.start()
    node.publish_local(lambda: [(s, State.RUNNING) for s in sorted(sandboxes)])
    runner = web.AppRunner(build(node, sandboxes, timeout=5.0))
    await runner.setup()
    await web.TCPSite(runner, member.ip, PORT).start()
    return node, runner


async def _stop(node: ClusterNode, runner: web.AppRunner) -> None:
    await runner.cleanup()
    await node.aclose()


async def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=b"ping" * 1000, headers=AUTH,
                             timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def _ws(url: str) -> list[str]:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, headers=AUTH, timeout=aiohttp.ClientWSTimeout(
                ws_receive=5, ws_close=5)) as ws:
            await ws.send_str("one")
            first = await ws.receive_str()
            await ws.send_str("two")
            return [first, await ws.receive_str()]


def test_a_non_owner_forwards_http_and_websockets_and_follows_a_fence(
        etcd3: EtcdCluster) -> None:
    m_a, m_b, _ = etcd3.members
    loop_a, loop_b, client = etcd3.loop(m_a.netns), etcd3.loop(m_b.netns), etcd3.loop()
    node_a, runner_a = loop_a.run(_start(etcd3, "host-a", m_a, {"sbx1"}))
    try:
        node_b, runner_b = loop_b.run(_start(etcd3, "host-b", m_b, set()))
        try:
            took = _wait(lambda: (r := node_b.routes.route("sbx1")) is not None and r.live,
                         5, "B's cache learns A's record")
            print(f"\n[routing] B's route cache had A's record {took:.3f} s after B joined")
            url_b = f"http://{m_b.ip}:{PORT}/v1/sandboxes/sbx1"
            status, headers, body = client.run(_get(url_b + "/echo"))
            assert (status, headers["X-Served-By"], headers["X-Seen-Hop"]) == \
                (200, "host-a", "host-b") and body == b"ping" * 1000
            assert headers["X-Seen-Host"] == f"{m_b.ip}:{PORT}"
            assert client.run(_ws(f"ws://{m_b.ip}:{PORT}/v1/sandboxes/sbx1/terminal")) == \
                ["host-a:one", "host-a:two"]
            n = 20
            t0 = time.monotonic()
            for _ in range(n):
                assert client.run(_get(url_b + "/echo"))[0] == 200
            via_b = (time.monotonic() - t0) / n
            t0 = time.monotonic()
            for _ in range(n):
                assert client.run(_get(f"http://{m_a.ip}:{PORT}/v1/sandboxes/sbx1/echo"))[0] \
                    == 200
            direct = (time.monotonic() - t0) / n
            print(f"[routing] POST 4 KB: via B {via_b * 1000:.1f} ms, direct to A "
                  f"{direct * 1000:.1f} ms (each a new client session)")

            # A cut off: it fences itself; B sees A's record go and stops forwarding.
            etcd3.link(m_a, up=False)
            fenced = _wait(lambda: node_a.fenced is not None, TTL + 2, "A fences")
            status, _, body = loop_a.run(_get(f"http://{m_a.ip}:{PORT}/v1/sandboxes/sbx1/x"))
            assert status == 503 and b"host_fenced" in body
            dead = _wait(lambda: not node_b.routes.route("sbx1").live, TTL + 5,
                         "B sees A dead")
            status, _, body = client.run(_get(url_b + "/echo"))
            assert status == 503 and b"owner_unavailable" in body
            print(f"[routing] A cut: fenced after {fenced:.2f} s; B saw it dead "
                  f"{dead:.2f} s after that")

            # The link returns: A rejoins with a new lease, B forwards to it again.
            etcd3.link(m_a, up=True)
            back = _wait(lambda: node_a.fenced is None, 4 * TTL + 10, "A rejoins")
            _wait(lambda: node_b.routes.route("sbx1").live, 5, "B sees A again")
            status, headers, _ = client.run(_get(url_b + "/echo"))
            assert (status, headers["X-Served-By"]) == (200, "host-a")
            print(f"[routing] link back: A rejoined after {back:.2f} s and serves again")
        finally:
            loop_b.run(_stop(node_b, runner_b))
    finally:
        loop_a.run(_stop(node_a, runner_a))
