"""Talking to a running sandbox's guest agent: the sandbox layer's surface for the layers
above it (the HTTP routes, the preview proxy and terminal, sessions).

Each call takes the machine a request holds (``SandboxService.use`` / ``use_stream``)
and asks its guest agent, through vmctl's host-side clients (``vmctl.agent_interp``,
``vmctl.agent_terminal``), so nothing above the sandbox layer imports vmctl
(tests/unit/test_walls.py). A machine without a running agent raises as
``require_agent`` does; the agent's own refusals are ``GuestAgentError`` and every
other VM failure a ``VmError`` (gateway.sandbox.vm_errors), which the HTTP middleware
maps to responses.

Calls named ``open_*`` return the agent's open NDJSON (or WebSocket) response: the
caller relays it and must release (close) it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable

import aiohttp

from gateway.sandbox.machine_port import MachinePort
from guest.protocol import (
    DEFAULT_COLS,
    DEFAULT_ROWS,
    CommandRequest,
    ContextInfo,
    CreateContextRequest,
    Execution,
    PortExposure,
    PortInfo,
    ProcessInfo,
    RunCodeRequest,
    SignalRequest,
)
from vmctl import agent_interp, agent_terminal

# -- the code interpreter -------------------------------------------------------------------

async def run_code(machine: MachinePort, req: RunCodeRequest) -> Execution:
    return await agent_interp.run_code(machine.require_agent(), req)


async def open_run_code(machine: MachinePort, req: RunCodeRequest) -> aiohttp.ClientResponse:
    """A streamed run: NDJSON stdout/stderr/result/error events, then ``end``."""
    return await agent_interp.open_run_code(machine.require_agent(), req)


async def create_context(machine: MachinePort, req: CreateContextRequest) -> ContextInfo:
    return await agent_interp.create_context(machine.require_agent(), req)


async def list_contexts(machine: MachinePort) -> list[ContextInfo]:
    return await agent_interp.list_contexts(machine.require_agent())


async def delete_context(machine: MachinePort, name: str) -> None:
    await agent_interp.delete_context(machine.require_agent(), name)


# -- commands -------------------------------------------------------------------------------

async def start_command(machine: MachinePort, req: CommandRequest) -> ProcessInfo:
    """Start a background command (``req.background`` must be true)."""
    return await agent_interp.start_command(machine.require_agent(), req)


async def open_command(machine: MachinePort, req: CommandRequest) -> aiohttp.ClientResponse:
    """Run a foreground command: NDJSON ``start``, its output, ``exit``. Releasing the
    response early kills it."""
    return await agent_interp.open_command(machine.require_agent(), req)


async def list_commands(machine: MachinePort) -> list[ProcessInfo]:
    return await agent_interp.list_commands(machine.require_agent())


async def get_command(machine: MachinePort, pid: int) -> ProcessInfo:
    return await agent_interp.get_command(machine.require_agent(), pid)


async def send_stdin(machine: MachinePort, pid: int, data: bytes | AsyncIterable[bytes],
                     eof: bool = False) -> None:
    await agent_interp.send_stdin(machine.require_agent(), pid, data, eof=eof)


async def signal_command(machine: MachinePort, pid: int, req: SignalRequest) -> None:
    await agent_interp.signal_command(machine.require_agent(), pid, req)


async def wait_command(machine: MachinePort, pid: int, timeout: float) -> ProcessInfo:
    return await agent_interp.wait_command(machine.require_agent(), pid, timeout)


async def open_output(machine: MachinePort, pid: int, offset: int = 0,
                      follow: bool = False) -> aiohttp.ClientResponse:
    """A command's output from ``offset`` (NDJSON); with ``follow``, until its ``exit``."""
    return await agent_interp.open_output(machine.require_agent(), pid, offset, follow)


# -- the terminal and ports -----------------------------------------------------------------

async def open_terminal(machine: MachinePort, cols: int = DEFAULT_COLS, rows: int = DEFAULT_ROWS,
                        cmd: str | None = None,
                        max_msg_size: int = agent_terminal.DEFAULT_WS_LIMIT,
                        ) -> aiohttp.ClientWebSocketResponse:
    """A shell (``cmd`` under it if given) on a terminal in the guest, as a WebSocket:
    binary frames are terminal bytes, text frames JSON control (vmctl.agent_terminal)."""
    return await agent_terminal.open_pty(machine.require_agent(), cols, rows, cmd,
                                         max_msg_size=max_msg_size)


async def expose_port(machine: MachinePort, port: int) -> PortExposure:
    """Make ``port`` reachable at the guest's address (the agent forwards a listener bound
    to loopback only); ``GuestAgentError`` 404 ``port_not_listening`` if none listens."""
    return await agent_terminal.expose_port(machine.require_agent(), port)


async def list_ports(machine: MachinePort) -> list[PortInfo]:
    """The TCP ports something listens on in the guest (GET /v1/sandboxes/{id}/ports)."""
    return await agent_terminal.list_ports(machine.require_agent())
