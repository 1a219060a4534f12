"""Interactive terminals: ``GET /pty``, a shell on a pseudo-terminal over a WebSocket.

Theory of operation. Each connection gets a new pseudo-terminal (``pty.openpty``)
and a shell on its slave side, started as a new session that takes the slave as
its controlling terminal (``start_new_session`` + ``TIOCSCTTY``), so job control,
Ctrl-C and SIGWINCH behave as in any terminal emulator. The agent keeps only the
master fd, non-blocking, and never forks itself.

Two pumps run per connection. Output: read the master (when the loop says it is
readable), send a binary frame, wait for the send to drain, read again: a client
that reads slowly stops us reading, the terminal's buffer fills and the shell
blocks in write() -- no unbounded buffering. Input: receive a frame, write it to
the master (waiting for it to become writable if the shell is not reading), and
only then receive the next one. Text frames are JSON control messages (resize).

The shell exiting ends the conversation: its remaining output (until every
holder of the terminal closed it, or ``DRAIN_GRACE``), then ``{"type":"exit"}``,
then a close with 1000. The client closing (or vanishing) ends it the other way:
the shell's process group gets SIGHUP and the master is closed (the kernel hangs
the terminal up, as when a terminal window closes); whatever of the group is left
after ``HANGUP_GRACE`` is SIGKILLed. The shell is registered with the agent's
:class:`~guest.execution.ExecOwner`, so it counts in ``Health.running`` (an open
terminal keeps the sandbox awake) and is killed when the agent shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import pty
import signal
import struct
import termios
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import WSMsgType, web

from guest.errors import AgentError, BadRequest, ResponseStarted
from guest.execution import DRAIN_GRACE, READ_CHUNK, REAP_TIMEOUT, ExecOwner, Executor, kill_group
from guest.protocol import (
    DEFAULT_COLS,
    DEFAULT_ROWS,
    ProtocolError,
    TerminalResize,
    terminal_exit,
    validate_terminal_size,
)

log = logging.getLogger("agentbox.guest.terminal")

HEARTBEAT = 30.0  # seconds between pings: a host that vanished ends the shell
HANGUP_GRACE = 2.0  # seconds between SIGHUP and SIGKILL when the client leaves
DISCONNECT_POLL = 1.0  # seconds between checks that the client's connection is still there
DEFAULT_CWD = "/root"


def set_size(fd: int, cols: int, rows: int) -> None:
    """Set a terminal's window size (the kernel sends SIGWINCH to its foreground group)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_terminal() -> None:
    # Runs in the child after setsid() and the dup2s: make stdin (the slave) the
    # controlling terminal. Only an ioctl: safe after fork even with threads about.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # A terminal's shell starts with no signal blocked and ^C/^\ doing what they do,
    # whatever its parent inherited: a blocked or ignored SIGINT is passed on by exec,
    # and ^C would then interrupt nothing.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except ValueError:  # not the main thread: the mask is reset all the same
            pass


class Pty:
    """One process on a pseudo-terminal; the master fd is read and written from the loop."""

    def __init__(self, proc: asyncio.subprocess.Process, master: int) -> None:
        self.proc = proc
        self.fd = master
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str], cwd: str,
                    cols: int, rows: int) -> Pty:
        master, slave = pty.openpty()
        try:
            set_size(master, cols, rows)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                start_new_session=True, preexec_fn=_take_terminal)
        except BaseException as exc:
            os.close(master)
            if isinstance(exc, ValueError):  # NUL in the command
                raise BadRequest(f"cannot start the terminal: {exc}") from exc
            if isinstance(exc, OSError):
                raise AgentError(f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
            raise
        finally:
            os.close(slave)  # only the shell's tree holds it: EIO on the master once they are gone
        os.set_blocking(master, False)
        return cls(proc, master)

    def resize(self, cols: int, rows: int) -> None:
        if self.fd >= 0:
            set_size(self.fd, cols, rows)

    async def read(self) -> bytes:
        """Up to READ_CHUNK bytes of output; b"" once no process holds the terminal."""
        while self.fd >= 0:
            try:
                return os.read(self.fd, READ_CHUNK)
            except BlockingIOError:
                pass
            except OSError:
                return b""  # EIO: every holder of the slave closed it
            await self._ready(self._loop.add_reader, self._loop.remove_reader)
        return b""

    async def write(self, data: bytes) -> None:
        """Write all of ``data`` as keyboard input (dropped once the terminal is gone)."""
        view = memoryview(data)
        while view and self.fd >= 0:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                await self._ready(self._loop.add_writer, self._loop.remove_writer)
            except OSError:
                return

    async def _ready(self, add: Callable[..., Any], remove: Callable[[int], Any]) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.fd
        add(fd, _set_done, fut)
        try:
            await fut
        finally:
            remove(fd)

    def close(self) -> None:
        """Close the master (the kernel hangs up the terminal). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    async def hangup(self) -> None:
        """The client left: SIGHUP the group, close the master, SIGKILL what is left; reap."""
        pid = self.proc.pid
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGHUP)
        self.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), HANGUP_GRACE)
        kill_group(pid)  # nothing of the terminal's group outlives it
        with contextlib.suppress(TimeoutError):  # stuck in D state: the child watcher reaps it
            await asyncio.wait_for(self.proc.wait(), REAP_TIMEOUT)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Terminals:
    """``GET /pty``: one shell per WebSocket, counted and owned by the agent's ExecOwner."""

    def __init__(self, executor: Executor, owner: ExecOwner) -> None:
        self.executor = executor
        self.owner = owner
        self._ending: set[asyncio.Future[None]] = set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        cols, rows = _size(request)
        ws = web.WebSocketResponse(max_msg_size=0, heartbeat=HEARTBEAT)
        if not ws.can_prepare(request).ok:
            raise BadRequest("GET /pty expects a WebSocket upgrade")
        term = await Pty.spawn(self._argv(request.query.get("cmd")), self._env(),
                               self._cwd(), cols, rows)
        self.owner.add(term.proc)
        try:
            await ws.prepare(request)
            await _converse(request, ws, term)
        except ConnectionError:
            pass  # the client left
        except Exception as exc:  # never a JSON error once the socket is open
            raise ResponseStarted(f"GET /pty: {exc}") from exc
        finally:  # also when cancelled: aiohttp 3.8 cancels the handler when the client leaves
            ending = asyncio.ensure_future(self._end(term))
            self._ending.add(ending)
            ending.add_done_callback(self._ending.discard)
            await asyncio.shield(ending)
        return ws

    async def _end(self, term: Pty) -> None:
        try:
            if term.proc.returncode is None:
                await term.hangup()
        finally:
            term.close()
            self.owner.discard(term.proc)  # counted until reaped

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        yield
        if self._ending:  # hang-ups of handlers cancelled by their client leaving
            await asyncio.wait(set(self._ending), timeout=HANGUP_GRACE + REAP_TIMEOUT)

    def _argv(self, cmd: str | None) -> list[str]:
        shell = self.executor.shell
        return [shell, "-l"] if not cmd else [shell, "-c", cmd]

    def _env(self) -> dict[str, str]:
        return {**self.executor.env, "TERM": "xterm-256color"}

    def _cwd(self) -> str:
        home = self.executor.env.get("HOME", "/")
        for cwd in (DEFAULT_CWD, home):
            if os.path.isdir(cwd):
                return cwd
        return "/"


def _size(request: web.Request) -> tuple[int, int]:
    try:
        cols = int(request.query.get("cols", DEFAULT_COLS))
        rows = int(request.query.get("rows", DEFAULT_ROWS))
    except ValueError as exc:
        raise ProtocolError("'cols' and 'rows' must be integers") from exc
    return validate_terminal_size(cols, rows)


async def _converse(request: web.Request, ws: web.WebSocketResponse, term: Pty) -> None:
    """Pump both ways until the shell exits (exit message, close 1000) or the client leaves."""
    pid = term.proc.pid
    output = asyncio.create_task(_pump_output(term, ws), name=f"pty-out-{pid}")
    keys = asyncio.create_task(_pump_input(ws, term), name=f"pty-in-{pid}")
    exited = asyncio.create_task(term.proc.wait(), name=f"pty-wait-{pid}")
    tasks: tuple[asyncio.Task[Any], ...] = (output, keys, exited)
    try:
        while not (keys.done() or exited.done()):
            await asyncio.wait({keys, exited}, timeout=DISCONNECT_POLL,
                               return_when=asyncio.FIRST_COMPLETED)
            transport = request.transport
            if transport is None or transport.is_closing():
                return  # gone while the input pump waits on a shell that reads nothing
        if exited.done():  # the shell ended: the rest of its output, then the exit message
            await asyncio.wait({output}, timeout=DRAIN_GRACE)
            # Stop the input pump first: a close() racing a receive() in another task would
            # drop the connection without waiting for the client's close frame.
            for task in (output, keys):  # output still running: a child holds the terminal
                task.cancel()
            await asyncio.wait({output, keys})
            if not ws.closed:
                with contextlib.suppress(ConnectionError):
                    await ws.send_str(json.dumps(terminal_exit(exited.result())))
                await ws.close(code=1000)
        # else the client closed (or lost) the socket: the handler hangs the shell up
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump_output(term: Pty, ws: web.WebSocketResponse) -> None:
    with contextlib.suppress(ConnectionError):  # the client is gone; the input pump sees it
        while data := await term.read():
            await ws.send_bytes(data)  # waits for the transport to drain: backpressure


async def _pump_input(ws: web.WebSocketResponse, term: Pty) -> None:
    async for msg in ws:  # ends at close
        if msg.type is WSMsgType.BINARY:
            await term.write(msg.data)
        elif msg.type is WSMsgType.TEXT:
            _control(term, msg.data)
        elif msg.type is WSMsgType.ERROR:
            return


def _control(term: Pty, text: str) -> None:
    try:
        resize = TerminalResize.from_dict(json.loads(text))
    except (ValueError, ProtocolError) as exc:  # JSONDecodeError is a ValueError
        log.debug("ignoring terminal message %.100r: %s", text, exc)
        return
    term.resize(resize.cols, resize.rows)


def add_routes(app: web.Application, executor: Executor, owner: ExecOwner) -> None:
    terminals = Terminals(executor, owner)
    app.cleanup_ctx.append(terminals.lifespan)
    app.router.add_get("/pty", terminals.handle, allow_head=False)
