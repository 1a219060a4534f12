"""A small asyncio QMP client (QEMU Machine Protocol over a Unix socket).

QMP is line-delimited JSON: the server greets with ``{"QMP": ...}``, the client
must send ``qmp_capabilities`` before anything else, then each command gets
exactly one ``{"return": ...}`` or ``{"error": ...}``; asynchronous
``{"event": ...}`` messages may arrive between them. We run one command at a
time (a lock), which is all the driver needs, and keep events in a bounded
buffer so callers can wait for e.g. ``RESUME``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vmctl.errors import VMGoneError, VMProtocolError, VMTimeoutError

_LINE_LIMIT = 16 * 1024 * 1024


class QMPClient:
    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

    async def connect(self, path: Path, timeout: float = 10.0,
                      alive: Callable[[], bool] | None = None) -> None:
        """Connect (retrying while the socket does not exist yet) and negotiate.
        ``alive``: stop retrying as soon as the VMM process is gone."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(path), limit=_LINE_LIMIT)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if alive is not None and not alive():
                    raise VMGoneError("QEMU exited before its QMP socket came up") from exc
                if time.monotonic() > deadline:
                    raise VMTimeoutError(f"QMP socket {path} not ready after {timeout}s") from exc
                await asyncio.sleep(0.005)
        greeting = await self._read_message(timeout)
        if "QMP" not in greeting:
            raise VMProtocolError(f"unexpected QMP greeting: {greeting!r}")
        await self.execute("qmp_capabilities")

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 30.0, fds: Sequence[int] = ()) -> Any:
        """Run one command and return its ``return`` value; QMP errors raise VMProtocolError.
        ``fds``: file descriptors sent along (SCM_RIGHTS), as ``getfd`` expects."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        async with self._lock:
            if self._writer is None:
                raise VMGoneError("QMP is not connected")
            try:
                data = json.dumps(msg).encode() + b"\n"
                if fds:
                    await self._writer.drain()  # nothing buffered may overtake it
                    _send_with_fds(self._writer, data, fds)
                else:
                    self._writer.write(data)
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise VMGoneError(f"QMP connection lost sending {command}") from exc
            while True:
                reply = await self._read_message(timeout)
                if "event" in reply:
                    self.events.append(reply)
                    continue
                if "error" in reply:
                    err = reply["error"]
                    raise VMProtocolError(f"QMP {command}: {err.get('class')}: {err.get('desc')}")
                return reply.get("return")

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """Wait for an asynchronous event (already-buffered events count)."""
        deadline = time.monotonic() + timeout
        async with self._lock:
            while True:
                for ev in self.events:
                    if ev.get("event") == name:
                        self.events.remove(ev)
                        return ev
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise VMTimeoutError(f"QMP event {name} not seen within {timeout}s")
                msg = await self._read_message(remaining)
                if "event" in msg:
                    self.events.append(msg)

    async def _read_message(self, timeout: float) -> dict[str, Any]:
        assert self._reader is not None
        try:
            line = await asyncio.wait_for(self._reader.readline(), timeout)
        except TimeoutError as exc:
            raise VMTimeoutError(f"no QMP reply within {timeout}s") from exc
        except (ConnectionError, OSError, ValueError) as exc:
            raise VMGoneError("QMP connection lost") from exc
        if not line:
            raise VMGoneError("QMP connection closed by QEMU")
        try:
            msg = json.loads(line)
        except ValueError as exc:
            raise VMProtocolError(f"malformed QMP message: {line[:200]!r}") from exc
        if not isinstance(msg, dict):
            raise VMProtocolError(f"malformed QMP message: {line[:200]!r}")
        return msg

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _send_with_fds(writer: asyncio.StreamWriter, data: bytes, fds: Sequence[int]) -> None:
    """Send ``data`` with ``fds`` attached, on the transport's socket (its buffer is empty).
    asyncio's socket wrapper has no sendmsg, so through a duplicate of its descriptor."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        raise VMProtocolError("QMP transport has no socket to pass file descriptors on")
    with socket.socket(fileno=os.dup(sock.fileno())) as raw:
        sent = socket.send_fds(raw, [data], list(fds))
    if sent != len(data):  # a QMP command is far smaller than any socket buffer
        raise VMProtocolError(f"QMP: sent {sent} of {len(data)} bytes with the fds")
