"""The sandbox tools an agent gets, as plain JSON-schema definitions, and their
shapes for OpenAI function calling and Anthropic tool use (plain dicts: no
``openai``/``anthropic`` import needed)."""

from __future__ import annotations

import copy
from typing import Any

TOOL_SPECS: list[dict[str, Any]] = [
    {
        "name": "run_code",
        "description": (
            "Run Python code in a stateful interpreter inside an isolated sandbox (a microVM). "
            "Variables, imports and files persist between calls, as in a Jupyter notebook. "
            "Returns stdout, stderr, the value of the last expression, and the error with its "
            "traceback if the code raised. Charts (matplotlib) come back as images."),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python code to run."},
            },
            "required": ["code"],
            "additionalProperties": False,
        },
    },
    {
        "name": "run_command",
        "description": (
            "Run a shell command (bash) in the sandbox and wait for it. Returns its exit "
            "code, stdout and stderr. Use it to install packages, run programs, inspect files."),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command line to run."},
                "cwd": {"type": "string",
                        "description": "Working directory (default /root)."},
                "timeout": {"type": "number",
                            "description": "Seconds before it is killed (default 60)."},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "name": "read_file",
        "description": "Read a text file from the sandbox (relative paths are under /root).",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "The file to read."}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
    {
        "name": "write_file",
        "description": ("Write a text file in the sandbox, creating parent directories and "
                        "replacing the file if it exists (relative paths are under /root)."),
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "The file to write."},
                "content": {"type": "string", "description": "The whole new content."},
            },
            "required": ["path", "content"],
            "additionalProperties": False,
        },
    },
    {
        "name": "list_files",
        "description": "List a directory in the sandbox: name, type and size of each entry.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string",
                         "description": "The directory (default /root)."},
            },
            "additionalProperties": False,
        },
    },
]

TOOL_NAMES = tuple(spec["name"] for spec in TOOL_SPECS)


def _specs(names: list[str] | None) -> list[dict[str, Any]]:
    unknown = set(names or ()) - set(TOOL_NAMES)
    if unknown:
        raise ValueError(f"unknown tool(s): {', '.join(sorted(unknown))}; "
                         f"available: {', '.join(TOOL_NAMES)}")
    return [copy.deepcopy(s) for s in TOOL_SPECS if names is None or s["name"] in names]


def openai_tools(names: list[str] | None = None) -> list[dict[str, Any]]:
    """``tools=`` for OpenAI chat completions (function calling)."""
    return [{"type": "function", "function": {"name": s["name"], "description": s["description"],
                                              "parameters": s["parameters"]}}
            for s in _specs(names)]


def openai_responses_tools(names: list[str] | None = None) -> list[dict[str, Any]]:
    """``tools=`` for the OpenAI Responses API (flat function definitions)."""
    return [{"type": "function", "name": s["name"], "description": s["description"],
             "parameters": s["parameters"]} for s in _specs(names)]


def anthropic_tools(names: list[str] | None = None) -> list[dict[str, Any]]:
    """``tools=`` for Anthropic's Messages API (tool use)."""
    return [{"name": s["name"], "description": s["description"],
             "input_schema": s["parameters"]} for s in _specs(names)]
