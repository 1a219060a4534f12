"""Election pieces without etcd: the leader key, the guard a leader's writes carry, and
withdrawing a cancelled campaign. (tests/cluster/test_election.py runs the real thing.)"""

from __future__ import annotations

import asyncio

import pytest

from gateway.cluster import wire
from gateway.cluster.election import Election, LeaderKey
from gateway.cluster.errors import EtcdRequestError, OwnershipConflict
from gateway.cluster.keys import Keys
from gateway.cluster.ownership import Versioned, outcome, plan_move
from gateway.cluster.records import SandboxRecord
from gateway.sandbox.states import State

KEYS = Keys("/t")
LEADER = LeaderKey(b"/t/elections/reaper", b"/t/elections/reaper/1f", 12, 0x1F)


def test_leader_key_round_trip_and_guard() -> None:
    assert LeaderKey.decode(LEADER.encode()) == LEADER
    guard = LEADER.guard()
    assert guard["target"] == "CREATE" and guard["create_revision"] == "12"
    assert wire.unb64(guard["key"]) == b"/t/elections/reaper/1f"


def test_a_guarded_move_that_loses_only_its_guard_says_so() -> None:
    current = Versioned(SandboxRecord("sb1", "host-a", State.SUSPENDED), 30)
    plan = plan_move(KEYS, current, "host-b", State.RESTORING, (LEADER.guard(),))
    assert len(plan.compares) == 2
    same = wire.KeyValue(b"k", current.record.encode(), 1, 30, 1, 0)
    result = wire.TxnResult(40, False, (wire.RangeResult(40, (same,), 1, False),))
    with pytest.raises(OwnershipConflict, match="guard failed"):
        outcome(plan, result)


class _Client:
    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.leader_error = False

    async def blocking_call(self, path, body):
        await asyncio.sleep(3600)

    async def delete(self, key) -> int:
        self.deleted.append(key)
        return 1

    async def call(self, path, body, idempotent=False):
        if self.leader_error:
            raise EtcdRequestError("election: no leader", 2, 500)
        return {"kv": {"key": wire.b64("/t/elections/reaper/1f"), "create_revision": "12",
                       "lease": str(0x1F), "value": wire.b64("host-a")}}


async def test_a_cancelled_campaign_withdraws_its_candidate_key() -> None:
    client = _Client()
    election = Election(client, KEYS, "reaper")
    task = asyncio.create_task(election.campaign(0x1F, "host-a"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.deleted == ["/t/elections/reaper/1f"]


async def test_leader_lookup() -> None:
    client = _Client()
    election = Election(client, KEYS, "reaper")
    assert await election.leader() == (LEADER, b"host-a")
    client.leader_error = True
    assert await election.leader() is None
