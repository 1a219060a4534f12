"""The fast lane's shared state: one per listening socket, made once the app has started.

It holds what every connection's front protocol reads (the preview router, the access store,
the sandbox service, the timeouts), the upstream pool, and the set of client connections, and it
owns their deadlines: one timer for all of them (no timer per request), late by at most a tick,
closes a connection whose head did not arrive within ``header_read_timeout`` and fails an
exchange whose app said nothing for ``proxy_read_timeout``. ``drain`` and ``close`` are the
shutdown: idle connections close at once, busy ones after their response, as aiohttp's do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from gateway.http import info
from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.preview.access import ACCESS_KEY
from gateway.preview.fastlane.front import FrontProtocol
from gateway.preview.fastlane.upstream_pool import RawPool
from gateway.preview.hosts import HOSTS_KEY

DRAIN_POLL_S = 0.05


class FastLane:
    """Shared state of the front protocol (one per server, made once the app started)."""

    def __init__(self, app: web.Application, fallback: Callable[[], asyncio.Protocol]) -> None:
        server = app[info.SERVER_KEY]
        self.loop = asyncio.get_running_loop()
        self.hosts = app[HOSTS_KEY]
        self.access = app[ACCESS_KEY]
        self.service = app[SERVICE_KEY]
        self.running = getattr(self.service, "running", None)
        self.fallback = fallback
        self.rewrite_host = server.preview_rewrite_host
        self.public_https = server.public_scheme == "https"
        self.head_timeout = server.header_read_timeout
        self.read_timeout = server.proxy_read_timeout
        self.pool = RawPool(self.loop, server.proxy_connect_timeout, self.running)
        self.clients: set[FrontProtocol] = set()
        self.served = self.handed_off = 0  # counters (tests, debugging)
        self.draining = False  # shutting down: finish what is in flight, start nothing new
        # /metrics: agentbox_events_total{event="fast_lane_served"|"fast_lane_handed_off"}
        metrics = getattr(self.service, "metrics", None)
        self.events = metrics.events if metrics is not None else None
        # One timer for every deadline (no timer per request): late by at most a tick.
        self.tick = min(1.0, self.head_timeout / 4, self.read_timeout / 4)
        self.ticker = self.loop.call_later(self.tick, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        for client in list(self.clients):
            ex = client.exchange
            if ex is None:
                if client.head_deadline <= now:
                    client.close()  # its head did not arrive in time (or it idled too long)
            elif ex.up is not None and now - ex.up.last_read >= self.read_timeout:
                ex.up.timed_out()
        self.ticker = self.loop.call_later(self.tick, self._sweep)

    def __call__(self) -> FrontProtocol:
        return FrontProtocol(self)

    async def drain(self, timeout: float) -> None:
        """Shutting down (the listener is closed): idle connections close now, busy ones
        after their response, as aiohttp's own shutdown does; waits up to ``timeout``."""
        self.draining = True
        deadline = self.loop.time() + timeout
        while True:
            busy = False
            for client in list(self.clients):
                if client.exchange is None:
                    client.close()
                else:
                    busy = True
            if not busy or self.loop.time() >= deadline:
                return
            await asyncio.sleep(DRAIN_POLL_S)

    def close(self) -> None:
        self.ticker.cancel()
        for client in list(self.clients):
            client.close()
        self.pool.close()
