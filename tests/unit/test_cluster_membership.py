"""Membership's state machine with a scripted etcd: join, name clash, fencing once, leave.
(tests/cluster runs it against real etcd members and a cut link.)"""

from __future__ import annotations

import asyncio

import pytest

from gateway.cluster import wire
from gateway.cluster.errors import Fenced, LeaseNotFound
from gateway.cluster.keys import Keys
from gateway.cluster.membership import HostNameTaken, Membership, MemberState
from gateway.cluster.records import HostRecord

HOST = HostRecord("host-a", "10.0.0.1:8080", 8192, 8192, 4, 4, 0)


class _Client:
    def __init__(self, name_free: bool = True) -> None:
        self.name_free, self.revoked, self.txns = name_free, [], []
        self.keepalive_gone = False

    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        return 0xAB, ttl

    async def txn(self, compares, success, failure=None) -> wire.TxnResult:
        self.txns.append((compares, success))
        return wire.TxnResult(revision=2, succeeded=self.name_free, responses=())

    async def lease_keepalive(self, lease: int) -> wire.KeepAlive:
        if self.keepalive_gone:
            raise LeaseNotFound("gone")
        return wire.KeepAlive(2, 1)

    async def range(self, key, limit: int = 0) -> wire.RangeResult:
        return wire.RangeResult(1, (), 0, False, raft_term=1)

    async def lease_revoke(self, lease: int) -> None:
        self.revoked.append(lease)


async def test_join_publishes_on_the_lease_and_leave_revokes_it() -> None:
    client = _Client()
    member = Membership(client, Keys("/t"), HOST, 2, on_fenced=lambda r: None)
    await member.join()
    assert member.state is MemberState.SERVING and member.lease == 0xAB
    compares, success = client.txns[0]
    assert compares[0]["target"] == "CREATE"
    assert success[0]["request_put"]["lease"] == str(0xAB)
    member.check()
    await member.publish(HostRecord("host-a", "10.0.0.1:8080", 8192, 4096, 4, 3, 1))
    assert client.txns[1][0][0]["target"] == "LEASE" and member.record.awake == 1
    await member.aclose()
    await member.aclose()
    assert member.state is MemberState.CLOSED and client.revoked == [0xAB]
    with pytest.raises(Fenced):
        member.check()


async def test_a_live_host_with_the_same_name_refuses_the_join() -> None:
    client = _Client(name_free=False)
    member = Membership(client, Keys("/t"), HOST, 2, on_fenced=lambda r: None)
    with pytest.raises(HostNameTaken):
        await member.join()
    assert client.revoked == [0xAB]  # the lease it took is given back
    assert member.state is MemberState.JOINING


async def test_losing_the_lease_fences_once_and_stops_publishing() -> None:
    client = _Client()
    fenced: list[str] = []
    member = Membership(client, Keys("/t"), HOST, 2, on_fenced=fenced.append)
    await member.join()
    client.keepalive_gone = True
    for _ in range(200):
        if fenced:
            break
        await asyncio.sleep(0.01)
    assert fenced == ["etcd says the lease is gone"]
    assert member.state is MemberState.FENCED
    with pytest.raises(Fenced, match="fenced: etcd says"):
        await member.publish(HOST)
    await member.aclose()
    assert client.revoked == []  # nothing to revoke: the lease is already gone
    assert fenced == ["etcd says the lease is gone"]


async def test_rename_is_refused() -> None:
    member = Membership(_Client(), Keys("/t"), HOST, 2, on_fenced=lambda r: None)
    await member.join()
    with pytest.raises(ValueError):
        await member.publish(HostRecord("host-b", "x:1"))
    await member.aclose()
