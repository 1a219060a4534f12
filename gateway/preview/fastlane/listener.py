"""How the fast lane is installed: on the daemon's listening socket, in front of aiohttp.

``FastSite`` is aiohttp's ``SockSite`` whose connections start in the fast lane (``FastLane``
makes a ``FrontProtocol`` per connection, and aiohttp's protocol is what a connection is handed
to); ``run_app`` is ``web.run_app`` with that site, on a socket from ``bind``. The daemon takes
this path when ``[server] fast_lane`` is on (``gateway.http.app``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner, SockSite

from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.preview.access import ACCESS_KEY
from gateway.preview.fastlane.lane import FastLane
from gateway.preview.hosts import HOSTS_KEY

log = logging.getLogger(__name__)


class FastSite(SockSite):
    """``SockSite`` whose connections start in the fast lane (aiohttp's protocol is the
    fallback). Without a preview router or sandbox service it is a plain ``SockSite``."""

    def __init__(self, runner: BaseRunner, sock: socket.socket, **kwargs: Any) -> None:
        super().__init__(runner, sock, **kwargs)
        self.lane: FastLane | None = None

    async def start(self) -> None:
        await super(SockSite, self).start()  # BaseSite.start: registers the site
        server = self._runner.server
        assert server is not None
        app = getattr(self._runner, "app", None)
        factory: Callable[[], asyncio.Protocol] = server
        if app is not None and HOSTS_KEY in app and SERVICE_KEY in app and ACCESS_KEY in app:
            self.lane = FastLane(app, server)
            factory = self.lane
            log.info("preview fast lane on (gateway.preview.fastlane; [server] fast_lane = false "
                     "turns it off)")
        self._server = await asyncio.get_running_loop().create_server(
            factory, sock=self._sock, ssl=self._ssl_context, backlog=self._backlog)

    async def stop(self) -> None:
        if self.lane is not None:
            log.info("preview fast lane: %d requests served, %d connections handed to aiohttp",
                     self.lane.served, self.lane.handed_off)
            server = self._server
            if server is not None:
                server.close()
            await self.lane.drain(self._runner._shutdown_timeout)
            self.lane.close()
        await super().stop()


def run_app(app: web.Application, sock: socket.socket, loop: asyncio.AbstractEventLoop,
            **runner_options: Any) -> None:
    """``web.run_app(app, sock=sock, loop=loop, print=None, ...)`` with a ``FastSite``."""

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=True, **runner_options)
        await runner.setup()
        try:
            await FastSite(runner, sock).start()
            while True:
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket as ``TCPSite`` makes one (reuse_address)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.setblocking(False)
    return sock
