"""Sandbox tools for agent frameworks.

    from agentbox import Sandbox
    from agentbox.tools import ToolDispatcher, anthropic_tools, openai_tools

    tools = openai_tools()                  # or anthropic_tools()
    dispatch = ToolDispatcher(sandbox)      # AsyncToolDispatcher for an AsyncSandbox
    message = dispatch.openai(tool_call)    # or dispatch.anthropic(tool_use_block)

Tools: run_code, run_command, read_file, write_file, list_files. LangChain:
``agentbox.tools.langchain.langchain_tools(sandbox)`` (extra ``langchain``). CrewAI:
``agentbox.tools.crewai.crewai_tools(sandbox)`` (extra ``crewai``). MCP:
``agentbox mcp`` (extra ``mcp``); the Claude Agent SDK through it:
``agentbox.tools.claude_agent.mcp_servers()`` / ``allowed_tools()``.
"""

from agentbox.tools.dispatch import AsyncToolDispatcher, ToolDispatcher, ToolOutput
from agentbox.tools.specs import (
    TOOL_NAMES,
    TOOL_SPECS,
    anthropic_tools,
    openai_responses_tools,
    openai_tools,
)

__all__ = [
    "TOOL_NAMES", "TOOL_SPECS", "AsyncToolDispatcher", "ToolDispatcher", "ToolOutput",
    "anthropic_tools", "openai_responses_tools", "openai_tools",
]
