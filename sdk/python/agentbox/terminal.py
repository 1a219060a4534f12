"""An interactive terminal in a sandbox over ``GET /v1/sandboxes/{id}/terminal``
(a WebSocket), for ``agentbox shell``.

Wire format: binary frames carry raw bytes both ways (our stdin in, the PTY's
output out); text frames carry JSON control messages: ``{"type": "resize",
"cols", "rows"}`` from us (at start and on SIGWINCH), ``{"type": "exit",
"exit_code"}`` from the server before it closes. The initial size also goes in the
query (``?cols=&rows=``). When stdin is a terminal it is
put in raw mode (every key goes to the sandbox, ^C included) and restored on
the way out, whatever happens.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from agentbox.exceptions import APIConnectionError, from_response

_EOT = b"\x04"  # ^D: ends the shell when our stdin is a pipe that reached its end


def require_aiohttp() -> Any:
    """aiohttp, the WebSocket client (httpx has none): the SDK's extra ``shell``."""
    try:
        import aiohttp
    except ImportError as exc:
        raise ImportError("`agentbox shell` needs aiohttp (its WebSocket client): "
                          "pip install 'agentbox[shell]'") from exc
    return aiohttp


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Raw mode on ``fd`` if it is a terminal; restored on exit."""
    if not os.isatty(fd):
        yield
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
        return size.columns, size.lines
    except OSError:
        return 80, 24


def resize_message(fd: int) -> str:
    cols, rows = terminal_size(fd)
    return json.dumps({"type": "resize", "cols": cols, "rows": rows})


async def run_terminal(url: str, api_key: str, stdin_fd: int | None = None,
                       stdout: Any = None) -> int:
    """Connect stdin/stdout to the sandbox terminal at ``url`` (ws:// or wss://);
    returns the remote shell's exit code (0 if the server did not say)."""
    aiohttp = require_aiohttp()

    stdin_fd = sys.stdin.fileno() if stdin_fd is None else stdin_fd
    out = stdout if stdout is not None else sys.stdout.buffer
    headers = {"Authorization": f"Bearer {api_key}"}
    cols, rows = terminal_size(stdin_fd)
    params = {"cols": str(cols), "rows": str(rows)}
    async with aiohttp.ClientSession() as session:
        try:
            ws = await session.ws_connect(url, headers=headers, max_msg_size=0, heartbeat=30,
                                          params=params)
        except aiohttp.WSServerHandshakeError as exc:
            raise await _refusal(session, url, headers, params, exc) from exc
        except aiohttp.ClientError as exc:
            raise APIConnectionError(f"terminal: {exc}") from exc
        async with ws:
            with raw_mode(stdin_fd):
                return await _pump(ws, stdin_fd, out)


async def _refusal(session: Any, url: str, headers: dict[str, str], params: dict[str, str],
                   exc: Any) -> Exception:
    """The server's own error for a refused handshake: aiohttp drops the body, so ask
    again with a plain upgrade request and read the JSON error it answers with."""
    upgrade = {**headers, "Connection": "Upgrade", "Upgrade": "websocket",
               "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()}
    body: Any = None
    with contextlib.suppress(Exception):
        async with session.get("http" + url[2:], headers=upgrade, params=params) as resp:
            if resp.status == exc.status:
                body = await resp.json(content_type=None)
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        body = {"error": {"code": _code_for(exc.status), "message": f"terminal: {exc.message}"}}
    return from_response(exc.status, body)


def _code_for(status: int) -> str:
    return {401: "unauthorized", 404: "not_found", 409: "conflict"}.get(status, "http_error")


async def _pump(ws: Any, stdin_fd: int, out: Any) -> int:
    import aiohttp

    loop = asyncio.get_running_loop()
    await ws.send_str(resize_message(stdin_fd))
    sender = _StdinSender(ws, stdin_fd, loop)
    sender.start()
    exit_code = 0
    try:
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                out.write(msg.data)
                out.flush()
            elif msg.type == aiohttp.WSMsgType.TEXT:
                event = _control(msg.data)
                if event.get("type") == "exit":
                    exit_code = int(event.get("exit_code") or 0)
            elif msg.type in (aiohttp.WSMsgType.ERROR, aiohttp.WSMsgType.CLOSED):
                break
    finally:
        await sender.stop()
    return exit_code


def _control(data: str) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


class _StdinSender:
    """Forwards stdin to the socket (from the event loop's reader callback, so no
    thread) and terminal resizes (SIGWINCH) as control messages."""

    def __init__(self, ws: Any, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.ws, self.fd, self.loop = ws, fd, loop
        self._queue: asyncio.Queue[bytes | str | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._reading = False
        self._winch = False

    def start(self) -> None:
        try:
            self.loop.add_reader(self.fd, self._on_readable)
            self._reading = True
        except (OSError, ValueError, NotImplementedError):
            pass  # e.g. a regular file as stdin: nothing to forward interactively
        if os.isatty(self.fd):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self.loop.add_signal_handler(signal.SIGWINCH, self._on_winch)
                self._winch = True
        self._task = asyncio.create_task(self._send_loop(), name="agentbox-terminal-stdin")

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(self.fd)
            self._reading = False
            if not os.isatty(self.fd):
                self._queue.put_nowait(_EOT)
            return
        self._queue.put_nowait(data)

    def _on_winch(self) -> None:
        self._queue.put_nowait(resize_message(self.fd))

    async def _send_loop(self) -> None:
        while (item := await self._queue.get()) is not None:
            if self.ws.closed:
                return
            with contextlib.suppress(ConnectionError, RuntimeError):
                if isinstance(item, bytes):
                    await self.ws.send_bytes(item)
                else:
                    await self.ws.send_str(item)

    async def stop(self) -> None:
        if self._reading:
            self.loop.remove_reader(self.fd)
        if self._winch:
            self.loop.remove_signal_handler(signal.SIGWINCH)
        self._queue.put_nowait(None)
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 2)
            except (TimeoutError, ConnectionError):
                self._task.cancel()
