"""Host-side calls to the guest agent's code interpreter and commands.

Functions over an :class:`~vmctl.agent_client.AgentClient` (its request
plumbing, not a second client), one per endpoint in ``guest/protocol.py``.
Errors the agent answers with become ``AgentError`` (its status and code pass
through the gateway unchanged); an unreachable agent is ``AgentUnreachable``.

Streamed endpoints return the open ``aiohttp.ClientResponse`` (NDJSON): the
caller relays or parses it (:func:`iter_events`) and must release it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import aiohttp

from guest.protocol import (
    CommandRequest,
    ContextInfo,
    CreateContextRequest,
    Execution,
    ProcessInfo,
    RunCodeRequest,
    SignalRequest,
    validate_context_name,
)
from vmctl.agent_client import MAX_OUTPUT_REPLY_BYTES, AgentClient, AgentUnreachable
from vmctl.errors import GuestReplyError, GuestReplyTooLarge

# The agent enforces its own timeouts; the HTTP exchange gets this much on top
# (a context's first run also starts its python3 worker).
MARGIN = 75.0
STDIN_TIMEOUT = 120.0


# -- code interpreter --------------------------------------------------------------------

async def create_context(agent: AgentClient, req: CreateContextRequest) -> ContextInfo:
    data = await agent._json("POST", "/contexts", json=req.to_dict(), timeout=MARGIN)
    return ContextInfo.from_dict(data)


async def list_contexts(agent: AgentClient) -> list[ContextInfo]:
    data = await agent._json("GET", "/contexts")
    return [ContextInfo.from_dict(c) for c in data["contexts"]]


async def delete_context(agent: AgentClient, name: str) -> None:
    await agent._json("DELETE", f"/contexts/{validate_context_name(name)}")


async def run_code(agent: AgentClient, req: RunCodeRequest) -> Execution:
    body = {**req.to_dict(), "stream": False}
    data = await agent._json("POST", "/run_code", json=body, timeout=req.timeout + MARGIN,
                             max_bytes=MAX_OUTPUT_REPLY_BYTES)
    return Execution.from_dict(data)


async def open_run_code(agent: AgentClient, req: RunCodeRequest) -> aiohttp.ClientResponse:
    """Start a streamed run: NDJSON stdout/stderr/result/error events, then ``end``."""
    return await _open(agent, "POST", "/run_code", json={**req.to_dict(), "stream": True})


# -- commands --------------------------------------------------------------------------

async def start_command(agent: AgentClient, req: CommandRequest) -> ProcessInfo:
    """Start a background command (``req.background`` must be true)."""
    if not req.background:
        raise ValueError("start_command is for background commands; use open_command")
    return ProcessInfo.from_dict(await agent._json("POST", "/commands", json=req.to_dict()))


async def open_command(agent: AgentClient, req: CommandRequest) -> aiohttp.ClientResponse:
    """Run a foreground command: NDJSON ``start``, its output, ``exit``. Releasing the
    response early kills it."""
    return await _open(agent, "POST", "/commands", json={**req.to_dict(), "background": False})


async def list_commands(agent: AgentClient) -> list[ProcessInfo]:
    data = await agent._json("GET", "/commands")
    return [ProcessInfo.from_dict(c) for c in data["commands"]]


async def get_command(agent: AgentClient, pid: int) -> ProcessInfo:
    return ProcessInfo.from_dict(await agent._json("GET", f"/commands/{int(pid)}"))


async def send_stdin(agent: AgentClient, pid: int, data: bytes | AsyncIterable[bytes],
                     eof: bool = False) -> None:
    params = {"eof": "1"} if eof else {}
    await agent._json("POST", f"/commands/{int(pid)}/stdin", params=params, data=data,
                      timeout=STDIN_TIMEOUT)


async def signal_command(agent: AgentClient, pid: int, req: SignalRequest) -> None:
    await agent._json("POST", f"/commands/{int(pid)}/signal", json=req.to_dict())


async def wait_command(agent: AgentClient, pid: int, timeout: float) -> ProcessInfo:
    data = await agent._json("GET", f"/commands/{int(pid)}/wait",
                             params={"timeout": f"{timeout:g}"}, timeout=timeout + MARGIN)
    return ProcessInfo.from_dict(data)


async def open_output(agent: AgentClient, pid: int, offset: int = 0,
                      follow: bool = False) -> aiohttp.ClientResponse:
    """A command's output from ``offset`` (NDJSON); with ``follow``, until its ``exit``."""
    params = {"offset": str(int(offset)), "follow": "1" if follow else "0"}
    return await _open(agent, "GET", f"/commands/{int(pid)}/output", params=params)


# -- streams ---------------------------------------------------------------------------

async def iter_events(resp: aiohttp.ClientResponse,
                      max_line: int = MAX_OUTPUT_REPLY_BYTES) -> AsyncIterator[dict[str, Any]]:
    """Parse an NDJSON stream from the agent (lines may be large: images, big output, but
    not endless: a line over ``max_line`` bytes is ``GuestReplyTooLarge``)."""
    buf = bytearray()
    try:
        async for chunk in resp.content.iter_any():
            buf += chunk
            *lines, rest = buf.split(b"\n")
            if len(rest) > max_line:
                raise GuestReplyTooLarge(f"guest agent stream line over {max_line} bytes")
            buf = bytearray(rest)
            for line in lines:
                if line.strip():
                    yield _event(line)
    except aiohttp.ClientPayloadError as exc:
        raise AgentUnreachable(f"guest agent stream broke: {exc}") from exc


def _event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise GuestReplyError(f"guest agent stream line is not JSON: {exc}") from exc
    if not isinstance(event, dict):
        raise GuestReplyError("guest agent stream line is not a JSON object")
    return event


async def _open(agent: AgentClient, method: str, path: str,
                **kw: Any) -> aiohttp.ClientResponse:
    resp = await agent._request(method, path, timeout=None, **kw)
    if resp.status >= 400:
        await agent._raise_for(resp)
    return resp
