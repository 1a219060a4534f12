"""The reaper's election against real etcd: one leader among three hosts; when the
leader's host is cut off another leads within about a TTL; the deposed leader's guarded
writes are refused; a cancelled campaign leaves no candidate key."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from gateway.cluster.election import Election, LeaderKey
from gateway.cluster.errors import OwnershipConflict
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.membership import Membership
from gateway.cluster.ownership import Ownership
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.sandbox.states import State
from tests.cluster.etcd_env import EtcdCluster, Member

TTL = 2


def test_one_reaper_and_a_cut_reaper_is_replaced_and_fenced(etcd3: EtcdCluster) -> None:
    keys = Keys(f"/{etcd3.prefix}")
    hosts: dict[str, tuple[Member, EtcdClient, Membership, Election]] = {}

    async def join(name: str, member: Member) -> tuple[EtcdClient, Membership, Election]:
        client = EtcdClient([member.client_url] + [m.client_url for m in etcd3.members
                                                   if m is not member],
                            timeout=2, attempt_timeout=0.5)
        host = Membership(client, keys, HostRecord(name, f"{member.ip}:8080"), TTL,
                          lambda reason: None)
        await host.join()
        return client, host, Election(client, keys, "reaper")

    for i, member in enumerate(etcd3.members):
        hosts[f"host-{i}"] = (member, *etcd3.loop(member.netns).run(join(f"host-{i}", member)))
    campaigns: dict[str, concurrent.futures.Future[LeaderKey]] = {
        name: etcd3.loop(m.netns).submit(e.campaign(h.lease, name))
        for name, (m, _, h, e) in hosts.items()}
    admin = EtcdClient(etcd3.endpoints, timeout=3)
    try:
        done, _ = concurrent.futures.wait(campaigns.values(), timeout=5,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        time.sleep(0.3)
        winners = [n for n, f in campaigns.items() if f.done()]
        assert len(winners) == 1, winners  # exactly one leads
        first = winners[0]
        first_key = campaigns[first].result()
        lookup = etcd3.loop().run(Election(admin, keys, "reaper").leader())
        assert lookup == (first_key, first.encode())
        # The leader's guarded move works while it leads.
        own = Ownership(admin, keys)
        record = etcd3.loop().run(own.create(
            SandboxRecord("sb1", first, State.SUSPENDED), hosts[first][2].lease))
        record = etcd3.loop().run(own.move(record, "host-x", State.SUSPENDED,
                                           (first_key.guard(),)))
        # Cut the leader's host: another candidate leads within about a TTL.
        t_cut = time.monotonic()
        etcd3.link(hosts[first][0], up=False)
        rest = {n: f for n, f in campaigns.items() if n != first}
        done, _ = concurrent.futures.wait(rest.values(), timeout=TTL + 5,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        took = time.monotonic() - t_cut
        assert len(done) == 1
        second = next(n for n, f in rest.items() if f.done())
        print(f"\n[election] {first} cut off; {second} leads {took:.2f} s later")
        assert took <= TTL + 3.0
        # The deposed leader's key no longer guards anything (as if its network came back).
        with pytest.raises(OwnershipConflict, match="guard failed"):
            etcd3.loop().run(own.move(record, "host-y", State.SUSPENDED,
                                      (first_key.guard(),)))
        etcd3.loop().run(own.move(record, "host-y", State.SUSPENDED,
                                  (campaigns[second].result().guard(),)))
        # The third candidate withdraws: its key goes, the leader stays.
        third = next(n for n in rest if n != second)
        campaigns[third].cancel()
        member, _, host, election = hosts[third]
        cand = election.candidate_key(host.lease)
        deadline = time.monotonic() + 3
        while etcd3.loop().run(admin.get(cand)) is not None:
            assert time.monotonic() < deadline, "the withdrawn candidate key stayed"
            time.sleep(0.05)
        assert etcd3.loop().run(Election(admin, keys, "reaper").leader())[1] == second.encode()
    finally:
        for future in campaigns.values():
            future.cancel()
        etcd3.loop().run(admin.aclose())
        for member, client, host, _ in hosts.values():
            etcd3.loop(member.netns).run(_close(host, client))


async def _close(*owners) -> None:
    for owner in owners:
        await owner.aclose()
