"""The shipper: a suspend uploads and then names the snapshot in the record (only while
the record is still SUSPENDED here); a wake cancels the upload; a newer suspend supersedes."""

import asyncio
import dataclasses

from gateway.cluster.ownership import Versioned
from gateway.cluster.records import SandboxRecord
from gateway.cluster.shipper import LocalSnapshot, Shipper
from gateway.cluster.shipping import INDEX
from gateway.sandbox.states import State
from gateway.store.feed import Transition
from tests.unit.test_cluster_shipping import MemStore

BASE = "b" * 64


class FakeOwnership:  # compare-and-set on a revision, like etcd's txn
    def __init__(self, record):
        self.current = Versioned(record, 1)

    async def get(self, sandbox_id):
        return self.current

    async def update(self, current, lease, **changes):
        assert current.mod_revision == self.current.mod_revision
        self.current = Versioned(dataclasses.replace(current.record, **changes),
                                 current.mod_revision + 1)
        return self.current


def moved(sandbox_id, to_state):
    return Transition(1, sandbox_id, "t", "running", to_state.value, "x", "", 0.0)


def make(tmp_path, state=State.SUSPENDED, store=None):
    d = tmp_path / "snap"
    d.mkdir(exist_ok=True)
    (d / "memory").write_bytes(b"m" * (300 << 10))  # over HELD_BYTES: streamed
    own = FakeOwnership(SandboxRecord("sb", "h1", state))

    async def local(sandbox_id):
        return LocalSnapshot(d, ["memory"], BASE, {"tenant": "t", "vcpus": 2,
                                                   "memory_mib": 512, "disk_mib": 0,
                                                   "template": "python",
                                                   "suspended_at": 1796392800.5})

    store = store or MemStore()
    return Shipper(store, own, "h1", lambda: 7, local, key_prefix="p"), own, store


async def test_suspend_uploads_then_records(tmp_path):
    shipper, own, store = make(tmp_path)
    shipper.heard(moved("sb", State.SUSPENDED))
    while shipper.uploading:
        await asyncio.sleep(0.01)
    location = own.current.record.snapshot
    assert location and shipper.shipped["sb"] == location
    assert f"{location.partition('#')[0]}/{INDEX}" in store.objects
    # The reaper places it from the record alone: its base and shape ride along.
    rec = own.current.record
    assert (rec.base, rec.vcpus, rec.memory_mib, rec.disk_mib) == (BASE, 2, 512, 0)
    # ... whose it is, and when the snapshot was made (the reaper's reason names it).
    assert (rec.tenant, rec.template, rec.snapshot_at) == ("t", "python", 1796392800.5)
    await shipper.aclose()


async def test_an_adoption_insert_is_not_shipped_again(tmp_path):
    shipper, own, store = make(tmp_path)
    shipper.heard(Transition(1, "sb", "t", None, "suspended", "adopted", "", 0.0))
    assert shipper.uploading == 0 and not store.objects
    await shipper.aclose()


async def test_not_recorded_when_another_host_holds_it(tmp_path):
    shipper, own, _ = make(tmp_path)
    own.current = own.current.__class__(
        dataclasses.replace(own.current.record, host="h2", gen=2), 1)
    shipper.heard(moved("sb", State.SUSPENDED))
    while shipper.uploading:
        await asyncio.sleep(0.01)
    assert own.current.record.snapshot == "" and shipper.failures == 0
    await shipper.aclose()


async def test_a_lagging_record_is_waited_for(tmp_path):
    # The publisher has not written SUSPENDED yet: the shipper waits, then records.
    shipper, own, _ = make(tmp_path, state=State.SUSPENDING)
    shipper.retry_every = 0.01
    shipper.heard(moved("sb", State.SUSPENDED))
    await asyncio.sleep(0.1)
    assert own.current.record.snapshot == "" and shipper.uploading == 1
    own.current = own.current.__class__(
        dataclasses.replace(own.current.record, state=State.SUSPENDED), 2)
    while shipper.uploading:
        await asyncio.sleep(0.01)
    assert own.current.record.snapshot and shipper.failures == 0
    await shipper.aclose()


async def test_wake_cancels_and_a_newer_suspend_supersedes(tmp_path):
    gate = asyncio.Event()
    started = []

    class Slow(MemStore):
        async def put_file(self, key, path, sha256):
            started.append(key)
            await gate.wait()
            await super().put_file(key, path, sha256)

    shipper, own, store = make(tmp_path, store=Slow())
    shipper.heard(moved("sb", State.SUSPENDED))
    await asyncio.sleep(0.02)
    first = shipper._tasks["sb"]
    shipper.heard(moved("sb", State.RESTORING))
    await asyncio.sleep(0)
    assert first.cancelled() or first.cancelling()
    assert shipper.uploading == 0
    shipper.heard(moved("sb", State.SUSPENDED))
    gate.set()
    while shipper.uploading:
        await asyncio.sleep(0.01)
    assert own.current.record.snapshot and len(started) == 2
    await shipper.aclose()
