"""``AsyncAgentBox``: a connection to one AgentBox server, used from asyncio.

The key and URL come from the arguments, else ``AGENTBOX_API_KEY`` and
``AGENTBOX_URL`` (default ``http://127.0.0.1:8080``). One client holds one
HTTP connection pool; every sandbox it makes shares it.
"""
# The source of agentbox/client.py (the sync twin), which  # unasync: drop
# sdk/python/gen_sync.py generates from it: edit this file, then run that.  # unasync: drop

from __future__ import annotations

import builtins
from typing import Any

import httpx

from agentbox import _calls, _common
from agentbox._transport import AsyncTransport, ClientConfig
from agentbox.async_builds import AsyncBuilds
from agentbox.async_sandbox import AsyncSandbox
from agentbox.exceptions import NotFoundError, SandboxNotFoundError
from agentbox.models import SandboxInfo, ServerInfo, Template
from agentbox.async_sessions import AsyncSessions

# unasync: add from agentbox.async_client import AsyncAgentBox  # the one import path for both

__all__ = ["AsyncAgentBox"]  # unasync: drop
# unasync: add __all__ = ["AgentBox", "AsyncAgentBox"]


class AsyncAgentBox:
    """The client. ``box.create()`` makes a sandbox (:class:`AsyncSandbox`);
    ``box.sessions`` manages named long-lived sessions."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *,
                 timeout: float | None = None,
                 http_client: httpx.AsyncClient | None = None) -> None:
        self.config = ClientConfig.resolve(api_key, base_url, timeout)
        self._transport = AsyncTransport(self.config, http_client)
        self._server_info: ServerInfo | None = None
        self.sessions = AsyncSessions(self)
        self.builds = AsyncBuilds(self._transport)  # templates from a Dockerfile

    def __repr__(self) -> str:
        return f"<AsyncAgentBox {self.config.base_url}>"

    async def create(self, template: str | None = _common.DEFAULT_TEMPLATE, *,
                     environment: str | None = None, idle_timeout: float | None = None,
                     metadata: dict[str, Any] | None = None, keep: bool = False) -> AsyncSandbox:
        """A new sandbox from ``template`` (alias ``environment``); see
        :meth:`AsyncSandbox.create`."""
        call = _calls.create_sandbox(_common.pick_template(template, environment), idle_timeout,
                                     metadata)
        info = SandboxInfo.from_dict(await self._transport.json(call))
        return AsyncSandbox(self, info, keep=keep)

    async def connect(self, sandbox_id: str) -> AsyncSandbox:
        """An existing sandbox (leaving a ``with`` block does not kill it)."""
        return AsyncSandbox(self, await self.get(sandbox_id), connected=True)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.from_dict(await self._transport.json(_calls.get_sandbox(sandbox_id)))

    async def list(self) -> list[SandboxInfo]:
        """This key's sandboxes."""
        return _sandboxes(await self._transport.json(_calls.list_sandboxes()))

    async def kill(self, sandbox_id: str) -> bool:
        try:
            await self._transport.send(_calls.delete_sandbox(sandbox_id))
        except SandboxNotFoundError:
            return False
        return True

    async def templates(self) -> builtins.list[Template]:
        return _templates(await self._transport.json(_calls.templates()))

    async def server_info(self) -> ServerInfo:
        """``GET /v1/info`` (cached; empty if the server does not have it)."""
        if self._server_info is None:
            try:
                data = await self._transport.json(_calls.server_info())
                self._server_info = ServerInfo.from_dict(data)
            except NotFoundError:
                self._server_info = ServerInfo()
        return self._server_info

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncAgentBox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _sandboxes(data: Any) -> list[SandboxInfo]:
    return [SandboxInfo.from_dict(s) for s in (data or {}).get("sandboxes", [])]


def _templates(data: Any) -> list[Template]:
    return [Template.from_dict(t) for t in (data or {}).get("templates", [])]
