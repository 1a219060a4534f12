"""aiohttp's TestServer, serving through the daemon's front lane (``gateway.preview.fastlane``)."""

from __future__ import annotations

import socket
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from gateway.preview.fastlane import FastSite


class FastTestServer(TestServer):
    """``TestServer(app)`` whose site is a ``FastSite`` (``fast_lane=False``: aiohttp's)."""

    def __init__(self, app: web.Application, fast_lane: bool = True, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.fast_lane = fast_lane
        self.site: FastSite | None = None

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        if self.runner:
            return
        self.runner = await self._make_runner(handler_cancellation=True, **kwargs)
        await self.runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port or 0))
        self.port = sock.getsockname()[1]
        site = FastSite(self.runner, sock) if self.fast_lane else web.SockSite(self.runner, sock)
        self.site = site if isinstance(site, FastSite) else None
        await site.start()
        self.scheme = self.scheme or "http"
        self._root = URL(f"{self.scheme}://{self.host}:{self.port}")

    @property
    def lane(self) -> Any:
        return self.site.lane if self.site is not None else None
