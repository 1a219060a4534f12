"""The guest's serial console, copied into a size-capped, rotated log.

A guest decides what it prints on its console, so writing it straight to a file
(QEMU's ``-serial file:``) lets any guest fill the host's disk. Instead QEMU
serves the console on a Unix socket and ``ConsoleLog`` copies it into
``console.log``; when that reaches ``max_bytes`` it becomes ``console.log.1``
(replacing the previous one) and a new file starts, so a VM's console never
takes more than twice the cap. If the daemon is slow, the socket fills and the
guest's serial port waits: a flooding guest slows only itself. While no daemon
is connected (between a crash and the restart) QEMU drops the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK = 64 * 1024


class ConsoleLog:
    """Owns one task that copies ``socket`` to ``path``; ``aclose()`` stops it."""

    def __init__(self, socket: Path, path: Path, max_bytes: int) -> None:
        self.socket, self.path, self.max_bytes = socket, path, max_bytes
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"console {self.path.parent.name}")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _run(self) -> None:
        conn = await self._connect()
        if conn is None:
            return
        reader, writer = conn
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
            writer.close()

    async def _connect(self, timeout: float = 10.0
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await asyncio.open_unix_connection(str(self.socket))
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    log.warning("console socket %s never appeared", self.socket)
                    return None
                await asyncio.sleep(0.01)


def _open_private(path: Path):  # type: ignore[no-untyped-def]
    """Append-only, readable by root only (the console is the tenant's output)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600),
                     "ab")
