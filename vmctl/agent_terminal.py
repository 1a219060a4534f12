"""Host-side calls to the guest agent's terminal and ports endpoints.

Functions over an :class:`~vmctl.agent_client.AgentClient` (its session and
plumbing, not a second client), one per endpoint of ``guest/protocol.py`` the host uses.
Errors the agent answers with become ``AgentError``; an unreachable agent is
``AgentUnreachable``.
"""

from __future__ import annotations

import aiohttp

from guest.protocol import (
    DEFAULT_COLS,
    DEFAULT_ROWS,
    PortExposure,
    PortInfo,
    validate_port,
    validate_terminal_size,
)
from vmctl.agent_client import AgentClient, AgentError, AgentUnreachable

HEARTBEAT = 30.0  # seconds between pings to the agent on an open terminal
DEFAULT_WS_LIMIT = 16 << 20  # bytes in one message from the guest (never 0 = unbounded)
_CODES = {400: "bad_request", 404: "not_found", 429: "too_many_requests"}


async def open_pty(agent: AgentClient, cols: int = DEFAULT_COLS, rows: int = DEFAULT_ROWS,
                   cmd: str | None = None, max_msg_size: int = DEFAULT_WS_LIMIT
                   ) -> aiohttp.ClientWebSocketResponse:
    """Start a shell (``cmd`` under the shell if given) on a terminal in the guest.

    Binary frames are raw terminal bytes both ways; send ``TerminalResize`` as a
    JSON text frame; the last frame is the JSON ``terminal_exit`` before a close
    with 1000. Closing the socket hangs the shell up. The caller closes it. A guest
    message over ``max_msg_size`` is refused from its frame header (close 1009), never
    buffered whole."""
    cols, rows = validate_terminal_size(cols, rows)
    params = {"cols": str(cols), "rows": str(rows)}
    if cmd:
        params["cmd"] = cmd
    try:
        return await agent._session.ws_connect(
            agent.base + "/pty", params=params, max_msg_size=max_msg_size,
            heartbeat=HEARTBEAT)
    except aiohttp.WSServerHandshakeError as exc:
        # The agent's JSON error body is not kept by aiohttp: its status is.
        code = _CODES.get(exc.status, "agent_error")
        raise AgentError(exc.status if exc.status >= 400 else 502, code,
                         f"guest agent refused the terminal ({exc.status}: {exc.message})"
                         ) from exc
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        raise AgentUnreachable(f"guest agent unreachable: {exc}") from exc


async def expose_port(agent: AgentClient, port: int) -> PortExposure:
    """Make ``port`` reachable at the guest's address: if its listener is bound to
    loopback only, the agent starts a forwarder (idempotent). ``AgentError`` 404
    ``port_not_listening`` if nothing listens on it."""
    data = await agent._json("POST", f"/ports/{validate_port(port)}/expose")
    return PortExposure.from_dict(data)


async def list_ports(agent: AgentClient) -> list[PortInfo]:
    """The TCP ports something listens on in the guest (not the agent's own)."""
    data = await agent._json("GET", "/ports")
    return [PortInfo.from_dict(p) for p in data["ports"]]
