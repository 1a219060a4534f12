"""What ``agentbox.async_commands`` and the ``agentbox.commands`` generated from it share
(no I/O here, so it needs no async and sync twin)."""

from __future__ import annotations

import time
from dataclasses import replace

from agentbox import _calls
from agentbox._transport import Call
from agentbox.exceptions import TimeoutError as AgentBoxTimeout

MAX_REATTACH = 5


def reattach_delay(attempt: int) -> float | None:
    """Seconds to wait before reattach attempt ``attempt`` (1-based), or None: give up."""
    return None if attempt > MAX_REATTACH else min(0.1 * 2 ** (attempt - 1), 2.0)


class _Deadline:
    def __init__(self, timeout: float | None) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        if self.end is None:
            return None
        left = self.end - time.monotonic()
        if left <= 0:
            raise AgentBoxTimeout("the command is still running (wait timed out)")
        return left


def _with_timeout(call: Call, seconds: float | None) -> Call:
    return replace(call, timeout=seconds)


def _cwd(cwd: str | None) -> str | None:
    return None if cwd is None else _calls.sandbox_path(cwd)
