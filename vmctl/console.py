"""The guest's serial console, copied into a size-capped, rotated log.

A guest decides what it prints on its console, so writing it straight to a file
(QEMU's ``-serial file:``) lets any guest fill the host's disk. Instead QEMU
serves the console on a Unix socket and ``ConsoleLog`` copies it into
``console.log``; when that reaches ``max_bytes`` it becomes ``console.log.1``
(replacing the previous one) and a new file starts, so a VM's console never
takes more than twice the cap. If the daemon is slow, the socket fills and the
guest's serial port waits: a flooding guest slows only itself. While no daemon
is connected (between a crash and the restart) QEMU drops the output.

Firecracker writes the console (and its own messages) to its stdout, so its
stdout is a FIFO in the VM's directory (``console_fifo``), opened read-write
for the VMM: the pipe always has a reader, so the VMM never gets EPIPE while no
daemon reads it (between a crash and the restart); once the pipe buffer is full
its writes wait, like QEMU's socket, and the next daemon reopens the FIFO and
drains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
DEFAULT_CONSOLE_LOG_BYTES = 1 << 20


PIPE_BYTES = 1 << 20  # a FIFO's buffer (Linux's default pipe-max-size)
_Opened = tuple[asyncio.StreamReader, Callable[[], None]]


class ConsoleLog:
    """Owns one task that copies a console (a Unix socket or a FIFO) to ``path``;
    ``aclose()`` stops it."""

    def __init__(self, socket: Path | None, path: Path, max_bytes: int,
                 opener: Callable[[], Awaitable[_Opened | None]] | None = None) -> None:
        self.socket, self.path, self.max_bytes = socket, path, max_bytes
        self._open = opener or self._connect
        self._task: asyncio.Task | None = None

    @classmethod
    def from_fifo(cls, fifo: Path, path: Path, max_bytes: int) -> ConsoleLog:
        """Read the FIFO a VMM writes its stdout to (see ``console_fifo``)."""
        async def opener() -> _Opened | None:
            try:
                fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                log.warning("console FIFO %s is missing", fifo)
                return None
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=CHUNK)
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
            return reader, transport.close
        return cls(None, path, max_bytes, opener)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"console {self.path.parent.name}")

    async def aclose(self, drain_timeout: float = 0.0) -> None:
        """Stop copying; with ``drain_timeout``, first wait that long for the end of the
        console (the VMM has exited) so its last words are in the log."""
        task, self._task = self._task, None
        if task is None:
            return
        if drain_timeout > 0:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), drain_timeout)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    async def _run(self) -> None:
        conn = await self._open()
        if conn is None:
            return
        reader, close = conn
        written = self.path.stat().st_size if self.path.exists() else 0
        out = _open_private(self.path)
        try:
            while chunk := await reader.read(CHUNK):
                if written + len(chunk) > self.max_bytes:
                    out.close()
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    out, written = _open_private(self.path), 0
                out.write(chunk[-self.max_bytes:])
                out.flush()
                written += min(len(chunk), self.max_bytes)
        except (ConnectionError, OSError) as exc:
            log.debug("console %s closed: %s", self.path, exc)
        finally:
            out.close()
            close()

    async def _connect(self, timeout: float = 10.0) -> _Opened | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        assert self.socket is not None
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.socket))
                return reader, writer.close
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    log.warning("console socket %s never appeared", self.socket)
                    return None
                await asyncio.sleep(0.01)


def _open_private(path: Path):  # type: ignore[no-untyped-def]
    """Append-only, readable by root only (the console is the tenant's output)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600),
                     "ab")


def console_fifo(fifo: Path) -> int:
    """Make (or reuse) the FIFO ``fifo`` (0600) and return a read-write fd on it for a
    VMM's stdout/stderr; the caller closes its copy once the VMM has started."""
    try:
        os.mkfifo(fifo, 0o600)
    except FileExistsError:
        pass
    fd = os.open(fifo, os.O_RDWR | os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # F_SETPIPE_SZ: more room before the VMM waits
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return fd
