"""The sandbox tools as CrewAI tools (extra ``crewai``: ``pip install 'agentbox[crewai]'``).
``crewai`` (and pydantic, which it brings) is imported only when these are built, so the rest
of the SDK never needs it.

    from crewai import Agent
    from agentbox.tools.crewai import crewai_tools
    analyst = Agent(role="Data analyst", goal=..., backstory=..., tools=crewai_tools(sandbox))

Each tool is a ``crewai.tools.BaseTool`` whose ``args_schema`` is built from the tool's JSON
schema (``agentbox.tools.specs``); results are the same text the other adapters return (API
errors come back as text the agent reads, not exceptions).
"""

from __future__ import annotations

from typing import Any

from agentbox.tools.dispatch import AsyncToolDispatcher, ToolDispatcher
from agentbox.tools.specs import TOOL_SPECS

_TYPES = {"string": str, "number": float, "integer": int, "boolean": bool}


def crewai_tools(sandbox: Any, names: list[str] | None = None,
                 async_sandbox: Any = None) -> list[Any]:
    """One CrewAI tool per sandbox tool (all of them unless ``names``). Give
    ``async_sandbox`` (an ``AsyncSandbox``) too for native async runs (``arun``)."""
    try:
        from crewai.tools import BaseTool
        from pydantic import BaseModel, Field, create_model
    except ImportError as exc:
        raise ImportError("CrewAI tools need crewai: pip install 'agentbox[crewai]'") from exc
    dispatch = ToolDispatcher(sandbox)
    adispatch = AsyncToolDispatcher(async_sandbox) if async_sandbox is not None else None
    tools = []
    for spec in TOOL_SPECS:
        if names is not None and spec["name"] not in names:
            continue
        schema = _args_model(spec, BaseModel, Field, create_model)
        tool_class = _tool_class(BaseTool, spec, schema, dispatch, adispatch)
        tools.append(tool_class())
    return tools


def _args_model(spec: dict[str, Any], base: Any, field: Any, create_model: Any) -> Any:
    params = spec["parameters"]
    required = set(params.get("required", ()))
    fields = {}
    for name, prop in params["properties"].items():
        kind = _TYPES.get(prop.get("type", "string"), str)
        if name in required:
            fields[name] = (kind, field(description=prop.get("description", "")))
        else:
            fields[name] = (kind | None, field(None, description=prop.get("description", "")))
    title = "".join(w.title() for w in spec["name"].split("_")) + "Args"
    return create_model(title, __base__=base, **fields)


def _tool_class(base: Any, spec: dict[str, Any], schema: Any, dispatch: ToolDispatcher,
                adispatch: AsyncToolDispatcher | None) -> Any:
    base_model = schema.__mro__[1]  # pydantic.BaseModel
    name = spec["name"]

    def _run(self: Any, **kwargs: Any) -> str:
        return dispatch.call(name, _given(kwargs)).text

    async def _arun(self: Any, **kwargs: Any) -> str:
        if adispatch is None:
            return _run(self, **kwargs)
        return (await adispatch.call(name, _given(kwargs))).text

    annotations = {"name": str, "description": str, "args_schema": type[base_model]}
    namespace = {"__module__": __name__, "__annotations__": annotations, "name": name,
                 "description": spec["description"], "args_schema": schema,
                 "_run": _run, "_arun": _arun}
    return type(f"AgentBox{schema.__name__.removesuffix('Args')}Tool", (base,), namespace)


def _given(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments the model gave (pydantic fills the optional ones with None)."""
    return {k: v for k, v in kwargs.items() if v is not None}
