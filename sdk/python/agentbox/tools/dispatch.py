"""Carrying out tool calls against a sandbox, and shaping the answers.

``ToolDispatcher(sandbox)`` (or ``AsyncToolDispatcher`` for an ``AsyncSandbox``)
runs a call by name and arguments and returns a :class:`ToolOutput` (text,
images, error flag). ``.openai(tool_call)`` and ``.anthropic(tool_use)`` take the
model's call as a dict or SDK object and return the message to send back.

An API error does not raise: the model gets it as an error result, so it can
correct itself (a wrong path, a timeout). Long output is cut to ``max_chars``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentbox.exceptions import AgentBoxError, EndpointNotFoundError
from agentbox.models import Execution, ExecResult, FileInfo
from agentbox.tools.specs import TOOL_NAMES

MAX_CHARS = 20_000


@dataclass(frozen=True)
class ToolOutput:
    text: str
    images: list[tuple[str, str]] = field(default_factory=list)  # (mime type, base64)
    is_error: bool = False


class ToolArgumentError(ValueError):
    pass


def cut(text: str, limit: int = MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} more characters cut]"


def _sections(*pairs: tuple[str, str | None], limit: int) -> str:
    parts = [f"{name}:\n{cut(value, limit)}" for name, value in pairs if value]
    return "\n".join(parts) if parts else "(no output)"


def format_execution(ex: Execution, limit: int = MAX_CHARS) -> ToolOutput:
    images, texts = [], []
    for result in ex.results:
        for mime in ("image/png", "image/jpeg"):
            if result.data.get(mime):
                images.append((mime, str(result.data[mime])))
                texts.append(f"[{mime} image attached]")
                break
        else:
            if result.text is not None:
                texts.append(str(result.text))
    error = (ex.error.traceback or str(ex.error)) if ex.error else None
    text = _sections(("stdout", ex.stdout), ("stderr", ex.stderr),
                     ("result", "\n".join(texts)), ("error", error), limit=limit)
    return ToolOutput(text, images, is_error=ex.error is not None)


def format_exec(res: ExecResult, limit: int = MAX_CHARS) -> ToolOutput:
    note = " (timed out and killed)" if res.timed_out else ""
    text = f"exit_code: {res.exit_code}{note}\n" + _sections(
        ("stdout", res.stdout), ("stderr", res.stderr), limit=limit)
    return ToolOutput(text, is_error=not res.ok)


def format_listing(path: str, entries: list[FileInfo]) -> ToolOutput:
    lines = [f"{e.type:7} {e.size:>10}  {e.name}{'/' if e.is_dir else ''}" for e in entries]
    return ToolOutput(f"{path}:\n" + ("\n".join(lines) if lines else "(empty)"))


def parse_arguments(name: str, arguments: Any) -> dict[str, Any]:
    if name not in TOOL_NAMES:
        raise ToolArgumentError(f"unknown tool {name!r}; available: {', '.join(TOOL_NAMES)}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ToolArgumentError(f"arguments are not valid JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise ToolArgumentError("arguments must be a JSON object")
    return arguments


def _require(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise ToolArgumentError(f"'{key}' (a string) is required")
    return value


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def openai_message(call_id: str, out: ToolOutput) -> dict[str, Any]:
    """A ``role: tool`` message (chat completions carry text only: images are noted)."""
    return {"role": "tool", "tool_call_id": call_id, "content": out.text}


def anthropic_block(use_id: str, out: ToolOutput) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": out.text}]
    content += [{"type": "image", "source": {"type": "base64", "media_type": mime, "data": b64}}
                for mime, b64 in out.images]
    return {"type": "tool_result", "tool_use_id": use_id, "content": content,
            "is_error": out.is_error}


class ToolDispatcher:
    """Runs tool calls in a :class:`~agentbox.Sandbox`."""

    def __init__(self, sandbox: Any, max_chars: int = MAX_CHARS) -> None:
        self.sandbox, self.max_chars = sandbox, max_chars

    def call(self, name: str, arguments: Any = None) -> ToolOutput:
        try:
            return self._call(name, parse_arguments(name, arguments or {}))
        except (AgentBoxError, ToolArgumentError) as exc:
            return ToolOutput(f"error: {exc}", is_error=True)

    def _call(self, name: str, args: dict[str, Any]) -> ToolOutput:
        sb, limit = self.sandbox, self.max_chars
        if name == "run_code":
            code = _require(args, "code")
            try:
                return format_execution(sb.run_code(code), limit)
            except EndpointNotFoundError:  # a server without the interpreter: fresh process
                return format_exec(sb.execute(code), limit)
        if name == "run_command":
            return format_exec(sb.execute(command=_require(args, "command"), cwd=args.get("cwd"),
                                          timeout=args.get("timeout")), limit)
        if name == "read_file":
            data = sb.files.read(_require(args, "path"), format="bytes")
            return ToolOutput(cut(data.decode(errors="replace"), limit))
        if name == "write_file":
            info = sb.files.write(_require(args, "path"), _require(args, "content"))
            return ToolOutput(f"wrote {info.size} bytes to {info.path}")
        path = args.get("path") or "/root"
        return format_listing(path, sb.files.list(path))

    def openai(self, tool_call: Any) -> dict[str, Any]:
        """The ``role: tool`` message answering an OpenAI ``tool_call``."""
        fn = _field(tool_call, "function")
        out = self.call(_field(fn, "name"), _field(fn, "arguments"))
        return openai_message(_field(tool_call, "id"), out)

    def anthropic(self, tool_use: Any) -> dict[str, Any]:
        """The ``tool_result`` content block answering an Anthropic ``tool_use`` block."""
        out = self.call(_field(tool_use, "name"), _field(tool_use, "input"))
        return anthropic_block(_field(tool_use, "id"), out)


class AsyncToolDispatcher:
    """Runs tool calls in an :class:`~agentbox.AsyncSandbox`."""

    def __init__(self, sandbox: Any, max_chars: int = MAX_CHARS) -> None:
        self.sandbox, self.max_chars = sandbox, max_chars

    async def call(self, name: str, arguments: Any = None) -> ToolOutput:
        try:
            return await self._call(name, parse_arguments(name, arguments or {}))
        except (AgentBoxError, ToolArgumentError) as exc:
            return ToolOutput(f"error: {exc}", is_error=True)

    async def _call(self, name: str, args: dict[str, Any]) -> ToolOutput:
        sb, limit = self.sandbox, self.max_chars
        if name == "run_code":
            code = _require(args, "code")
            try:
                return format_execution(await sb.run_code(code), limit)
            except EndpointNotFoundError:
                return format_exec(await sb.execute(code), limit)
        if name == "run_command":
            return format_exec(await sb.execute(command=_require(args, "command"),
                                                cwd=args.get("cwd"),
                                                timeout=args.get("timeout")), limit)
        if name == "read_file":
            data = await sb.files.read(_require(args, "path"), format="bytes")
            return ToolOutput(cut(data.decode(errors="replace"), limit))
        if name == "write_file":
            info = await sb.files.write(_require(args, "path"), _require(args, "content"))
            return ToolOutput(f"wrote {info.size} bytes to {info.path}")
        path = args.get("path") or "/root"
        return format_listing(path, await sb.files.list(path))

    async def openai(self, tool_call: Any) -> dict[str, Any]:
        fn = _field(tool_call, "function")
        out = await self.call(_field(fn, "name"), _field(fn, "arguments"))
        return openai_message(_field(tool_call, "id"), out)

    async def anthropic(self, tool_use: Any) -> dict[str, Any]:
        out = await self.call(_field(tool_use, "name"), _field(tool_use, "input"))
        return anthropic_block(_field(tool_use, "id"), out)
