"""Byte streams between the daemon and a VMM's Unix sockets: listen, connect, splice.

Live migration (``vmctl.migrate``) carries a confined QEMU's streams to another host: QEMU
only ever talks to Unix sockets in its own directory, and the daemon moves the bytes
between those and a TCP connection. A socket's path may be longer than ``sun_path``
allows (deep data dirs), so both ends go through ``/proc/self/fd/N/name`` of an ``O_PATH``
descriptor of its directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

CHUNK = 256 * 1024

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def open_unix(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    dir_fd = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
    try:
        return await asyncio.open_unix_connection(f"/proc/self/fd/{dir_fd}/{path.name}")
    finally:
        os.close(dir_fd)


async def listen_unix(path: Path, handler: Handler) -> asyncio.AbstractServer:
    path.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
    try:
        return await asyncio.start_unix_server(handler, f"/proc/self/fd/{dir_fd}/{path.name}")
    finally:
        os.close(dir_fd)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    moved = 0
    while chunk := await reader.read(CHUNK):
        writer.write(chunk)
        await writer.drain()
        moved += len(chunk)
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()
    return moved


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> int:
    """Copy both ways until both sides have ended (or either fails); close both. Returns
    the bytes moved from ``a`` to ``b``."""
    forward = asyncio.ensure_future(_pump(a[0], b[1]))
    back = asyncio.ensure_future(_pump(b[0], a[1]))
    try:
        done, _ = await asyncio.wait({forward, back}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a failure ends both directions
        await asyncio.gather(forward, back)
        return forward.result()
    finally:
        for task in (forward, back):
            task.cancel()
        await asyncio.gather(forward, back, return_exceptions=True)
        for _, writer in (a, b):
            writer.close()
