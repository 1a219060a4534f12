"""A stand-in for a daemon in a fleet with real API keys and quotas, for the keys/placement/
quota tests: a real Registry (keys, auth), the real cluster middleware, forwarder, key
ring and fleet quota, in front of a fake sandbox service (a create adds an id to a dict
and publishes its record; a get answers which host has it)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.cluster.keyring import KeyRing
from gateway.cluster.quota import FleetQuota
from gateway.errors import SandboxNotFound
from gateway.http import cluster_forward
from gateway.http.middleware import (REGISTRY_KEY, TENANT_KEY, api_error_middleware,
                                     auth_middleware, error_middleware)
from gateway.preview import hosts
from gateway.preview.forward import Forwarder
from gateway.sandbox.states import State
from gateway.store.feed import Transition
from gateway.store.registry import Registry
from gateway.tenancy import quotas

_ids = itertools.count(1)


@dataclass
class FleetHost:
    node: Any  # ClusterNode
    registry: Registry
    sandboxes: dict[str, str] = field(default_factory=dict)  # id -> tenant
    ring: KeyRing | None = None
    quota: FleetQuota | None = None

    def usage(self, tenant: str) -> quotas.Usage:
        return quotas.usage_of(State.RUNNING for t in self.sandboxes.values() if t == tenant)

    async def start_sharing(self) -> None:
        """What app._share_keys_and_quotas does, with this host's fake sandboxes."""
        node = self.node
        self.ring = KeyRing(node.client, node.keys, self.registry, scan_every=1.0)
        self.registry.key_listeners.append(self.ring.changed)
        node.parts.append(self.ring.aclose)
        await self.ring.start()
        self.quota = FleetQuota(node.client, node.keys, node.config.host, self.usage,
                                lambda: set(self.sandboxes.values()), scan_every=1.0)
        node.parts.append(self.quota.aclose)
        self.quota.start()

    async def create(self, request: web.Request) -> web.Response:
        key = request[TENANT_KEY]
        limits = quotas.Limits().merged(key.limits)
        assert self.quota is not None
        await self.quota.check(key.id, limits, self.usage(key.id))
        sandbox_id = f"sbx{next(_ids)}{self.node.config.host[-1]}"
        self.sandboxes[sandbox_id] = key.id
        self.node.publisher.changed(sandbox_id, State.RUNNING)
        self.quota.heard(Transition(0, sandbox_id, key.id, None, "running", "create", "",
                                    time.time()))
        return web.json_response({"id": sandbox_id, "host": self.node.config.host},
                                 status=201)

    async def get(self, request: web.Request) -> web.Response:
        sandbox_id = request.match_info["id"]
        if self.sandboxes.get(sandbox_id) != request[TENANT_KEY].id:
            raise SandboxNotFound(sandbox_id)
        return web.json_response({"id": sandbox_id, "host": self.node.config.host})

    def app(self, timeout: float = 5.0) -> web.Application:
        app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                           cluster_forward.cluster_middleware,
                                           auth_middleware])
        app[hosts.HOSTS_KEY] = hosts.HostRouter("preview.test", "session.test")
        app[REGISTRY_KEY] = self.registry
        forwarder = Forwarder(self.node.config.host, timeout, timeout)
        cluster_forward.attach(app, self.node, forwarder)

        async def close(_: web.Application) -> None:
            await forwarder.aclose()
        app.on_cleanup.append(close)
        app.router.add_post("/v1/sandboxes", self.create)
        app.router.add_get("/v1/sandboxes/{id}", self.get)
        return app
