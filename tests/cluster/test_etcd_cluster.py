"""The cluster foundation against a real 3-member etcd, one member per network namespace
(tests/cluster/etcd_env.py): compare-and-set fencing, a host cut off by its link losing its
record within the TTL and fencing itself first, writes resuming after the leader is killed,
and a watch that sees every change once while the member it streams from dies.

Measured figures are printed (run with -s) and bounded by the assertions.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, OwnershipConflict
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.membership import Membership, MemberState
from gateway.cluster.ownership import Ownership, Versioned
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.cluster.watch import Watcher
from gateway.sandbox.states import State
from tests.cluster.etcd_env import EtcdCluster, Member

TTL = 2


def _keys(etcd3: EtcdCluster) -> Keys:
    return Keys(f"/{etcd3.prefix}")


def _host(name: str, member: Member) -> HostRecord:
    return HostRecord(name, f"{member.ip}:8080", 16384, 16384, 8, 8, 0)


async def _put_until_ok(client: EtcdClient, key: str, value: str, budget: float = 10) -> int:
    """Retry through failover; a retried write may land twice, which the tests allow for."""
    deadline = time.monotonic() + budget
    while True:
        try:
            return await client.put(key, value)
        except ClusterError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


def test_real_etcd_answers_the_client(etcd3: EtcdCluster) -> None:
    async def scenario() -> None:
        client = EtcdClient(etcd3.endpoints)
        try:
            rev = await client.put("/x/a", b"\x00\xff")
            assert (await client.get("/x/a")).value == b"\x00\xff"
            lease, ttl = await client.lease_grant(TTL)
            assert ttl == TTL and (await client.lease_keepalive(lease)).ttl == TTL
            result = await client.txn([wire.compare("/x/a", wire.Target.MOD, rev)],
                                      [wire.op_put("/x/b", "1", lease)], [])
            assert result.succeeded
            assert (await client.get("/x/b")).lease == lease
            await client.lease_revoke(lease)
            assert await client.get("/x/b") is None  # went with its lease
            assert await client.delete("/x/", wire.prefix_end("/x/")) == 1
        finally:
            await client.aclose()
    etcd3.loop().run(scenario())


def test_a_stale_generation_cannot_write(etcd3: EtcdCluster) -> None:
    async def scenario() -> None:
        client = EtcdClient(etcd3.endpoints)
        keys, own = _keys(etcd3), Ownership(client, _keys(etcd3))
        hosts = {n: Membership(client, keys, _host(n, m), 10, lambda r: None)
                 for n, m in zip(("host-a", "host-b", "host-c"), etcd3.members, strict=True)}
        try:
            for member in hosts.values():
                await member.join()
            a, lease = hosts["host-a"], hosts["host-a"].lease
            v1 = await own.create(SandboxRecord("sb1", "host-a", State.RUNNING), lease)
            with pytest.raises(OwnershipConflict):  # one record per id
                await own.create(SandboxRecord("sb1", "host-b", State.RUNNING),
                                 hosts["host-b"].lease)
            v1 = await own.update(v1, a.lease, state=State.PAUSED)
            # Two movers read the same version: exactly one wins, the other sees the winner.
            results = await asyncio.gather(own.move(v1, "host-b", State.RESTORING),
                                           own.move(v1, "host-c", State.RESTORING),
                                           return_exceptions=True)
            won = [r for r in results if isinstance(r, Versioned)]
            lost = [r for r in results if isinstance(r, OwnershipConflict)]
            assert len(won) == 1 and len(lost) == 1, results
            assert won[0].record.gen == 2 and lost[0].current == won[0]
            # The old owner still holds generation 1: none of its writes land.
            with pytest.raises(OwnershipConflict, match="stale generation") as info:
                await own.update(v1, a.lease, state=State.SUSPENDED)
            assert info.value.current == won[0]
            with pytest.raises(OwnershipConflict):
                await own.delete(v1, a.lease)
            # The new owner writes in its generation, until its lease goes.
            owner = hosts[won[0].record.host]
            v2 = await own.update(won[0], owner.lease, state=State.RUNNING)
            assert v2.record.gen == 2 and v2.mod_revision > won[0].mod_revision
            await owner.aclose()  # lease revoked: its host record is gone
            with pytest.raises(OwnershipConflict, match="lease"):
                await own.update(v2, owner.lease, state=State.SUSPENDED)
            assert await own.get("sb1") == v2
            with pytest.raises(OwnershipConflict):  # another host's lease is no key either
                await own.update(v2, a.lease, state=State.SUSPENDED)
        finally:
            for member in hosts.values():
                await member.aclose()
            await client.aclose()
    etcd3.loop().run(scenario())


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_a_cut_host_fences_itself_then_its_record_expires(etcd3: EtcdCluster,
                                                          victim: str) -> None:
    leader = etcd3.wait_leader()
    cut = leader if victim == "leader" else next(m for m in etcd3.members if m is not leader)
    other = next(m for m in etcd3.members if m is not cut)
    keys = _keys(etcd3)
    endpoints = [cut.client_url] + [m.client_url for m in etcd3.members if m is not cut]
    fenced: list[tuple[float, str]] = []

    async def join(name: str, member: Member) -> tuple[EtcdClient, Membership]:
        client = EtcdClient([member.client_url] + [e for e in endpoints
                                                   if e != member.client_url],
                            timeout=2, attempt_timeout=0.5)
        host = Membership(client, keys, _host(name, member), TTL,
                          lambda r: fenced.append((time.monotonic(), r)))
        await host.join()
        return client, host

    # Each host runs in its member's namespace, so the cut takes the host and its member.
    cut_client, cut_host = etcd3.loop(cut.netns).run(join("host-cut", cut))
    ok_client, ok_host = etcd3.loop(other.netns).run(join("host-ok", other))
    seen: list[tuple[float, wire.Event]] = []

    async def observe() -> tuple[EtcdClient, Watcher]:
        client = EtcdClient(endpoints, timeout=2, attempt_timeout=0.5)
        listing = await client.get_prefix(keys.hosts)
        assert len(listing.kvs) == 2
        watcher = Watcher(client, keys.hosts, keys.range_end(keys.hosts), listing.revision + 1,
                          lambda evs: seen.extend((time.monotonic(), e) for e in evs),
                          name="observer", probe_after=0.5)  # streams from the cut member
        watcher.start()
        await asyncio.wait_for(watcher.ready.wait(), 5)
        return client, watcher

    obs_client, watcher = etcd3.loop().run(observe())
    survivors = EtcdClient([m.client_url for m in etcd3.members if m is not cut], timeout=1,
                           attempt_timeout=0.3)
    time.sleep(1.0)  # a few renewals
    t_cut = time.monotonic()
    etcd3.link(cut, up=False)
    gone_at = None
    while time.monotonic() - t_cut < 10:
        if etcd3.loop().run(survivors.get(keys.host("host-cut"))) is None:
            gone_at = time.monotonic()
            break
        time.sleep(0.02)
    deadline = time.monotonic() + 5
    while not any(e.type is wire.EventType.DELETE for _, e in seen) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    deleted = [t for t, e in seen if e.type is wire.EventType.DELETE]
    try:
        assert gone_at is not None, etcd3.logs()
        assert fenced, "the cut host never fenced itself"
        fence_s, record_s = fenced[0][0] - t_cut, gone_at - t_cut
        print(f"\n[{victim} cut] host fenced after {fence_s:.2f} s ({fenced[0][1]}); record "
              f"gone after {record_s:.2f} s; observer's watch saw the delete after "
              f"{deleted[0] - t_cut if deleted else float('nan'):.2f} s "
              f"(reconnects: {watcher.reconnects})")
        # The host stops serving within one TTL of the cut (a cut leader's own renewals do
        # not count: gateway.cluster.lease), and before anyone can see it gone.
        assert fence_s <= TTL
        assert fenced[0][0] < gone_at
        # A follower's host: the lease runs out TTL after its last renewal. A leader's: the
        # majority first elects a leader (one to two election timeouts, 0.5-1 s), which then
        # restarts every lease's countdown plus one election timeout; etcd checks for expired
        # leases every 0.5 s.
        assert record_s <= TTL + (3.0 if victim == "leader" else 1.0)
        assert len(fenced) == 1 and cut_host.state is MemberState.FENCED
        assert deleted and watcher.reconnects >= 1  # it left the silent member
        assert [e.kv.key for _, e in seen] == [keys.host("host-cut").encode()]
        assert ok_host.state is MemberState.SERVING  # the other host never noticed
        assert etcd3.loop().run(survivors.get(keys.host("host-ok"))) is not None
    finally:
        etcd3.loop().run(_close(watcher, obs_client, survivors))
        etcd3.loop(other.netns).run(_close(ok_host, ok_client))
        etcd3.loop(cut.netns).run(_close(cut_host, cut_client))


async def _close(*owners) -> None:
    for owner in owners:
        await owner.aclose()


def test_writes_resume_soon_after_the_leader_is_killed(etcd3: EtcdCluster) -> None:
    leader = etcd3.wait_leader()
    endpoints = [leader.client_url] + [m.client_url for m in etcd3.members if m is not leader]

    async def scenario() -> tuple[float, int]:
        client = EtcdClient(endpoints, timeout=0.5, attempt_timeout=0.25)
        try:
            await client.put("/k", "before")
            await asyncio.get_running_loop().run_in_executor(None, etcd3.kill, leader)
            killed, failures = time.monotonic(), 0
            while True:
                try:
                    await client.put("/k", "after")
                    return time.monotonic() - killed, failures
                except ClusterError:
                    failures += 1
                    await asyncio.sleep(0.01)
        finally:
            await client.aclose()

    gap, failures = etcd3.loop().run(scenario())
    new_leader = etcd3.wait_leader()
    print(f"\n[leader kill] first write {gap:.2f} s after the kill ({failures} failed tries); "
          f"new leader {new_leader.name}")
    assert new_leader is not leader
    assert gap < 2.0


def test_a_watch_sees_every_change_once_while_its_member_dies(etcd3: EtcdCluster) -> None:
    async def scenario() -> None:
        writer = EtcdClient(etcd3.endpoints, timeout=5, attempt_timeout=0.3)
        reader = EtcdClient(etcd3.endpoints, timeout=5, attempt_timeout=0.3)
        seen: list[wire.Event] = []
        base = await writer.put("/w/base", "x")
        watcher = Watcher(reader, "/w/", wire.prefix_end("/w/"), base + 1, seen.extend,
                          name="w", probe_after=0.5)
        watcher.start()
        try:
            await asyncio.wait_for(watcher.ready.wait(), 5)
            streaming_from = next(m for m in etcd3.members
                                  if m.client_url == watcher.streaming_from)
            for i in range(60):
                if i == 20:
                    await asyncio.get_running_loop().run_in_executor(
                        None, etcd3.kill, streaming_from)
                await _put_until_ok(writer, f"/w/k{i:03d}", str(i))
            last = (await writer.get_prefix("/w/")).revision
            async with asyncio.timeout(10):
                while watcher.next_revision <= last:
                    await asyncio.sleep(0.02)
            # etcd's own history of the prefix, read afresh from a surviving member:
            history = await _history(writer, base + 1, last)
            assert [e.kv.mod_revision for e in seen] == [e.kv.mod_revision for e in history]
            assert [e.kv.key for e in seen] == [e.kv.key for e in history]
            assert len(history) >= 60 and watcher.reconnects >= 1
            assert watcher.exception is None
        finally:
            await watcher.aclose()
            await writer.aclose()
            await reader.aclose()
    etcd3.loop().run(scenario())


async def _history(client: EtcdClient, start: int, last: int) -> list[wire.Event]:
    index = next(i for i in client.order())
    out: list[wire.Event] = []
    async with asyncio.timeout(10):
        async for batch in client.watch_stream(index, wire.watch_body(
                "/w/", wire.prefix_end("/w/"), start, progress_notify=False)):
            out.extend(batch.events)
            if out and out[-1].kv.mod_revision >= last:
                return out
    raise AssertionError("history stream ended early")
