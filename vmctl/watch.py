"""Notice at once when a VMM process exits (a guest panic, an OOM kill, ``kill -9``).

A pidfd (Linux >= 5.3) becomes readable when its process terminates, whether or
not it is our child, so the same watcher serves VMMs we started and VMMs a
previous daemon started and we re-adopted. The event loop polls it; no thread,
no periodic scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable


class ExitWatch:
    """Calls ``on_exit(pid)`` once, from the event loop, when ``pid`` exits.

    ``close()`` (idempotent) stops watching; the owner calls it before it stops
    the VMM on purpose."""

    def __init__(self, pid: int, on_exit: Callable[[int], None]) -> None:
        self.pid = pid
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = None
        self._closed = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._loop.call_soon(self._fire)  # already gone: report it, asynchronously
            return
        self._loop.add_reader(self._fd, self._fire)

    def _fire(self) -> None:
        if self._closed:
            return
        self.close()
        self._on_exit(self.pid)

    def close(self) -> None:
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
            os.close(fd)
