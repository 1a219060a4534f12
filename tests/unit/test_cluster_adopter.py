"""The adopter: which records it adopts or evicts (no I/O), and what it does when the
sandbox layer fails (the record FAILED with the reason by compare-and-set; an unreachable
object store retried first). The sandbox layer and etcd are fakes here; the real thing is
tests/unit/test_sandbox_adoption.py and tests/cluster/test_adoption.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.cluster.adopter import Adopter, Do, Local, decide
from gateway.cluster.objstore import ObjectStoreError
from gateway.cluster.ownership import Versioned
from gateway.cluster.records import SandboxRecord
from gateway.cluster.shipping import SnapshotRefused
from gateway.sandbox.states import State

SNAP = "p/snapshots/s/0123#" + "a" * 64
S = State


@pytest.mark.parametrize("record,local,adoptable,expect", [
    (SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP), None, True, Do.ADOPT),
    (SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP), None, False, None),  # destroyed here
    (SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP), S.SUSPENDED, False, None),  # ours
    (SandboxRecord("s", "me", S.SUSPENDED, 2, ""), None, True, None),  # nothing shipped
    (SandboxRecord("s", "me", S.FAILED, 2, SNAP), None, True, None),  # no reason: not moved
    # FAILED with a reason (the reaper moved it here off a dead host, or an adoption
    # failed): registered here FAILED, with its last disk or with nothing
    (SandboxRecord("s", "me", S.FAILED, 2, SNAP, reason="host a died"), None, True, Do.ADOPT),
    (SandboxRecord("s", "me", S.FAILED, 2, "", reason="host a died"), None, True, Do.ADOPT),
    (SandboxRecord("s", "me", S.FAILED, 2, "", reason="host a died"), S.FAILED, False, None),
    (SandboxRecord("s", "me", S.FAILED, 2, "", reason="x"), None, False, None),  # deleted here
    (SandboxRecord("s", "me", S.RUNNING, 1), S.RUNNING, False, None),
    (SandboxRecord("s", "other", S.SUSPENDED, 3, SNAP), S.SUSPENDED, False, Do.EVICT),
    (SandboxRecord("s", "other", S.RUNNING, 3), S.RUNNING, False, Do.EVICT),
    (SandboxRecord("s", "other", S.RUNNING, 3), None, False, None),
])
def test_decide(record, local, adoptable, expect):
    assert decide("me", record, local, adoptable) is expect


class FakeOwnership:
    def __init__(self, record):
        self.current = Versioned(record, 10)
        self.updates = []

    async def get(self, sandbox_id):
        return self.current

    async def update(self, current, lease, **changes):
        assert current.mod_revision == self.current.mod_revision and lease == 7
        self.updates.append(changes)
        self.current = Versioned(dataclasses.replace(current.record, **changes), 11)
        return self.current


def make(record, adopt, rows=None):
    rows = {} if rows is None else rows
    evicted = []

    async def evict(sandbox_id, holder):
        evicted.append((sandbox_id, holder))
        rows.pop(sandbox_id, None)
        return True

    local = Local(state=rows.get, adoptable=lambda sid: sid not in rows, adopt=adopt,
                  evict=evict, bases=lambda: {"b" * 64})
    own = FakeOwnership(record)
    return Adopter("me", object(), own, lambda: 7, local, backoff=0.01), own, evicted


async def settle(adopter):
    while adopter.working:
        await asyncio.sleep(0.01)


async def test_a_record_moved_here_is_adopted_once():
    record = SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP, base="b" * 64)
    calls = []

    async def adopt(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        calls.append((sandbox_id, base))
        await asyncio.sleep(0.05)
    adopter, own, _ = make(record, adopt)
    adopter.consider(record)
    adopter.consider(record)  # the watch repeats itself: one adoption per sandbox
    adopter.scan([record])
    await settle(adopter)
    assert calls == [("s", "b" * 64)] and adopter.adopted == ["s"] and not own.updates


async def test_a_refused_snapshot_marks_the_record_failed_with_the_reason():
    record = SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP)

    async def adopt(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        if fetched is None:
            lost.append((failed, meta))
            return
        raise SnapshotRefused("s: memory does not match its SHA256")
    lost: list = []
    adopter, own, _ = make(record, adopt)
    adopter.consider(record)
    await settle(adopter)
    [changes] = own.updates
    assert changes["state"] is S.FAILED and "SHA256" in changes["reason"]
    assert own.current.record.snapshot == SNAP  # the location stays: nothing is deleted
    assert "s" in adopter.failed
    # ... and it is registered here FAILED with nothing, so its owner sees why and deletes it
    [(failed, meta)] = lost
    assert failed == changes["reason"] and adopter.adopted == ["s"]


async def test_an_unreachable_store_is_retried_then_failed():
    record = SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP)
    tries = []

    async def adopt(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        tries.append(1)
        if len(tries) < 3:
            raise ObjectStoreError("connection refused")
    adopter, own, _ = make(record, adopt)
    adopter.consider(record)
    await settle(adopter)
    assert len(tries) == 3 and adopter.adopted == ["s"] and not own.updates

    tries.clear()

    async def never(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        if fetched is None:
            return  # registered FAILED with nothing
        tries.append(1)
        raise ObjectStoreError("connection refused")
    adopter, own, _ = make(record, never)
    adopter.consider(record)
    await settle(adopter)
    assert len(tries) == adopter.retries + 1 and own.updates[0]["state"] is S.FAILED


async def test_a_record_that_moved_on_meanwhile_is_not_marked_failed():
    record = SandboxRecord("s", "me", S.SUSPENDED, 2, SNAP)

    async def adopt(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        own.current = Versioned(record.moved_to("other", S.SUSPENDED), 12)
        raise SnapshotRefused("no")
    adopter, own, _ = make(record, adopt)
    adopter.consider(record)
    await settle(adopter)
    assert not own.updates and own.current.record.host == "other"


async def test_a_local_copy_of_a_record_moved_away_is_evicted_unless_busy():
    record = SandboxRecord("s", "other", S.SUSPENDED, 3, SNAP)

    async def adopt(*args, **kwargs):
        raise AssertionError("not adopted")
    adopter, _, evicted = make(record, adopt, rows={"s": S.SUSPENDED, "t": S.RUNNING})
    adopter.busy.add("t")  # a drain in progress moves it: left alone
    adopter.consider(dataclasses.replace(record, id="t"))
    adopter.consider(record)
    await settle(adopter)
    assert evicted == [("s", "other")] and adopter.evicted == ["s"]


async def test_a_failed_record_moved_here_gets_its_last_disk_or_nothing():
    # With a snapshot: adopted FAILED with the reaper's reason (only its disk is kept).
    calls = []

    async def adopt(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        calls.append((fetched is not None, failed, meta))
    shipped = SandboxRecord("s", "me", S.FAILED, 2, SNAP, reason="host a died; ...",
                            tenant="k1", template="python")
    adopter, own, _ = make(shipped, adopt)
    adopter.consider(shipped)
    await settle(adopter)
    assert calls == [(True, "host a died; ...", None)] and adopter.adopted == ["s"]
    assert not own.updates  # the record is already FAILED with the reason

    # Its fetch fails: registered FAILED with nothing, both reasons kept; etcd untouched.
    calls.clear()

    async def refused(sandbox_id, fetched, *, base, from_host, failed=None, meta=None):
        calls.append((fetched is not None, failed, meta))
        if fetched is not None:
            raise SnapshotRefused("disk does not match its SHA256")
    adopter, own, _ = make(shipped, refused)
    adopter.consider(shipped)
    await settle(adopter)
    assert [c[0] for c in calls] == [True, False]
    assert calls[1][1].startswith("host a died; ...; but adoption by me failed: ")
    assert "SHA256" in calls[1][1] and calls[1][2]["tenant"] == "k1"
    assert not own.updates and adopter.adopted == ["s"]

    # Nothing shipped: registered FAILED with nothing, from the record's tenant and template.
    calls.clear()
    bare = SandboxRecord("s", "me", S.FAILED, 2, "", reason="host a died; everything lost",
                         tenant="k1", template="python", vcpus=2, memory_mib=512)
    adopter, own, _ = make(bare, adopt)
    adopter.consider(bare)
    await settle(adopter)
    [(fetched, failed, meta)] = calls
    assert not fetched and failed == "host a died; everything lost"
    assert meta == {"tenant": "k1", "template": "python", "vcpus": 2, "memory_mib": 512,
                    "disk_mib": 0}


async def test_a_published_copy_whose_record_was_deleted_is_discarded_unless_busy():
    """The publisher's DISCARD (its record deleted by the host it moved to): the local
    copy goes through the sandbox layer's ``discard``, once, never while a drain moves it."""
    discarded = []

    async def discard(sandbox_id):
        discarded.append(sandbox_id)
        await asyncio.sleep(0.05)
        return True
    adopter, _, _ = make(SandboxRecord("s", "me", S.RUNNING, 1), None)
    adopter.local = dataclasses.replace(adopter.local, discard=discard)
    adopter.busy.add("moving")
    adopter.discard("moving")
    adopter.discard("s")
    adopter.discard("s")  # a second sync while the first runs: one destroy
    await settle(adopter)
    assert discarded == ["s"] and adopter.evicted == ["s"]
    adopter.local = dataclasses.replace(adopter.local, discard=None)  # not wired: nothing
    adopter.discard("t")
    assert not adopter.working
