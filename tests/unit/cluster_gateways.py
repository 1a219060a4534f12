"""A small stand-in for a daemon's gateway in a fleet, for the forwarding tests: the real
routing middleware, forwarder and error middlewares in front of a fake sandbox service
(sandboxes this host "runs": an echo over HTTP, a WebSocket echo on /terminal; the real
``GET /v1/sandboxes`` filters over the registry rows it lists)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.cluster.routes import Route
from gateway.errors import Forbidden, SandboxNotFound, Unauthorized
from gateway.http import wire
from gateway.http.sandbox_routes import sandbox_view
from gateway.http import cluster_forward
from gateway.http.middleware import TENANT_KEY, api_error_middleware, error_middleware
from gateway.preview import hosts
from gateway.preview.forward import Forwarder
from gateway.sandbox import listing
from gateway.store.registry import ApiKey, SandboxRecord

PREVIEW_DOMAIN, SESSION_DOMAIN = "preview.test", "session.test"
KEY = "Bearer fleet-key"
ADMIN = "Bearer admin-key"
TENANTS = {KEY: ("k1", False), ADMIN: ("admin", True)}  # Authorization: (key id, admin)


@dataclass
class FakeRoutes:
    table: dict[str, Route] = field(default_factory=dict)

    def route(self, sandbox_id: str) -> Route | None:
        return self.table.get(sandbox_id)

    def addresses(self) -> set[str]:
        return {r.address.rsplit(":", 1)[0] for r in self.table.values() if r.address} | \
            self.fleet

    fleet: set[str] = field(default_factory=set)  # more live hosts' IPs
    hosts: set[str] = field(default_factory=set)  # live hosts that own no route here
    peers: dict[str, str] = field(default_factory=dict)  # live host: its address (listing)

    def live_hosts(self) -> dict[str, str]:
        return dict(self.peers)

    def owners_of(self, tenant: str) -> set[str]:
        return {r.host for r in self.table.values() if r.record.tenant == tenant}

    sessions: dict[str, Any] = field(default_factory=dict)  # name -> SessionRecord
    addresses_of: dict[str, str] = field(default_factory=dict)  # host -> address

    def session(self, name: str) -> Any:
        return self.sessions.get(name)

    def address(self, host: str) -> str | None:
        return self.addresses_of.get(host) or next(
            (r.address for r in self.table.values() if r.host == host and r.address), None)

    def host_live(self, name: str) -> bool:
        return name in self.hosts or any(r.host == name and r.address
                                         for r in self.table.values())


@dataclass
class FakeNode:
    """What the middleware reads of a ClusterNode: its name, fence and route cache."""

    host: str
    routes: Any = field(default_factory=FakeRoutes)
    fenced: str | None = None
    placed: Any = None  # what place_create answers (None: serve here)
    adopting: set[str] = field(default_factory=set)  # moved here, not registered yet
    draining: bool = False
    timeout: float = 5.0  # [cluster] timeout: bounds each host's answer to a fleet list
    lists: list[str] = field(default_factory=list)  # the hop header of each list served
    unknown_keys: set[str] = field(default_factory=set)  # refused here (Authorization)

    def arriving(self, sandbox_id: str) -> bool:
        return sandbox_id in self.adopting

    @property
    def config(self) -> Any:
        return self

    def place_create(self) -> Any:
        from gateway.cluster.routing import ServeHere

        return self.placed or ServeHere()


def build(node: Any, sandboxes: set[str], timeout: float = 5.0,
          listed: list[SandboxRecord] | None = None) -> web.Application:
    """A gateway named ``node.host`` that runs ``sandboxes`` and lists ``listed``."""
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       cluster_forward.cluster_middleware])
    app[hosts.HOSTS_KEY] = hosts.HostRouter(PREVIEW_DOMAIN, SESSION_DOMAIN)
    forwarder = Forwarder(node.config.host, timeout, timeout)
    cluster_forward.attach(app, node, forwarder)

    async def close(_: web.Application) -> None:
        await forwarder.aclose()
    app.on_cleanup.append(close)

    def sandbox_of(request: web.Request) -> str:
        sandbox_id, _ = cluster_forward.sandbox_of(request)
        if request.headers.get("Authorization") != KEY:
            raise Unauthorized("invalid API key", code="invalid_api_key")
        if sandbox_id not in sandboxes:
            raise SandboxNotFound(f"no sandbox {sandbox_id} on {node.config.host}")
        return sandbox_id

    async def terminal(request: web.Request) -> web.StreamResponse:
        sandbox_of(request)
        ws = web.WebSocketResponse(protocols=["agentbox.v1"])
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is web.WSMsgType.TEXT:
                await ws.send_str(f"{node.config.host}:{msg.data}")
            elif msg.type is web.WSMsgType.BINARY:
                await ws.send_bytes(msg.data[::-1])
        return ws

    async def echo(request: web.Request) -> web.StreamResponse:
        sandbox_id = sandbox_of(request)
        resp = web.StreamResponse(headers={
            "X-Served-By": node.config.host, "X-Sandbox": sandbox_id,
            "X-Seen-Host": request.headers.get("Host", ""),
            "X-Seen-Hop": request.headers.get("X-AgentBox-Forwarded", ""),
            "X-Seen-Path": request.path_qs, "X-Seen-Remote": request.remote or ""})
        await resp.prepare(request)
        async for chunk in request.content.iter_any():  # streamed back as it arrives
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def list_sandboxes(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        key = None if auth in node.unknown_keys else TENANTS.get(auth)
        if key is None:
            raise Unauthorized("invalid API key", code="invalid_api_key")
        tenant = request.query.get("tenant", key[0])
        if tenant != key[0] and not key[1]:
            raise Forbidden("only an admin key can list another key's sandboxes")
        node.lists.append(request.headers.get("X-AgentBox-Forwarded", ""))
        request[TENANT_KEY] = ApiKey(key[0], "", key[1], 0.0)  # as auth does
        page, cursor = listing.select([r for r in listed or [] if r.tenant == tenant],
                                      listing.parse_query(request.query))
        return web.Response(body=wire.dumps(wire.SandboxList(
            sandboxes=[sandbox_view(r) for r in page], next_cursor=cursor)),
            content_type="application/json", headers={"X-Listed-By": node.config.host})

    app.router.add_get("/v1/sandboxes", list_sandboxes)
    app.router.add_get("/v1/sandboxes/{id}/terminal", terminal)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app
