"""One leader among the hosts (the reaper, later), by etcd's own election API.

Theory: a host campaigns (``/v3/election/campaign``) with its host lease. etcd puts a
candidate key ``{prefix}/elections/{name}/{lease in hex}`` on that lease and answers once it
is the oldest key under the name: that candidate leads. Leadership lasts exactly as long as
the lease, so a dead or cut-off host loses it within a TTL, just as it loses its host
record. A leader is only told when it *became* leader, so every write it makes as leader
carries ``LeaderKey.guard()``: its candidate key must still exist with the revision it was
created at. A deposed leader that has not noticed yet (its lease expired, someone else won)
has its writes refused by etcd.

A campaign blocks until won; cancelling it withdraws the candidacy (etcd drops a cancelled
campaign's key itself; we also delete it, bounded, in case the cancel raced the answer).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, EtcdRequestError, ProtocolError
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaderKey:
    name: bytes
    key: bytes
    rev: int  # the candidate key's create revision
    lease: int

    @classmethod
    def decode(cls, raw: Any) -> LeaderKey:
        if not isinstance(raw, dict):
            raise ProtocolError("election: no leader key in the answer")
        return cls(wire.unb64(raw.get("name", "")), wire.unb64(raw.get("key", "")),
                   wire.as_int(raw.get("rev")), wire.as_int(raw.get("lease")))

    def encode(self) -> dict[str, str]:
        return {"name": wire.b64(self.name), "key": wire.b64(self.key), "rev": str(self.rev),
                "lease": str(self.lease)}

    def guard(self) -> dict[str, Any]:
        """A txn compare that holds only while this leadership does."""
        return wire.compare(self.key, wire.Target.CREATE, self.rev)


class Election:
    def __init__(self, client: EtcdClient, keys: Keys, name: str) -> None:
        self.client = client
        self.name = keys.election(name)
        self._cleanups: set[asyncio.Task[None]] = set()

    def candidate_key(self, lease: int) -> str:
        return f"{self.name}/{lease:x}"  # etcd's own naming (clientv3/concurrency)

    async def campaign(self, lease: int, value: bytes | str) -> LeaderKey:
        """Wait until this candidate (on ``lease``) leads. LeaseNotFound if the lease dies."""
        body = {"name": wire.b64(self.name), "lease": str(lease), "value": wire.b64(value)}
        try:
            answer = await self.client.blocking_call("/v3/election/campaign", body)
        except BaseException:
            await self._withdraw(lease)
            raise
        return LeaderKey.decode(answer.get("leader"))

    async def _withdraw(self, lease: int) -> None:
        """Delete our candidate key, finishing even if the caller is cancelled again."""
        async def delete() -> None:
            try:
                async with asyncio.timeout(2.0):
                    await self.client.delete(self.candidate_key(lease))
            except (ClusterError, TimeoutError) as exc:
                log.warning("election %s: withdrawing failed (the lease ends it): %s",
                            self.name, exc)
        task = asyncio.create_task(delete(), name=f"election-withdraw:{self.name}")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def leader(self) -> tuple[LeaderKey, bytes] | None:
        """The current leader and its value, or None when nobody leads."""
        try:
            answer = await self.client.call("/v3/election/leader",
                                            {"name": wire.b64(self.name)}, idempotent=True)
        except EtcdRequestError as exc:
            if "election: no leader" in str(exc):
                return None
            raise
        kv = wire.decode_kv(answer.get("kv", {}))
        return LeaderKey(self.name.encode(), kv.key, kv.create_revision, kv.lease), kv.value

    async def resign(self, leader: LeaderKey) -> None:
        """Step down (the next candidate leads at once rather than after our TTL)."""
        await self.client.call("/v3/election/resign", {"leader": leader.encode()},
                               idempotent=True)
