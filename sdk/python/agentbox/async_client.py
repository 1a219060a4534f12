"""``AsyncAgentBox``: a connection to one AgentBox server, used from asyncio.

The key and URL come from the arguments, else ``AGENTBOX_API_KEY`` and
``AGENTBOX_URL`` (default ``http://127.0.0.1:8080``). One client holds one
HTTP connection pool; every sandbox it makes shares it.
"""
# The source of agentbox/client.py (the sync twin), which  # unasync: drop
# sdk/python/gen_sync.py generates from it: edit this file, then run that.  # unasync: drop

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from agentbox import _calls, _common
from agentbox._transport import AsyncTransport, ClientConfig
from agentbox.async_builds import AsyncBuilds
from agentbox.async_sandbox import AsyncSandbox
from agentbox.exceptions import NotFoundError, SandboxNotFoundError
from agentbox.async_sessions import AsyncSessions
from agentbox.models import SandboxInfo, SandboxPage, ServerInfo, Template, Usage

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
        self.templates = AsyncTemplates(self._transport)
        self.builds = AsyncBuilds(self._transport)  # templates from a Dockerfile (logs, get)

    def __repr__(self) -> str:
        return f"<AsyncAgentBox {self.config.base_url}>"

    async def create(self, template: str | None = _common.DEFAULT_TEMPLATE, *,
                     environment: str | None = None, idle_timeout: float | None = None,
                     metadata: dict[str, Any] | None = None, keep: bool = False,
                     ttl: float | None = None,
                     auto_delete_after: float | None = None,
                     egress: str | dict[str, Any] | None = None,
                     vcpus: int | None = None, memory_mib: int | None = None,
                     disk_mib: int | None = None) -> AsyncSandbox:
        """A new sandbox from ``template`` (alias ``environment``); see
        :meth:`AsyncSandbox.create`. ``ttl``: destroyed that many seconds after create;
        ``auto_delete_after``: destroyed after that many seconds suspended (0 = never;
        default: the server's)."""
        call = _calls.create_sandbox(_common.pick_template(template, environment), idle_timeout,
                                     metadata, ttl, auto_delete_after, egress, vcpus=vcpus,
                                     memory_mib=memory_mib, disk_mib=disk_mib)
        info = SandboxInfo.from_dict(await self._transport.json(call))
        return AsyncSandbox(self, info, keep=keep)

    async def connect(self, sandbox_id: str) -> AsyncSandbox:
        """An existing sandbox (leaving a ``with`` block does not kill it)."""
        return AsyncSandbox(self, await self.get(sandbox_id), connected=True)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.from_dict(await self._transport.json(_calls.get_sandbox(sandbox_id)))

    async def list(self, *, state: str | builtins.list[str] | None = None,
                   template: str | None = None, metadata: dict[str, Any] | None = None,
                   limit: int | None = None) -> builtins.list[SandboxInfo]:
        """This key's sandboxes, oldest first, that match every filter given (``state``:
        one or a list; ``metadata``: values they must have). All of them (every page), or
        at most ``limit``."""
        out: builtins.list[SandboxInfo] = []
        pages = self.iter_sandboxes(state=state, template=template, metadata=metadata,
                                    page_size=min(limit or 100, 1000))
        async with contextlib.aclosing(pages):
            async for info in pages:
                if limit is not None and len(out) >= limit:
                    break
                out.append(info)
        return out

    async def list_page(self, *, state: str | builtins.list[str] | None = None,
                        template: str | None = None, metadata: dict[str, Any] | None = None,
                        limit: int | None = None, cursor: str | None = None) -> SandboxPage:
        """One page of :meth:`list` (pass its ``next_cursor`` back for the next one)."""
        call = _calls.list_sandboxes(state, template, metadata, limit, cursor)
        return SandboxPage.from_dict(await self._transport.json(call))

    async def iter_sandboxes(self, *, state: str | builtins.list[str] | None = None,
                             template: str | None = None,
                             metadata: dict[str, Any] | None = None,
                             page_size: int = 100) -> AsyncIterator[SandboxInfo]:
        """Every matching sandbox, fetched a page at a time."""
        cursor: str | None = None
        while True:
            page = await self.list_page(
                state=state, template=template, metadata=metadata, limit=page_size,
                cursor=cursor)
            for info in page.sandboxes:  # noqa: RUF100, UP028 (async: no yield from)
                yield info
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def usage(self, start: float | None = None, end: float | None = None, *,
                    key: str | None = None) -> Usage:
        """Metered use in [start, end) (Unix times; default: all time up to now) of this
        key, or with an admin key of ``key`` (an id, or ``"*"`` for every key)."""
        return Usage.from_dict(await self._transport.json(_calls.usage(start, end, key)))

    async def kill(self, sandbox_id: str) -> bool:
        try:
            await self._transport.send(_calls.delete_sandbox(sandbox_id))
        except SandboxNotFoundError:
            return False
        return True

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


class AsyncTemplates:
    """``box.templates``: the built-in templates and this key's own (made with
    ``sandbox.snapshot(name)`` or from a Dockerfile with ``build``). ``await
    box.templates()`` is ``list()``."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport
        self.build = AsyncBuilds(transport).build  # see AsyncBuilds.build

    async def list(self) -> builtins.list[Template]:
        return [Template.from_dict(t)
                for t in (await self._t.json(_calls.templates()) or {}).get("templates", [])]

    __call__ = list

    async def get(self, name: str) -> Template:
        return Template.from_dict(await self._t.json(_calls.get_template(name)))

    async def delete(self, name: str) -> None:
        """Delete one of the key's templates; sandboxes made from it keep working (its
        files go when the last of them does)."""
        await self._t.send(_calls.delete_template(name))
