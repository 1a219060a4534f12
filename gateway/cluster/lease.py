"""Keep one etcd lease alive, and say so the moment it can no longer be trusted.

etcd expires a lease on the leader's clock, TTL seconds after the leader last heard a
renewal. The client cannot see that clock, but it knows when it *sent* each renewal that
was acknowledged: the leader heard it no earlier, so ``sent + ttl`` is never later than the
real expiry. ``LeaseClock`` (no I/O) keeps that bound minus a safety margin, and
``LeaseKeeper`` (one owned task) renews every third of the TTL, retries failures quickly,
and calls ``on_lost`` exactly once when the bound passes or etcd says the lease is gone,
even while a renewal is still in flight. A host that stops serving on ``on_lost`` has
stopped before etcd deletes its keys and anyone else may take over its sandboxes.

One catch, measured in tests/cluster: etcd 3.4 renews a lease on whichever member thinks it
is the leader, without checking it still has a quorum. A leader cut off from the others
keeps acknowledging renewals until it steps down (up to about two election timeouts), while
the majority elects a new leader whose clock for the lease started at its election. So a
renewal only counts once a linearizable read *after* it (which does need a quorum) comes
back in the same raft term: that leader was still the leader after the renewal was sent, so
no later leader's countdown can have started before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gateway.cluster.errors import ClusterError, EtcdUnavailable, LeaseNotFound
from gateway.cluster.etcd import EtcdClient
from gateway.cluster import tasks

log = logging.getLogger(__name__)


@dataclass
class LeaseClock:
    """When to renew and when to give the lease up, on the local monotonic clock."""

    ttl: float
    expires_at: float  # the latest acknowledged send time + its TTL: never after etcd's expiry
    margin_fraction: float = 0.1

    @classmethod
    def granted(cls, sent_at: float, ttl: float) -> LeaseClock:
        return cls(ttl=ttl, expires_at=sent_at + ttl)

    @property
    def fence_at(self) -> float:
        """Give up here: a margin before the bound, for clocks that drift apart."""
        return self.expires_at - self.ttl * self.margin_fraction

    @property
    def renew_every(self) -> float:
        return self.ttl / 3

    @property
    def retry_every(self) -> float:
        return max(0.05, self.ttl / 20)

    def renewed(self, sent_at: float, ttl: float) -> None:
        self.ttl = ttl
        self.expires_at = max(self.expires_at, sent_at + ttl)

    def expired(self, now: float) -> bool:
        return now >= self.fence_at


class LeaseKeeper:
    """Renews ``lease`` until closed or lost; ``on_lost(reason)`` runs once, synchronously."""

    def __init__(self, client: EtcdClient, lease: int, clock: LeaseClock,
                 on_lost: Callable[[str], None], *, name: str) -> None:
        self.client, self.lease, self.clock = client, lease, clock
        self.on_lost, self.name = on_lost, name
        self.lost_reason: str | None = None
        self.renewals = 0
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = f"lost ({self.lost_reason})" if self.lost_reason else "alive"
        return f"<LeaseKeeper {self.name} {self.lease:x} {state}>"

    @property
    def alive(self) -> bool:
        return self.lost_reason is None and not self.clock.expired(_now())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"etcd-lease:{self.name}")

    async def aclose(self, timeout: float = 2.0) -> None:
        """Idempotent: stop renewing (the lease then expires unless revoked)."""
        task, self._task = self._task, None
        await tasks.stop(task, timeout)

    async def _run(self) -> None:
        """Fails safe: if the loop itself breaks (a bug), the lease counts as lost."""
        try:
            await self._renew_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("lease %s keeper failed", self.name)
            self._lose(f"the lease keeper failed: {exc!r}")

    async def _renew_loop(self) -> None:
        delay = self.clock.renew_every
        while True:
            await asyncio.sleep(max(0.0, min(delay, self.clock.fence_at - _now())))
            if self.clock.expired(_now()):
                return self._lose("not renewed within its TTL")
            sent = _now()
            try:
                async with asyncio.timeout_at(self.clock.fence_at):
                    ttl = await self._renew()
            except TimeoutError:
                return self._lose("not renewed within its TTL")
            except LeaseNotFound:
                return self._lose("etcd says the lease is gone")
            except ClusterError as exc:
                log.info("lease %s renewal failed (retrying): %s", self.name, exc)
                delay = self.clock.retry_every
                continue
            self.clock.renewed(sent, ttl)
            self.renewals += 1
            delay = self.clock.renew_every

    async def _renew(self) -> int:
        """One renewal, confirmed by a quorum read in the same term; returns the TTL."""
        renewal = await self.client.lease_keepalive(self.lease)
        confirm = await self.client.range(b"\0", limit=1)
        if confirm.raft_term != renewal.raft_term:
            raise EtcdUnavailable(f"leader changed during the renewal (term "
                                  f"{renewal.raft_term} -> {confirm.raft_term})")
        return renewal.ttl

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        log.warning("lease %s lost: %s", self.name, reason)
        try:
            self.on_lost(reason)
        except Exception:
            log.exception("on_lost callback of lease %s failed", self.name)


def _now() -> float:
    return asyncio.get_running_loop().time()
