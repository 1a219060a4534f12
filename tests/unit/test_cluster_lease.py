"""Lease keeping: the conservative expiry bound, renewals, and fencing exactly once, even
while a renewal hangs."""

from __future__ import annotations

import asyncio

from gateway.cluster import wire
from gateway.cluster.errors import EtcdUnavailable, LeaseNotFound
from gateway.cluster.lease import LeaseClock, LeaseKeeper


def test_clock_bound_comes_from_the_send_time() -> None:
    clock = LeaseClock.granted(sent_at=100.0, ttl=3.0)
    assert clock.expires_at == 103.0 and abs(clock.fence_at - 102.7) < 1e-9
    clock.renewed(sent_at=101.0, ttl=3.0)
    assert clock.expires_at == 104.0
    clock.renewed(sent_at=100.5, ttl=3.0)  # an older renewal answered late: no going back
    assert clock.expires_at == 104.0
    assert not clock.expired(103.6) and clock.expired(103.7)
    assert clock.renew_every == 1.0 and clock.retry_every == 0.15


class _Client:
    def __init__(self, script, ttl: float = 0.3) -> None:
        self.script = script  # "ok" | "hang" | "gone" | "down", the last one repeats
        self.calls, self.ttl = 0, ttl
        self.term, self.read_term = 3, 3

    async def lease_keepalive(self, lease: int) -> int:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if step == "hang":
            await asyncio.sleep(3600)
        if step == "gone":
            raise LeaseNotFound("gone")
        if step == "down":
            raise EtcdUnavailable("down")
        return wire.KeepAlive(self.ttl, self.term)  # type: ignore[arg-type]  (whole seconds)

    async def range(self, key, limit: int = 0) -> wire.RangeResult:
        return wire.RangeResult(1, (), 0, False, raft_term=self.read_term)


def _keeper(client, ttl: float, lost: list[str]) -> LeaseKeeper:
    now = asyncio.get_running_loop().time()
    return LeaseKeeper(client, 1, LeaseClock.granted(now, ttl), lost.append, name="t")


async def test_renews_while_etcd_answers() -> None:
    lost: list[str] = []
    keeper = _keeper(_Client(["ok"]), 0.3, lost)
    keeper.start()
    await asyncio.sleep(0.5)
    assert keeper.alive and keeper.renewals >= 3 and lost == []
    await keeper.aclose()
    await keeper.aclose()  # idempotent


async def test_a_hanging_renewal_still_fences_within_the_ttl() -> None:
    lost: list[str] = []
    loop = asyncio.get_running_loop()
    keeper = _keeper(_Client(["hang"]), 0.4, lost)
    start = loop.time()
    keeper.start()
    while not lost and loop.time() - start < 2:
        await asyncio.sleep(0.01)
    took = loop.time() - start
    assert lost == ["not renewed within its TTL"] and not keeper.alive
    assert 0.3 <= took < 0.4  # at fence_at: before etcd's own expiry
    await keeper.aclose()


async def test_failures_are_retried_until_the_bound_then_lost_once() -> None:
    lost: list[str] = []
    client = _Client(["ok", "down"])
    keeper = _keeper(client, 0.3, lost)
    keeper.start()
    await asyncio.sleep(0.8)
    assert lost == ["not renewed within its TTL"]
    assert client.calls > 3  # retried several times, quickly
    await keeper.aclose()


async def test_etcd_saying_gone_fences_at_once() -> None:
    lost: list[str] = []
    keeper = _keeper(_Client(["gone"]), 3.0, lost)
    keeper.start()
    await asyncio.sleep(1.2)  # one renewal period
    assert lost == ["etcd says the lease is gone"]
    await keeper.aclose()


async def test_aclose_cancels_a_renewal_in_flight() -> None:
    lost: list[str] = []
    keeper = _keeper(_Client(["hang"]), 30.0, lost)
    keeper.start()
    await asyncio.sleep(0)
    await asyncio.wait_for(keeper.aclose(), 1)
    assert lost == [] and keeper._task is None


async def test_a_renewal_from_a_deposed_leader_does_not_count() -> None:
    """The renewal's term is not the term of the quorum read after it: an old leader cut off
    from the majority acknowledged it, so the bound must not move."""
    lost: list[str] = []
    client = _Client(["ok"])
    client.read_term = 4
    keeper = _keeper(client, 0.3, lost)
    keeper.start()
    await asyncio.sleep(0.5)
    assert lost == ["not renewed within its TTL"] and client.calls > 2
    await keeper.aclose()


async def test_a_broken_keeper_fails_safe() -> None:
    lost: list[str] = []

    class Broken(_Client):
        async def lease_keepalive(self, lease: int):
            raise KeyError("a bug")

    keeper = _keeper(Broken(["ok"]), 0.3, lost)
    keeper.start()
    await asyncio.sleep(0.2)
    assert lost == ["the lease keeper failed: KeyError('a bug')"] and not keeper.alive
    await keeper.aclose()
