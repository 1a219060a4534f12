"""Sessions across the fleet against real etcd (docs/cluster.md, "Sessions across the
fleet"): two in-process gateways in two network namespaces, each with the real routing
middleware, forwarder, cluster node, session service (SQLite registry) and fleet names,
in front of a fake sandbox service (a sandbox is an id; "serving" it echoes the host).
Proves: a session made through A is reachable by its session host and path through B; a
name held on A is refused to another tenant on B; two PUTs racing on two hosts for one
name make exactly one sandbox (10 rounds), another tenant's racing PUT gets 409."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from gateway.cluster.config import ClusterConfig
from gateway.cluster.node import ClusterNode, Load
from gateway.cluster.session_names import SessionNames
from gateway.http import cluster_forward
from gateway.http.middleware import api_error_middleware, error_middleware
from gateway.preview import hosts, sessions
from gateway.preview.forward import Forwarder
from gateway.sandbox.states import State
from gateway.store.registry import Registry
from tests.cluster.etcd_env import EtcdCluster, Member

TTL = 2
PORT = 18081
SESSION_DOMAIN = "session.test"
MADE: list[tuple[str, str]] = []  # (host, sandbox id) of every sandbox made, both hosts


class FakeSandboxes:
    """What SessionService uses of the sandbox service; each made sandbox is published
    through the node (its record routes requests to this host)."""

    def __init__(self, host: str, node: ClusterNode) -> None:
        self.host, self.node = host, node
        self.config = SimpleNamespace(server=SimpleNamespace(
            preview_domain="preview.test", session_domain=SESSION_DOMAIN))
        self.live: set[str] = set()
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def create(self, tenant: str, *_: Any) -> Any:
        await asyncio.sleep(0.2)  # a create takes a while: the race's window
        sandbox_id = f"{self.host}-{len(MADE)}-{time.monotonic_ns() % 100000}"
        MADE.append((self.host, sandbox_id))
        self.live.add(sandbox_id)
        self.node.publisher.changed(sandbox_id, State.RUNNING)
        return SimpleNamespace(id=sandbox_id)

    async def destroy(self, tenant: str, sandbox_id: str) -> None:
        self.live.discard(sandbox_id)
        self.node.publisher.changed(sandbox_id, State.DESTROYED)


def _tenant(request: web.Request) -> str:
    return request.headers.get("Authorization", "Bearer anon").removeprefix("Bearer ")


def _build(node: ClusterNode, data: Path) -> tuple[web.Application, FakeSandboxes]:
    host = node.config.host
    fake = FakeSandboxes(host, node)
    registry = Registry(data / f"{host}.sqlite")
    registry.get = lambda sid: (SimpleNamespace(state=State.RUNNING)  # type: ignore
                                if sid in fake.live else None)
    service = sessions.SessionService(fake, registry)  # type: ignore[arg-type]
    service.fleet = SessionNames(node.client, node.keys, host)
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       cluster_forward.cluster_middleware])
    app[hosts.HOSTS_KEY] = hosts.HostRouter("preview.test", SESSION_DOMAIN)
    app[sessions.SESSIONS_KEY] = service
    forwarder = Forwarder(host, 10.0, 10.0)
    cluster_forward.attach(app, node, forwarder)

    async def close(_: web.Application) -> None:
        await forwarder.aclose()
        for task in list(fake.tasks):
            task.cancel()
        registry.close()
    app.on_cleanup.append(close)

    def served(text: str, status: int = 200) -> web.Response:
        return web.json_response({"host": host, "v": text}, status=status,
                                 headers={"X-Served-By": host})

    async def put(request: web.Request) -> web.Response:
        session, created = await service.ensure(_tenant(request), request.match_info["name"],
                                                sessions.SessionSpec())
        return served(session.sandbox_id or "", 201 if created else 200)

    async def proxy(request: web.Request) -> web.Response:
        session = service.get(_tenant(request), request.match_info["name"])
        assert session.sandbox_id in fake.live, "served where its sandbox is not"
        return served(session.sandbox_id or "")

    async def on_host(request: web.Request) -> web.Response:
        found = app[hosts.HOSTS_KEY].classify(request.host)
        if not isinstance(found, hosts.SessionHost):
            raise web.HTTPNotFound()
        session = service.by_name(found.name)
        assert session.sandbox_id in fake.live, "served where its sandbox is not"
        return served(session.sandbox_id or "")

    app.router.add_put("/v1/sessions/{name}", put)
    app.router.add_get("/v1/sessions/{name}/proxy/{path:.*}", proxy)
    app.router.add_get("/{path:.*}", on_host)
    return app, fake


async def _start(etcd3: EtcdCluster, name: str, member: Member, data: Path
                 ) -> tuple[ClusterNode, web.AppRunner]:
    config = ClusterConfig(enabled=True, endpoints=tuple(etcd3.endpoints), host=name,
                           advertise=f"{member.ip}:{PORT}", lease_ttl=TTL, timeout=2.0,
                           key_prefix=f"/{etcd3.prefix}")
    node = ClusterNode(config, lambda: Load(16000, 12000, 8, 8, 0))
    await node.start()
    node.publish_local(lambda: [])
    app, _ = _build(node, data)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, member.ip, PORT).start()
    return node, runner


async def _stop(node: ClusterNode, runner: web.AppRunner) -> None:
    await runner.cleanup()
    await node.aclose()


async def _call(method: str, url: str, tenant: str = "key1", host: str | None = None
                ) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {tenant}"}
    if host:
        headers["Host"] = host
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=headers, json={} if method == "PUT"
                                else None, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            body = await resp.json(content_type=None) if resp.content_type.endswith(
                "json") else {"text": await resp.text()}
            return resp.status, body


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out: {what}"
        time.sleep(0.02)


def test_sessions_are_one_namespace_across_hosts(etcd3: EtcdCluster, tmp_path: Path) -> None:
    m_a, m_b, _ = etcd3.members
    loop_a, loop_b, client = etcd3.loop(m_a.netns), etcd3.loop(m_b.netns), etcd3.loop()
    MADE.clear()
    node_a, runner_a = loop_a.run(_start(etcd3, "host-a", m_a, tmp_path))
    try:
        node_b, runner_b = loop_b.run(_start(etcd3, "host-b", m_b, tmp_path))
        try:
            _wait(lambda: node_a.routes.host_live("host-b") and
                  node_b.routes.host_live("host-a"), 10, "both hosts see each other")
            a, b = f"http://{m_a.ip}:{PORT}", f"http://{m_b.ip}:{PORT}"

            # Made through A (placed on A or B), reachable through both, by path and host.
            status, made = client.run(_call("PUT", f"{a}/v1/sessions/app"))
            assert status == 201, made
            owner, sandbox = made["host"], made["v"]
            _wait(lambda: (r := node_b.routes.session("app")) is not None and
                  r.sandbox_id == sandbox and node_b.routes.route(sandbox) is not None,
                  10, "B's cache has the session and its sandbox")
            for via in (a, b):
                status, got = client.run(_call("GET", f"{via}/v1/sessions/app/proxy/x"))
                assert (status, got["host"], got["v"]) == (200, owner, sandbox), got
                status, got = client.run(_call("GET", f"{via}/index.html",
                                               host=f"app.{SESSION_DOMAIN}"))
                assert (status, got["host"], got["v"]) == (200, owner, sandbox), got
                status, got = client.run(_call("PUT", f"{via}/v1/sessions/app"))
                assert (status, got["v"]) == (200, sandbox), got  # idempotent, same sandbox

            # Another tenant: refused on both hosts; nothing made.
            for via in (a, b):
                status, got = client.run(_call("PUT", f"{via}/v1/sessions/app", "key2"))
                assert status == 409 and got["error"]["code"] == "session_name_taken", got
            assert len(MADE) == 1

            # Races: two PUTs at once through A and B for one name -> one sandbox.
            outcomes: dict[tuple[int, ...], int] = {}
            for i in range(10):
                before = len(MADE)

                async def race(name: str = f"race-{i}") -> list[tuple[int, dict[str, Any]]]:
                    return await asyncio.gather(_call("PUT", f"{a}/v1/sessions/{name}"),
                                                _call("PUT", f"{b}/v1/sessions/{name}"))
                got = client.run(race())
                statuses = tuple(sorted(s for s, _ in got))
                outcomes[statuses] = outcomes.get(statuses, 0) + 1
                assert statuses == (200, 201), got
                assert got[0][1]["v"] == got[1][1]["v"], got  # one session, one sandbox
                assert len(MADE) == before + 1, MADE[before:]
            print(f"\n[sessions] 10 same-tenant races: {outcomes}")
            for i in range(5):
                async def rival(name: str = f"rival-{i}") -> list[tuple[int, dict[str, Any]]]:
                    return await asyncio.gather(_call("PUT", f"{a}/v1/sessions/{name}"),
                                                _call("PUT", f"{b}/v1/sessions/{name}", "key2"))
                got = client.run(rival())
                assert sorted(s for s, _ in got) == [201, 409], got
            assert len(MADE) == 1 + 10 + 5
        finally:
            loop_b.run(_stop(node_b, runner_b))
    finally:
        loop_a.run(_stop(node_a, runner_a))
