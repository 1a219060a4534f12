# Generated from agentbox/async_client.py by sdk/python/gen_sync.py: do not edit.
"""``AgentBox``: a connection to one AgentBox server, used synchronously.

The key and URL come from the arguments, else ``AGENTBOX_API_KEY`` and
``AGENTBOX_URL`` (default ``http://127.0.0.1:8080``). One client holds one
HTTP connection pool; every sandbox it makes shares it.
"""

from __future__ import annotations

import builtins
from typing import Any

import httpx

from agentbox import _calls, _common
from agentbox._transport import SyncTransport, ClientConfig
from agentbox.builds import Builds
from agentbox.sandbox import Sandbox
from agentbox.exceptions import NotFoundError, SandboxNotFoundError
from agentbox.models import SandboxInfo, ServerInfo, Template
from agentbox.sessions import Sessions

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
        self.builds = Builds(self._transport)  # templates from a Dockerfile

    def __repr__(self) -> str:
        return f"<AgentBox {self.config.base_url}>"

    def create(self, template: str | None = _common.DEFAULT_TEMPLATE, *,
               environment: str | None = None, idle_timeout: float | None = None,
               metadata: dict[str, Any] | None = None, keep: bool = False) -> Sandbox:
        """A new sandbox from ``template`` (alias ``environment``); see
        :meth:`Sandbox.create`."""
        call = _calls.create_sandbox(_common.pick_template(template, environment), idle_timeout,
                                     metadata)
        info = SandboxInfo.from_dict(self._transport.json(call))
        return Sandbox(self, info, keep=keep)

    def connect(self, sandbox_id: str) -> Sandbox:
        """An existing sandbox (leaving a ``with`` block does not kill it)."""
        return Sandbox(self, self.get(sandbox_id), connected=True)

    def get(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.from_dict(self._transport.json(_calls.get_sandbox(sandbox_id)))

    def list(self) -> list[SandboxInfo]:
        """This key's sandboxes."""
        return _sandboxes(self._transport.json(_calls.list_sandboxes()))

    def kill(self, sandbox_id: str) -> bool:
        try:
            self._transport.send(_calls.delete_sandbox(sandbox_id))
        except SandboxNotFoundError:
            return False
        return True

    def templates(self) -> builtins.list[Template]:
        return _templates(self._transport.json(_calls.templates()))

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


def _templates(data: Any) -> list[Template]:
    return [Template.from_dict(t) for t in (data or {}).get("templates", [])]
