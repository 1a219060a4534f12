"""An in-process daemon app for the dashboard's tests: the real middlewares, API routes,
event feed and dashboard files, over a SandboxService whose controllers are fakes
(registry transitions only, no VMs; tests.unit.test_tenancy_api)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from gateway.config import Config, ServerConfig
from gateway.http import (control_routes, dashboard, events_routes, info, key_routes,
                          port_routes, sandbox_routes, template_routes)
from gateway.http.middleware import (REGISTRY_KEY, api_error_middleware, auth_middleware,
                                     error_middleware)
from gateway.http.ratelimit import LIMITER_KEY, RateLimiter, key_rate_middleware
from gateway.preview.access import ACCESS_KEY, AccessStore
from gateway.sandbox.states import Event
from gateway.store.registry import Registry, SandboxRecord
from gateway.tenancy.quotas import TenancyConfig
from tests.unit.test_tenancy_api import FakeController, FakeService, fake_host


class SuspendingController(FakeController):
    """Also suspends: SUSPEND, a moment, SUSPENDED (as the real controller records it)."""

    async def wait_op(self) -> None:
        return None

    def start_suspend(self, cause: str) -> asyncio.Future:  # type: ignore[type-arg]
        async def run() -> None:
            self.registry.transition(self.rec.id, Event.SUSPEND, cause)
            await asyncio.sleep(0.05)
            self.rec = self.registry.transition(self.rec.id, Event.SUSPENDED, cause)
        return asyncio.ensure_future(run())


class Service(FakeService):
    def controller(self, rec: SandboxRecord) -> SuspendingController:  # type: ignore[override]
        ctl = self._controllers.get(rec.id)
        if ctl is None:
            ctl = self._controllers[rec.id] = SuspendingController(rec, self.registry)  # type: ignore
        return ctl  # type: ignore[return-value]


def build(tmp_path: Path) -> tuple[web.Application, Registry, str]:
    """The app, its registry and the admin key's secret."""
    config = Config(server=ServerConfig(data_dir=tmp_path), tenancy=TenancyConfig(
        max_sandboxes=50, max_awake=50, max_disk_mib=0, rate=0, address_rate=0))
    registry = Registry(tmp_path / "r.sqlite")
    golden, backend = fake_host(tmp_path)
    service = Service(config, registry, backend, {"python": golden})  # type: ignore[arg-type]
    app = web.Application(middlewares=[error_middleware, api_error_middleware,
                                       auth_middleware, key_rate_middleware])
    app[REGISTRY_KEY] = registry
    app[sandbox_routes.SERVICE_KEY] = service
    app[key_routes.TENANCY_KEY] = config.tenancy
    app[LIMITER_KEY] = RateLimiter(config.tenancy)
    app[ACCESS_KEY] = AccessStore(registry)
    app[info.SERVER_KEY] = config.server
    for routes in (sandbox_routes.routes, template_routes.routes, key_routes.routes,
                   info.routes, control_routes.routes, port_routes.routes):
        app.add_routes(routes)
    feed = events_routes.setup(app)
    registry.listeners.append(feed.publish)
    dashboard.setup(app)
    _, admin = registry.create_key("admin", admin=True)
    return app, registry, admin
