"""Stopping the cluster's background tasks: one way, bounded, safe under cancellation."""

from __future__ import annotations

import asyncio
from typing import Any


async def stop(task: asyncio.Task[Any] | None, timeout: float = 2.0) -> None:
    """Cancel ``task`` if it still runs and wait up to ``timeout`` seconds for it to end.

    ``asyncio.wait`` neither raises the task's outcome nor swallows the caller's own
    cancellation, so an owner's ``aclose`` can call this from anywhere."""
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait({task}, timeout=timeout)
