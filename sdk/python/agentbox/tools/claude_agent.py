"""The sandbox tools for the Claude Agent SDK (``claude-agent-sdk``), through the MCP server:
the agent's Claude Code process starts ``agentbox mcp`` over stdio and gets the five tools as
``mcp__agentbox__run_code`` and so on. Plain dicts: this module imports nothing from
``claude_agent_sdk`` (the ``agentbox mcp`` side needs the extra ``mcp``).

    from claude_agent_sdk import ClaudeAgentOptions, query
    from agentbox.tools.claude_agent import allowed_tools, mcp_servers

    options = ClaudeAgentOptions(mcp_servers=mcp_servers(), allowed_tools=allowed_tools())
    async for message in query(prompt="Plot y = x**2 in the sandbox", options=options):
        ...
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from agentbox.tools.specs import TOOL_NAMES

SERVER_NAME = "agentbox"


def mcp_servers(*, api_key: str | None = None, base_url: str | None = None,
                template: str | None = None, sandbox: str | None = None, keep: bool = False,
                name: str = SERVER_NAME, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``ClaudeAgentOptions.mcp_servers``: one stdio server running ``agentbox mcp``.
    ``api_key``/``base_url`` default to ``AGENTBOX_API_KEY``/``AGENTBOX_URL`` here (they are
    passed to the server's environment); ``template``, ``sandbox``, ``keep`` are
    ``agentbox mcp``'s flags."""
    args = ["mcp"]
    if template:
        args += ["--template", template]
    if sandbox:
        args += ["--sandbox", sandbox]
    if keep:
        args.append("--keep")
    server_env = dict(env or {})
    for var, value in (("AGENTBOX_API_KEY", api_key), ("AGENTBOX_URL", base_url)):
        value = value or os.environ.get(var)
        if value:
            server_env[var] = value
    command = shutil.which("agentbox")
    if command is None:  # not on PATH (e.g. a venv not activated): the same interpreter
        command, args = sys.executable, ["-m", "agentbox", *args]
    return {name: {"type": "stdio", "command": command, "args": args, "env": server_env}}


def allowed_tools(names: list[str] | None = None, server: str = SERVER_NAME) -> list[str]:
    """``ClaudeAgentOptions.allowed_tools``: the sandbox tools as Claude Code names them
    (``mcp__<server>__<tool>``), all of them unless ``names``."""
    return [f"mcp__{server}__{n}" for n in TOOL_NAMES if names is None or n in names]
