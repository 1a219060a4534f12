# Generated from agentbox/async_sessions.py by sdk/python/gen_sync.py: do not edit.
"""``box.sessions``: named, long-lived sandboxes (``/v1/sessions``).

(``agentbox.sessions`` is generated from ``async_sessions.py`` by sdk/python/gen_sync.py.)

A session's sandbox suspends when idle and wakes on the next request to its URL,
with its processes' memory intact; it lives until the session is deleted.
``put`` is idempotent: it creates the session (running ``start`` once in the new
sandbox) or returns the existing one unchanged. Requests come from ``_calls``;
the session's ``url`` is built from the server's ``session_url_template``.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any

from agentbox import _calls, _common
from agentbox.exceptions import SessionNotFoundError
from agentbox.models import ServerInfo, Session

if TYPE_CHECKING:
    from agentbox.client import AgentBox


def _session_list(data: Any) -> builtins.list[dict[str, Any]]:
    return list((data or {}).get("sessions", []))


def _session(data: Any, client: Any, info: ServerInfo) -> Session:
    view = data if isinstance(data, dict) else {}
    url = _common.session_url(info, client.config.base_url, str(view.get("name", "")),
                              view.get("url"))
    return Session.from_dict(data, client, url)


class Sessions:
    """``box.sessions``: this client's named sessions."""

    def __init__(self, client: AgentBox) -> None:
        self._client = client

    def _parse(self, data: Any) -> Session:
        return _session(data, self._client, self._client.server_info())

    def put(self, name: str, template: str | None = None, *, port: int | None = None,
            idle_timeout: float | None = None, start: str | None = None,
            metadata: dict[str, Any] | None = None) -> Session:
        """The session ``name``: created if it does not exist (from ``template``, serving
        ``port``, default 8000; ``start`` is a shell command run once, in the background,
        in its new sandbox), else returned as it is (the arguments are then ignored)."""
        call = _calls.put_session(name, template, port, idle_timeout, start, metadata)
        return self._parse(self._client._transport.json(call))

    def get(self, name: str) -> Session:
        return self._parse(self._client._transport.json(_calls.get_session(name)))

    def list(self) -> builtins.list[Session]:
        """This key's sessions."""
        data = self._client._transport.json(_calls.list_sessions())
        return [self._parse(s) for s in _session_list(data)]

    def delete(self, name: str) -> bool:
        """Destroy the session's sandbox and free the name; False if there was none."""
        try:
            self._client._transport.send(_calls.delete_session(name))
        except SessionNotFoundError:
            return False
        return True
