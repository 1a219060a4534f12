# Generated from agentbox/async_commands.py by sdk/python/gen_sync.py: do not edit.
"""``sandbox.commands``: shell commands, in the foreground or in the background.

A foreground run streams its output to the caller and is killed by the sandbox
if the caller goes away. A background run answers at once with a
:class:`CommandHandle`; its output is kept in the sandbox (the last 4 MiB, with
absolute byte offsets), so a handle can follow it, lose the connection, and
reattach from the last offset it saw -- also from another process, with
``commands.connect(pid, offset=...)``, and across a suspend and resume.

Callbacks (``on_stdout``/``on_stderr``) get each chunk as a ``str`` (in the asyncio SDK
they may also be coroutine functions). For a background command they run while the
caller waits (``wait()``) or iterates.
"""

from __future__ import annotations

import time
import contextlib
from collections.abc import Generator, Iterator, Callable
from typing import Any, Literal, overload

from agentbox import _calls
from agentbox._streams import CommandOutput, chunk_notice, notify
from agentbox._command_helpers import (
    MAX_REATTACH,
    _cwd,
    _Deadline,
    _with_timeout,
    reattach_delay,
)
from agentbox._transport import SyncTransport
from agentbox.exceptions import APIConnectionError, ConflictError, StreamInterruptedError
from agentbox.exceptions import TimeoutError as AgentBoxTimeout
from agentbox.models import CommandResult, OutputChunk, ProcessInfo

OutputCallback = Callable[[str], Any]


class CommandHandle:
    """A background command. Iterate it for :class:`OutputChunk` s (following the output
    until the command exits), or ``wait()`` for its :class:`CommandResult`.

    ``offset`` is the byte offset the next read starts from: keep it to reattach later
    with ``sandbox.commands.connect(pid, offset=...)``.
    """

    def __init__(self, sandbox_id: str, transport: SyncTransport, pid: int, offset: int = 0,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None) -> None:
        self._id, self._t, self.pid = sandbox_id, transport, pid
        self._out = CommandOutput(pid, offset)
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}

    def __repr__(self) -> str:
        state = "exited" if self._out.done else "following"
        return f"<CommandHandle pid={self.pid} {state} offset={self._out.offset}>"

    @property
    def offset(self) -> int:
        return self._out.offset

    @property
    def exit_code(self) -> int | None:
        """The exit code, once the output has been followed to the end."""
        return self._out.exit_code

    @property
    def stdout(self) -> str:
        """Everything read from stdout so far (by iterating or waiting)."""
        return self._out.stdout

    @property
    def stderr(self) -> str:
        return self._out.stderr

    def __iter__(self) -> Iterator[OutputChunk]:
        return self._follow(None)

    def _follow(self, timeout: float | None) -> Generator[OutputChunk, None, None]:
        deadline, attempt = _Deadline(timeout), 0
        while not self._out.done:
            call = _calls.command_output(self._id, self.pid, self._out.offset, follow=True)
            if deadline.end is not None:
                call = _with_timeout(call, deadline.remaining())
            try:
                with contextlib.closing(self._t.events(call)) as events:
                    for event in events:
                        chunk = self._out.feed(event)
                        if deadline.end is not None:
                            deadline.remaining()  # raises once the wait timed out
                        if chunk is not None:
                            attempt = 0
                            notify(self._callbacks, chunk_notice(chunk))
                            yield chunk
            except AgentBoxTimeout:
                deadline.remaining()
                raise
            except APIConnectionError:
                pass  # reattach below from the last offset we saw
            if not self._out.done:
                attempt += 1
                delay = reattach_delay(attempt)
                if delay is None:
                    raise StreamInterruptedError(
                        f"lost command {self.pid}'s output {MAX_REATTACH} times; reattach "
                        f"with commands.connect({self.pid}, offset={self._out.offset})")
                time.sleep(delay)

    def wait(self, timeout: float | None = None, *,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> CommandResult:
        """Follow the output until the command exits. ``timeout``: raise
        :class:`~agentbox.exceptions.TimeoutError` after this many seconds (the command
        keeps running; wait again or kill it)."""
        if on_stdout or on_stderr:
            self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        with contextlib.closing(self._follow(timeout)) as chunks:
            for _ in chunks:
                pass
        return self._out.result()

    def kill(self, signal: str | int = "SIGKILL") -> bool:
        """Signal the command's process group; False if it was no longer running."""
        try:
            self._t.send(_calls.signal_command(self._id, self.pid, signal))
        except ConflictError:
            return False
        return True

    def send_stdin(self, data: str | bytes, eof: bool = False) -> None:
        """Write to the command's stdin (it must have been started with ``stdin=True``)."""
        self._t.send(_calls.command_stdin(self._id, self.pid, _calls.to_bytes(data), eof))

    def close_stdin(self) -> None:
        self.send_stdin(b"", eof=True)

    def info(self) -> ProcessInfo:
        return ProcessInfo.from_dict(self._t.json(_calls.get_command(self._id, self.pid)))


class Commands:
    def __init__(self, sandbox_id: str, transport: SyncTransport) -> None:
        self._id, self._t = sandbox_id, transport

    @overload
    def run(self, cmd: str, background: Literal[False] = False, *,
            env: dict[str, str] | None = None, cwd: str | None = None,
            on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None,
            timeout: float | None = None, stdin: bool = False) -> CommandResult: ...

    @overload
    def run(self, cmd: str, background: Literal[True], *,
            env: dict[str, str] | None = None, cwd: str | None = None,
            on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None,
            timeout: float | None = None, stdin: bool = False) -> CommandHandle: ...

    def run(self, cmd: str, background: bool = False, *,
            env: dict[str, str] | None = None, cwd: str | None = None,
            on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, timeout: float | None = None,
            stdin: bool = False) -> CommandResult | CommandHandle:
        """Run ``cmd`` under bash. Foreground: wait and return its :class:`CommandResult`
        (a non-zero exit is not an exception: check ``exit_code``). Background: return a
        :class:`CommandHandle` at once. ``timeout``: the sandbox kills it after this many
        seconds. ``stdin=True`` keeps a pipe open for ``send_stdin``."""
        call = _calls.start_command(self._id, cmd, background, env, _cwd(cwd), stdin, timeout)
        if background:
            info = ProcessInfo.from_dict(self._t.json(call))
            return CommandHandle(self._id, self._t, info.pid, 0, on_stdout, on_stderr)
        out, callbacks = CommandOutput(), {"stdout": on_stdout, "stderr": on_stderr}
        with contextlib.closing(self._t.events(call)) as events:
            for event in events:
                notify(callbacks, chunk_notice(out.feed(event)))
        return out.result()

    def list(self) -> list[ProcessInfo]:
        """Running commands and recently finished ones (oldest first)."""
        data = self._t.json(_calls.list_commands(self._id))
        return [ProcessInfo.from_dict(c) for c in data.get("commands", [])]

    def get(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_dict(self._t.json(_calls.get_command(self._id, pid)))

    def kill(self, pid: int, signal: str | int = "SIGKILL") -> bool:
        return CommandHandle(self._id, self._t, pid).kill(signal)

    def send_stdin(self, pid: int, data: str | bytes, eof: bool = False) -> None:
        CommandHandle(self._id, self._t, pid).send_stdin(data, eof)

    def connect(self, pid: int, offset: int = 0, *,
                on_stdout: OutputCallback | None = None,
                on_stderr: OutputCallback | None = None) -> CommandHandle:
        """A handle on a command started earlier (checks that it exists); its output is
        read from ``offset`` (0: the oldest output still kept)."""
        self.get(pid)
        return CommandHandle(self._id, self._t, pid, offset, on_stdout, on_stderr)
