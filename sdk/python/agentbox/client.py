# Generated from agentbox/async_client.py by sdk/python/gen_sync.py: do not edit.
"""``AgentBox``: a connection to one AgentBox server, used synchronously.

The key and URL come from the arguments, else ``AGENTBOX_API_KEY`` and
``AGENTBOX_URL`` (default ``http://127.0.0.1:8080``). One client holds one
HTTP connection pool; every sandbox it makes shares it.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from agentbox import _calls, _common
from agentbox._transport import SyncTransport, ClientConfig
from agentbox.builds import Builds
from agentbox.sandbox import Sandbox
from agentbox.exceptions import NotFoundError, SandboxNotFoundError
from agentbox.sessions import Sessions
from agentbox.models import SandboxInfo, SandboxPage, ServerInfo, Template, Usage

from agentbox.async_client import AsyncAgentBox  # the one import path for both

__all__ = ["AgentBox", "AsyncAgentBox"]


class AgentBox:
    """The client. ``box.create()`` makes a sandbox (:class:`Sandbox`);
    ``box.sessions`` manages named long-lived sessions."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *,
                 timeout: float | None = None,
                 http_client: httpx.Client | None = None) -> None:
        self.config = ClientConfig.resolve(api_key, base_url, timeout)
        self._transport = SyncTransport(self.config, http_client)
        self._server_info: ServerInfo | None = None
        self.sessions = Sessions(self)
        self.templates = Templates(self._transport)
        self.builds = Builds(self._transport)  # templates from a Dockerfile (logs, get)

    def __repr__(self) -> str:
        return f"<AgentBox {self.config.base_url}>"

    def create(self, template: str | None = _common.DEFAULT_TEMPLATE, *,
               environment: str | None = None, idle_timeout: float | None = None,
               metadata: dict[str, Any] | None = None, keep: bool = False,
               ttl: float | None = None,
               auto_delete_after: float | None = None,
               egress: str | dict[str, Any] | None = None,
               vcpus: int | None = None, memory_mib: int | None = None,
               disk_mib: int | None = None) -> Sandbox:
        """A new sandbox from ``template`` (alias ``environment``); see
        :meth:`Sandbox.create`. ``ttl``: destroyed that many seconds after create;
        ``auto_delete_after``: destroyed after that many seconds suspended (0 = never;
        default: the server's)."""
        call = _calls.create_sandbox(_common.pick_template(template, environment), idle_timeout,
                                     metadata, ttl, auto_delete_after, egress, vcpus=vcpus,
                                     memory_mib=memory_mib, disk_mib=disk_mib)
        info = SandboxInfo.from_dict(self._transport.json(call))
        return Sandbox(self, info, keep=keep)

    def connect(self, sandbox_id: str) -> Sandbox:
        """An existing sandbox (leaving a ``with`` block does not kill it)."""
        return Sandbox(self, self.get(sandbox_id), connected=True)

    def get(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.from_dict(self._transport.json(_calls.get_sandbox(sandbox_id)))

    def list(self, *, state: str | builtins.list[str] | None = None,
             template: str | None = None, metadata: dict[str, Any] | None = None,
             limit: int | None = None) -> builtins.list[SandboxInfo]:
        """This key's sandboxes, oldest first, that match every filter given (``state``:
        one or a list; ``metadata``: values they must have). All of them (every page), or
        at most ``limit``."""
        out: builtins.list[SandboxInfo] = []
        pages = self.iter_sandboxes(state=state, template=template, metadata=metadata,
                                    page_size=min(limit or 100, 1000))
        with contextlib.closing(pages):
            for info in pages:
                if limit is not None and len(out) >= limit:
                    break
                out.append(info)
        return out

    def list_page(self, *, state: str | builtins.list[str] | None = None,
                  template: str | None = None, metadata: dict[str, Any] | None = None,
                  limit: int | None = None, cursor: str | None = None) -> SandboxPage:
        """One page of :meth:`list` (pass its ``next_cursor`` back for the next one)."""
        call = _calls.list_sandboxes(state, template, metadata, limit, cursor)
        return SandboxPage.from_dict(self._transport.json(call))

    def iter_sandboxes(self, *, state: str | builtins.list[str] | None = None,
                       template: str | None = None,
                       metadata: dict[str, Any] | None = None,
                       page_size: int = 100) -> Iterator[SandboxInfo]:
        """Every matching sandbox, fetched a page at a time."""
        cursor: str | None = None
        while True:
            page = self.list_page(
                state=state, template=template, metadata=metadata, limit=page_size,
                cursor=cursor)
            for info in page.sandboxes:  # noqa: RUF100, UP028 (async: no yield from)
                yield info
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def usage(self, start: float | None = None, end: float | None = None, *,
              key: str | None = None) -> Usage:
        """Metered use in [start, end) (Unix times; default: all time up to now) of this
        key, or with an admin key of ``key`` (an id, or ``"*"`` for every key)."""
        return Usage.from_dict(self._transport.json(_calls.usage(start, end, key)))

    def kill(self, sandbox_id: str) -> bool:
        try:
            self._transport.send(_calls.delete_sandbox(sandbox_id))
        except SandboxNotFoundError:
            return False
        return True

    def server_info(self) -> ServerInfo:
        """``GET /v1/info`` (cached; empty if the server does not have it)."""
        if self._server_info is None:
            try:
                data = self._transport.json(_calls.server_info())
                self._server_info = ServerInfo.from_dict(data)
            except NotFoundError:
                self._server_info = ServerInfo()
        return self._server_info

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> AgentBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sandboxes(data: Any) -> list[SandboxInfo]:
    return [SandboxInfo.from_dict(s) for s in (data or {}).get("sandboxes", [])]


class Templates:
    """``box.templates``: the built-in templates and this key's own (made with
    ``sandbox.snapshot(name)`` or from a Dockerfile with ``build``). ``await
    box.templates()`` is ``list()``."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport
        self.build = Builds(transport).build  # see Builds.build

    def list(self) -> builtins.list[Template]:
        return [Template.from_dict(t)
                for t in (self._t.json(_calls.templates()) or {}).get("templates", [])]

    __call__ = list

    def get(self, name: str) -> Template:
        return Template.from_dict(self._t.json(_calls.get_template(name)))

    def delete(self, name: str) -> None:
        """Delete one of the key's templates; sandboxes made from it keep working (its
        files go when the last of them does)."""
        self._t.send(_calls.delete_template(name))
