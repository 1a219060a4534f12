"""A fixed number of slots, taken at once or awaited in order (one sandbox's request pacing).

``asyncio.Semaphore`` offers no "take one now, only if nobody is queued" that a caller who
cannot wait (``gateway.preview.fastlane``) could use without reaching into its internals; this does,
and the queue's length is what the controller bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Slots:
    __slots__ = ("free", "_waiters")

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("at least one slot")
        self.free = count
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Callers queued in ``take()``."""
        return len(self._waiters)

    @property
    def full(self) -> bool:
        """No slot can be had without waiting."""
        return self.free <= 0 or bool(self._waiters)

    def try_take(self) -> bool:
        """Take a slot if one is free and nobody is queued before us (FIFO stays fair)."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        """Take a slot, waiting in line for one. Cancellation-safe: a slot handed to a
        caller cancelled before it resumed goes to the next in line."""
        if self.try_take():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # handed over, but we are not taking it
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Give a slot back: straight to the first caller still waiting, else to the pool."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1
