"""A small stand-in for a daemon's gateway in a fleet, for the forwarding tests: the real
routing middleware, forwarder and error middlewares in front of a fake sandbox service
(sandboxes this host "runs": an echo over HTTP, a WebSocket echo on /terminal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.cluster.routes import Route
from gateway.errors import SandboxNotFound, Unauthorized
from gateway.http import cluster_forward
from gateway.http.middleware import api_error_middleware, error_middleware
from gateway.preview import hosts
from gateway.preview.forward import Forwarder

PREVIEW_DOMAIN, SESSION_DOMAIN = "preview.test", "session.test"
KEY = "Bearer fleet-key"


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

    def arriving(self, sandbox_id: str) -> bool:
        return sandbox_id in self.adopting

    @property
    def config(self) -> Any:
        return self

    def place_create(self) -> Any:
        from gateway.cluster.routing import ServeHere

        return self.placed or ServeHere()


def build(node: Any, sandboxes: set[str], timeout: float = 5.0) -> web.Application:
    """A gateway named ``node.host`` that runs ``sandboxes``."""
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

    app.router.add_get("/v1/sandboxes/{id}/terminal", terminal)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app
