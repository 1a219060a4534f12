"""Consumers of the server's NDJSON streams, with no I/O (events in, state and
callback notifications out), shared by the sync and async SDK.

``ExecutionBuilder`` folds a streamed ``run_code`` into an :class:`Execution`;
``CommandOutput`` folds a command's output (foreground run or a followed
background process) into a :class:`CommandResult` and remembers the offset to
reattach from if the stream breaks. Unknown event types are ignored, so a newer
server can add some.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from agentbox.exceptions import ProtocolError, StreamInterruptedError
from agentbox.models import (
    CommandResult,
    Execution,
    ExecutionError,
    OutputChunk,
    OutputFile,
    Result,
)

Notice = tuple[str, Any]  # ("stdout" | "stderr" | "result" | "error", payload)


class ExecutionBuilder:
    def __init__(self) -> None:
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self.results: list[Result] = []
        self.error: ExecutionError | None = None
        self.ended = False
        self._end: dict[str, Any] = {}

    def feed(self, event: dict[str, Any]) -> Notice | None:
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            data = str(event.get("data", ""))
            (self._stdout if kind == "stdout" else self._stderr).append(data)
            return kind, data
        if kind == "result":
            result = Result.from_dict(event.get("result"))
            self.results.append(result)
            return "result", result
        if kind == "error":
            self.error = ExecutionError.from_dict(event.get("error"))
            return "error", self.error
        if kind == "end":
            self.ended, self._end = True, event
        return None

    def finish(self) -> Execution:
        if not self.ended:
            raise StreamInterruptedError("the run's output stream ended before its 'end' line")
        return Execution(stdout="".join(self._stdout), stderr="".join(self._stderr),
                         results=self.results, error=self.error,
                         execution_count=self._end.get("execution_count"),
                         duration_ms=self._end.get("duration_ms"),
                         files=OutputFile.list_from(self._end.get("files")))


class CommandOutput:
    """State of one command's output stream. ``offset`` is where to resume reading."""

    def __init__(self, pid: int | None = None, offset: int = 0) -> None:
        self.pid = pid
        self.offset = offset
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self.dropped_bytes = 0
        self.exit_code: int | None = None
        self.timed_out = False
        self.done = False

    def feed(self, event: dict[str, Any]) -> OutputChunk | None:
        kind = event.get("type")
        if kind == "start":
            self.pid = int(event["pid"])
        elif kind in ("stdout", "stderr"):
            data = str(event.get("data", ""))
            start = int(event.get("offset", self.offset))
            nxt = int(event.get("next_offset", start + len(data.encode())))
            (self._stdout if kind == "stdout" else self._stderr).append(data)
            self.offset = nxt
            return OutputChunk(kind, data, start, nxt)
        elif kind == "dropped":
            nxt = int(event.get("next_offset", self.offset))
            self.dropped_bytes += max(0, nxt - int(event.get("offset", self.offset)))
            self.offset = nxt
        elif kind == "exit":
            if event.get("exit_code") is None:
                raise ProtocolError("an 'exit' event without an exit_code")
            self.exit_code = int(event["exit_code"])
            self.timed_out = bool(event.get("timed_out", False))
            self.done = True
        return None

    @property
    def stdout(self) -> str:
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def result(self) -> CommandResult:
        if self.exit_code is None:
            raise StreamInterruptedError("the command's output stream ended before it exited")
        return CommandResult(pid=self.pid, stdout=self.stdout, stderr=self.stderr,
                             exit_code=self.exit_code, timed_out=self.timed_out)


def notify(callbacks: dict[str, Callable[[Any], Any] | None], notice: Notice | None) -> Any:
    """Call the callback registered for a notice; returns what it returned (an awaitable
    from an async callback, which the async caller awaits)."""
    if notice is None:
        return None
    callback = callbacks.get(notice[0])
    return None if callback is None else callback(notice[1])


def chunk_notice(chunk: OutputChunk | None) -> Notice | None:
    return None if chunk is None else (chunk.stream, chunk.data)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
