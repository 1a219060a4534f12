"""This host's membership: its record on a lease, kept alive, and fencing when it is not.

Theory: a host is in the cluster exactly while ``{prefix}/hosts/{name}`` exists, and that
key is attached to the host's lease, so etcd deletes it TTL seconds after the host stops
renewing (crash, partition, a stuck process). Every other host's view of liveness is that
key, nothing of our own. The host itself watches the same lease from its side
(``gateway.cluster.lease``): when it cannot renew within the TTL it moves to FENCED and
calls ``on_fenced``, which must stop it acting as an owner (serving or changing its
sandboxes). Because the keeper's bound is never later than etcd's expiry, the host has
stopped before others can see it gone. FENCED is terminal for this object: rejoining means
a new lease and re-reading what the host still owns (not built yet).

    JOINING --join ok--> SERVING --lease lost--> FENCED
       |                    |                       |
       +-----aclose---------+--------aclose---------+--> CLOSED
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, Fenced
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.lease import LeaseClock, LeaseKeeper
from gateway.cluster.records import HostRecord

log = logging.getLogger(__name__)


class MemberState(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    FENCED = "fenced"
    CLOSED = "closed"


_ALLOWED = {
    MemberState.JOINING: {MemberState.SERVING, MemberState.CLOSED},
    MemberState.SERVING: {MemberState.FENCED, MemberState.CLOSED},
    MemberState.FENCED: {MemberState.CLOSED},
    MemberState.CLOSED: set(),
}


class HostNameTaken(ClusterError):
    """Another live host holds this name (its record is on a lease that is not ours)."""


class Membership:
    def __init__(self, client: EtcdClient, keys: Keys, record: HostRecord, ttl: int,
                 on_fenced: Callable[[str], None]) -> None:
        self.client, self.keys, self.record, self.ttl = client, keys, record, ttl
        self.on_fenced = on_fenced
        self.state = MemberState.JOINING
        self.lease = 0
        self.fenced_reason: str | None = None
        self._keeper: LeaseKeeper | None = None

    def __repr__(self) -> str:
        return f"<Membership {self.record.name} {self.state.name} lease={self.lease:x}>"

    @property
    def key(self) -> str:
        return self.keys.host(self.record.name)

    def _to(self, new: MemberState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"membership {self.state.name} -> {new.name} is not allowed")
        self.state = new

    def check(self) -> None:
        """Raise ``Fenced`` unless this host may act as an owner right now."""
        if self.state is not MemberState.SERVING or not (self._keeper and self._keeper.alive):
            raise Fenced(f"host {self.record.name} is {self.state.name.lower()}"
                         + (f": {self.fenced_reason}" if self.fenced_reason else ""))

    async def join(self) -> None:
        """Grant a lease, create our record on it (only if no live host has the name), and
        start renewing. Raises HostNameTaken, or a ClusterError if etcd is unreachable."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        self.lease, granted = await self.client.lease_grant(self.ttl)
        try:
            result = await self.client.txn(
                [wire.compare(self.key, wire.Target.CREATE, 0)],
                [wire.op_put(self.key, self.record.encode(), self.lease)],
                [wire.op_get(self.key)])
            if not result.succeeded:
                raise HostNameTaken(f"host name {self.record.name!r} is held by a live host")
        except BaseException:
            await self._revoke()
            raise
        clock = LeaseClock.granted(sent, float(granted))
        self._keeper = LeaseKeeper(self.client, self.lease, clock, self._lost,
                                   name=self.record.name)
        self._to(MemberState.SERVING)
        self._keeper.start()

    async def publish(self, record: HostRecord) -> None:
        """Replace our record (new load figures), only while it is still on our lease."""
        self.check()
        if record.name != self.record.name:
            raise ValueError("a host cannot rename itself")
        result = await self.client.txn(
            [wire.compare(self.key, wire.Target.LEASE, self.lease)],
            [wire.op_put(self.key, record.encode(), self.lease)])
        if not result.succeeded:
            raise Fenced(f"host {record.name}'s record is no longer on its lease")
        self.record = record

    def _lost(self, reason: str) -> None:
        if self.state is not MemberState.SERVING:
            return
        self.fenced_reason = reason
        self._to(MemberState.FENCED)
        log.error("host %s fenced: %s", self.record.name, reason)
        self.on_fenced(reason)

    async def aclose(self) -> None:
        """Leave: stop renewing and revoke the lease, so the record goes at once rather than
        after the TTL. Idempotent; bounded even when etcd is unreachable."""
        if self.state is MemberState.CLOSED:
            return
        was_serving = self.state is MemberState.SERVING
        self._to(MemberState.CLOSED)
        if self._keeper is not None:
            await self._keeper.aclose()
        if was_serving:
            await self._revoke()

    async def _revoke(self) -> None:
        if not self.lease:
            return
        with contextlib.suppress(ClusterError, TimeoutError):
            async with asyncio.timeout(2.0):
                await self.client.lease_revoke(self.lease)
