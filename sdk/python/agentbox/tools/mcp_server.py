"""``agentbox mcp``: the sandbox tools served over MCP (stdio), built on the
official ``mcp`` package (extra ``mcp``: ``pip install 'agentbox[mcp]'``).

One server process serves one MCP session (stdio). Its sandbox is created on
the first tool call, not at start (a client that only lists tools costs
nothing), and deleted when the session ends unless ``--keep`` or ``--sandbox
ID`` (an existing sandbox, never deleted) was given. Works with mcp 2.x
(``MCPServer``) and 1.x (``FastMCP``).

No ``from __future__ import annotations`` here: the tool functions' annotations
(``Annotated[..., Field(...)]``) must be real objects for mcp to read them.
"""

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from agentbox.async_sandbox import AsyncSandbox
from agentbox.client import AsyncAgentBox
from agentbox.tools.dispatch import AsyncToolDispatcher, ToolOutput
from agentbox.tools.specs import TOOL_SPECS

INSTRUCTIONS = ("Tools that run code and commands in an isolated AgentBox sandbox (a "
                "microVM). State (variables, files, installed packages) persists for the "
                "whole session.")


def _mcp() -> tuple[Any, Any, Any]:
    """(server class, Image, ToolError) of whichever mcp major version is installed."""
    try:
        from mcp.server.mcpserver import Image, MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
        return MCPServer, Image, ToolError
    except ImportError:
        pass
    try:
        from mcp.server.fastmcp import FastMCP, Image  # type: ignore[attr-defined,no-redef]
        from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError("the MCP server needs the mcp package: "
                          "pip install 'agentbox[mcp]'") from exc
    return FastMCP, Image, ToolError


class SessionSandbox:
    """The session's sandbox: made on first use (once, even under concurrent calls)."""

    def __init__(self, api_key: str | None = None, base_url: str | None = None,
                 template: str = "python", sandbox_id: str | None = None,
                 keep: bool = False) -> None:
        self.client = AsyncAgentBox(api_key=api_key, base_url=base_url)
        self.template, self.sandbox_id, self.keep = template, sandbox_id, keep
        self.sandbox: AsyncSandbox | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> AsyncSandbox:
        async with self._lock:
            if self.sandbox is None:
                if self.sandbox_id:
                    self.sandbox = await self.client.connect(self.sandbox_id)
                else:
                    self.sandbox = await self.client.create(self.template, keep=self.keep)
            return self.sandbox

    async def aclose(self) -> None:
        try:
            if self.sandbox is not None and not self.sandbox_id and not self.keep:
                await self.sandbox.kill()
        finally:
            await self.client.aclose()


def _description(name: str) -> str:
    return next(s["description"] for s in TOOL_SPECS if s["name"] == name)


def _param(name: str, prop: str) -> str:
    spec = next(s for s in TOOL_SPECS if s["name"] == name)
    return str(spec["parameters"]["properties"][prop]["description"])


def build_server(session: SessionSandbox) -> Any:
    """The MCP server object exposing the tools over ``session``'s sandbox."""
    from pydantic import Field  # a dependency of mcp

    server_cls, image_cls, tool_error = _mcp()

    @contextlib.asynccontextmanager
    async def lifespan(_server: Any) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {}
        finally:
            import anyio  # mcp's own dependency; shield the cleanup from cancellation

            with anyio.CancelScope(shield=True):
                await session.aclose()

    server = server_cls("agentbox", instructions=INSTRUCTIONS, lifespan=lifespan)

    async def call(name: str, args: dict[str, Any]) -> list[Any]:
        out = await AsyncToolDispatcher(await session.get()).call(name, args)
        return _content(out, image_cls, tool_error)

    async def run_code(code: Annotated[str, Field(description=_param("run_code", "code"))]
                       ) -> list[Any]:
        return await call("run_code", {"code": code})

    async def run_command(
            command: Annotated[str, Field(description=_param("run_command", "command"))],
            cwd: Annotated[str | None, Field(description=_param("run_command", "cwd"))] = None,
            timeout: Annotated[float | None,
                               Field(description=_param("run_command", "timeout"))] = None,
    ) -> list[Any]:
        return await call("run_command", {"command": command, "cwd": cwd, "timeout": timeout})

    async def read_file(path: Annotated[str, Field(description=_param("read_file", "path"))]
                        ) -> list[Any]:
        return await call("read_file", {"path": path})

    async def write_file(
            path: Annotated[str, Field(description=_param("write_file", "path"))],
            content: Annotated[str, Field(description=_param("write_file", "content"))],
    ) -> list[Any]:
        return await call("write_file", {"path": path, "content": content})

    async def list_files(
            path: Annotated[str, Field(description=_param("list_files", "path"))] = "/root",
    ) -> list[Any]:
        return await call("list_files", {"path": path})

    for fn in (run_code, run_command, read_file, write_file, list_files):
        _add_tool(server, fn, fn.__name__, _description(fn.__name__))
    return server


def _add_tool(server: Any, fn: Any, name: str, description: str) -> None:
    try:
        server.add_tool(fn, name=name, description=description, structured_output=False)
    except TypeError:  # mcp 1.x before structured output
        server.add_tool(fn, name=name, description=description)


def _content(out: ToolOutput, image_cls: Any, tool_error: Any) -> list[Any]:
    if out.is_error:
        raise tool_error(out.text)
    images = [image_cls(data=base64.b64decode(b64), format=mime.split("/", 1)[1])
              for mime, b64 in out.images]
    return [out.text, *images]


def serve(api_key: str | None = None, base_url: str | None = None, template: str = "python",
          sandbox_id: str | None = None, keep: bool = False) -> None:
    """Run the MCP server on stdin/stdout until the client closes it."""
    _mcp()  # a missing extra is said first
    session = SessionSandbox(api_key, base_url, template, sandbox_id, keep)
    build_server(session).run("stdio")
