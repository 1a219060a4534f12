"""Idle raw connections to the apps in sandboxes, for reuse by later fast-lane exchanges.

Keyed by (sandbox, VMM pid, VMM start, address, port): a new VMM (a restore, a restart) has a
new key, so a connection to an old one is never reused, and the first connection given back for
the new VMM closes the old VMM's idle ones. Bounded by count per key (``POOL_MAX_IDLE``) and by
age (``POOL_IDLE_S``, one sweep timer for the pool); a sandbox no longer running loses its idle
connections at the next sweep (a stopped VMM's guest never sends the FIN).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.preview.fastlane.upstream import Upstream

POOL_MAX_IDLE = 64  # idle upstream connections per (sandbox, VMM, port)
POOL_IDLE_S = 15.0

class RawPool:
    """Idle upstream connections per (sandbox, VMM pid, VMM start, address, port): a new
    VMM has a new key, so connections to an old one are never reused (and die with it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connect_timeout: float,
                 running: Callable[[str], Any] | None = None) -> None:
        self.loop = loop
        self.running = running
        self.connect_timeout = connect_timeout
        self.idle: dict[tuple[Any, ...], list[Upstream]] = {}
        self.vmm: dict[str, tuple[Any, ...]] = {}  # the VMM each sandbox's connections reach
        self.sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    def take(self, key: tuple[Any, ...]) -> Upstream | None:
        conns = self.idle.get(key)
        while conns:
            up = conns.pop()
            if not up.lost:
                up.idle = False
                return up
        return None

    async def connect(self, key: tuple[Any, ...], host: str, port: int) -> Upstream:
        async with asyncio.timeout(self.connect_timeout):
            _, up = await self.loop.create_connection(lambda: Upstream(self, key), host, port)
        return up

    def give_back(self, up: Upstream) -> None:
        if self.closed or up.lost:
            up.close()
            return
        sandbox, vmm = up.key[0], up.key[1:3]
        if self.vmm.get(sandbox) != vmm:  # a new VMM: the old one's connections are dead
            self.vmm[sandbox] = vmm
            for key in [k for k in self.idle if k[0] == sandbox and k[1:3] != vmm]:
                for old in self.idle.pop(key):
                    old.close()
        conns = self.idle.setdefault(up.key, [])
        if len(conns) >= POOL_MAX_IDLE:
            up.close()
            return
        up.idle = True
        up.idle_since = self.loop.time()
        conns.append(up)
        if self.sweeper is None:
            self.sweeper = self.loop.call_later(POOL_IDLE_S, self._sweep)

    def forget(self, up: Upstream) -> None:
        conns = self.idle.get(up.key)
        if conns and up in conns:
            conns.remove(up)
            if not conns:
                del self.idle[up.key]

    def _sweep(self) -> None:
        """Close connections idle for POOL_IDLE_S, and those of sandboxes no longer running
        (a stopped VMM's guest never sends the FIN)."""
        self.sweeper = None
        cutoff = self.loop.time() - POOL_IDLE_S
        for key, conns in list(self.idle.items()):
            gone = self.running is not None and self.running(key[0]) is None
            for up in [u for u in conns if gone or u.idle_since <= cutoff]:
                conns.remove(up)
                up.close()
            if not conns:
                del self.idle[key]
        live = {key[0] for key in self.idle}
        self.vmm = {sandbox: vmm for sandbox, vmm in self.vmm.items() if sandbox in live}
        if self.idle:
            self.sweeper = self.loop.call_later(POOL_IDLE_S, self._sweep)

    def close(self) -> None:
        self.closed = True
        if self.sweeper is not None:
            self.sweeper.cancel()
        for conns in self.idle.values():
            for up in conns:
                up.close()
        self.idle.clear()
