"""The sandbox tools as LangChain ``StructuredTool`` s (extra ``langchain``:
``pip install 'agentbox[langchain]'``). ``langchain_core`` is imported only
when these are built, so the rest of the SDK never needs it.

    from agentbox.tools.langchain import langchain_tools
    agent = create_agent(model, tools=langchain_tools(sandbox))
"""

from __future__ import annotations

from typing import Any

from agentbox.tools.dispatch import AsyncToolDispatcher, ToolDispatcher
from agentbox.tools.specs import TOOL_SPECS


def langchain_tools(sandbox: Any, names: list[str] | None = None,
                    async_sandbox: Any = None) -> list[Any]:
    """One StructuredTool per sandbox tool (all of them unless ``names``). Give
    ``async_sandbox`` (an ``AsyncSandbox``) too for native ``ainvoke``."""
    try:
        from langchain_core.tools import StructuredTool
    except ImportError as exc:
        raise ImportError("LangChain tools need langchain-core: "
                          "pip install 'agentbox[langchain]'") from exc
    dispatch = ToolDispatcher(sandbox)
    adispatch = AsyncToolDispatcher(async_sandbox) if async_sandbox is not None else None
    tools = []
    for spec in TOOL_SPECS:
        if names is not None and spec["name"] not in names:
            continue
        tools.append(StructuredTool.from_function(
            func=_sync_runner(dispatch, spec["name"]),
            coroutine=_async_runner(adispatch, spec["name"]) if adispatch else None,
            name=spec["name"], description=spec["description"],
            args_schema=spec["parameters"]))
    return tools


def _sync_runner(dispatch: ToolDispatcher, name: str) -> Any:
    def run(**kwargs: Any) -> str:
        return dispatch.call(name, kwargs).text
    return run


def _async_runner(dispatch: AsyncToolDispatcher, name: str) -> Any:
    async def run(**kwargs: Any) -> str:
        return (await dispatch.call(name, kwargs)).text
    return run
