"""The owner's record publisher against a fake Ownership: a local change never waits on
etcd, the newest state wins, failures and hangs are retried within bounds, a record
another host holds is never overwritten, a destroy deletes."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gateway.cluster.errors import EtcdUnavailable, OwnershipConflict
from gateway.cluster.ownership import Versioned
from gateway.cluster.publisher import Publisher, Step, plan
from gateway.cluster.records import SandboxRecord
from gateway.sandbox.states import State
from gateway.store.registry import Registry


class FakeOwnership:
    def __init__(self) -> None:
        self.store: dict[str, Versioned] = {}
        self.rev = 0
        self.calls: list[tuple[str, str, Any]] = []
        self.fail = 0  # the next N writes raise EtcdUnavailable
        self.hang = asyncio.Event()
        self.hang.set()

    def _put(self, record: SandboxRecord) -> Versioned:
        self.rev += 1
        self.store[record.id] = Versioned(record, self.rev)
        return self.store[record.id]

    async def _gate(self, op: str, sandbox_id: str, arg: Any) -> None:
        self.calls.append((op, sandbox_id, arg))
        await self.hang.wait()
        if self.fail:
            self.fail -= 1
            raise EtcdUnavailable("no member answered")

    async def get(self, sandbox_id: str) -> Versioned | None:
        return self.store.get(sandbox_id)

    async def create(self, record: SandboxRecord, lease: int) -> Versioned:
        await self._gate("create", record.id, record.state)
        if record.id in self.store:
            raise OwnershipConflict("exists", self.store[record.id])
        return self._put(record)

    async def update(self, current: Versioned, lease: int, **changes: Any) -> Versioned:
        await self._gate("update", current.record.id, changes["state"])
        if self.store.get(current.record.id) != current:
            raise OwnershipConflict("changed", self.store.get(current.record.id))
        return self._put(dataclasses.replace(current.record, **changes))

    async def delete(self, current: Versioned, lease: int) -> None:
        await self._gate("delete", current.record.id, None)
        del self.store[current.record.id]


async def settle(publisher: Publisher, timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while publisher.pending:
            await asyncio.sleep(0.01)


async def test_changes_become_records_newest_state_wins_destroy_deletes() -> None:
    fake = FakeOwnership()
    pub = Publisher(fake, "host-a", lambda: 7)  # type: ignore[arg-type]
    pub.start()
    try:
        pub.changed("sbx1", State.CREATING)
        pub.changed("sbx1", State.RUNNING)  # before the writer ran: only RUNNING is written
        await settle(pub)
        assert fake.store["sbx1"].record == SandboxRecord("sbx1", "host-a", State.RUNNING, 1)
        assert fake.calls == [("create", "sbx1", State.RUNNING)]
        pub.changed("sbx1", State.SUSPENDED)
        await settle(pub)
        assert fake.store["sbx1"].record.state is State.SUSPENDED
        pub.changed("sbx1", State.DESTROYED)
        await settle(pub)
        assert "sbx1" not in fake.store
    finally:
        await pub.aclose()


async def test_a_failed_or_hung_write_never_blocks_and_is_retried() -> None:
    fake = FakeOwnership()
    pub = Publisher(fake, "host-a", lambda: 7, timeout=0.2, backoff=0.05)  # type: ignore[arg-type]
    pub.start()
    try:
        fake.fail = 2
        pub.changed("sbx1", State.RUNNING)  # returns at once whatever etcd does
        await settle(pub)
        assert fake.store["sbx1"].record.state is State.RUNNING and pub.failures == 2
        fake.hang.clear()  # etcd hangs: each write is cut at the timeout
        pub.changed("sbx1", State.SUSPENDED)
        await asyncio.sleep(0.5)
        assert pub.pending == 1 and pub.failures >= 3
        fake.hang.set()
        await settle(pub)
        assert fake.store["sbx1"].record.state is State.SUSPENDED
    finally:
        await pub.aclose()


async def test_a_record_another_host_holds_is_never_overwritten() -> None:
    fake = FakeOwnership()
    fake._put(SandboxRecord("sbx1", "host-b", State.RUNNING, 2))
    pub = Publisher(fake, "host-a", lambda: 7)  # type: ignore[arg-type]
    pub.start()
    try:
        pub.changed("sbx1", State.SUSPENDED)
        pub.changed("sbx1", State.DESTROYED)
        await settle(pub)
        assert fake.store["sbx1"].record == SandboxRecord("sbx1", "host-b", State.RUNNING, 2)
        assert fake.calls == []
    finally:
        await pub.aclose()


async def test_a_conflict_is_read_again_then_written() -> None:
    fake = FakeOwnership()
    pub = Publisher(fake, "host-a", lambda: 7, backoff=0.01)  # type: ignore[arg-type]
    pub.start()
    try:
        pub.changed("sbx1", State.RUNNING)
        await settle(pub)
        # Someone (a rejoin of ours) rewrote the record: our cached revision is stale.
        fake._put(fake.store["sbx1"].record)
        pub.changed("sbx1", State.SUSPENDED)
        await settle(pub)
        assert fake.store["sbx1"].record.state is State.SUSPENDED
        assert [c[0] for c in fake.calls] == ["create", "update", "update"]
    finally:
        await pub.aclose()


async def test_a_new_suspend_clears_the_shipped_location_a_wake_keeps_it() -> None:
    """The reaper must never restore an older snapshot of a newer suspend: entering a
    suspend drops the location until the shipper names the new upload; a wake keeps it
    (it tells the reaper where the disk of the last suspend is)."""
    fake = FakeOwnership()
    fake._put(SandboxRecord("sbx1", "host-a", State.SUSPENDED, 1, snapshot="old#x"))
    pub = Publisher(fake, "host-a", lambda: 7)  # type: ignore[arg-type]
    pub.start()
    try:
        pub.changed("sbx1", State.RUNNING)
        await settle(pub)
        assert fake.store["sbx1"].record.snapshot == "old#x"
        pub.changed("sbx1", State.SUSPENDED)
        await settle(pub)
        assert fake.store["sbx1"].record.snapshot == ""
    finally:
        await pub.aclose()


async def test_a_created_record_names_whose_it_is_and_its_shape() -> None:
    # A host the reaper gives it to registers it from the record alone if nothing of it
    # was shipped (gateway.cluster.adopter), so the record carries tenant, template, shape.
    fake = FakeOwnership()
    pub = Publisher(fake, "host-a", lambda: 7)  # type: ignore[arg-type]
    pub.describe = lambda sid: {"tenant": "k1", "template": "python", "vcpus": 2,
                                "memory_mib": 1024, "disk_mib": 0, "junk": object()}
    pub.start()
    try:
        pub.changed("sbx1", State.RUNNING)
        await settle(pub)
        rec = fake.store["sbx1"].record
        assert (rec.tenant, rec.template, rec.vcpus, rec.memory_mib) == ("k1", "python", 2, 1024)
        # An older record without them gains them at its next write; a describe that
        # raises never stops a write.
        fake._put(SandboxRecord("sbx2", "host-a", State.RUNNING))
        pub.changed("sbx2", State.SUSPENDED)
        await settle(pub)
        assert fake.store["sbx2"].record.tenant == "k1"

        def broken(sid: str) -> dict[str, Any]:
            raise RuntimeError("registry closed")
        pub.describe = broken
        pub.changed("sbx3", State.RUNNING)
        await settle(pub)
        assert fake.store["sbx3"].record.tenant == ""
    finally:
        await pub.aclose()


# -- a record this host published that is gone: deleted by the host it moved to ----------

_ME, _OTHER = "host-a", "host-b"


@pytest.mark.parametrize(("state", "current", "published", "step"), [
    # never published, no record: created (made during an etcd outage, or just now)
    (State.RUNNING, None, False, Step.CREATE),
    (State.SUSPENDED, None, False, Step.CREATE),
    # published before, record absent: its new owner deleted it after a move: destroy ours
    (State.RUNNING, None, True, Step.DISCARD),
    (State.SUSPENDED, None, True, Step.DISCARD),
    (State.FAILED, None, True, Step.DISCARD),
    # destroyed here: nothing to delete / our record deleted, published or not
    (State.DESTROYED, None, True, Step.NOTHING),
    (State.DESTROYED, None, False, Step.NOTHING),
    (State.DESTROYED, SandboxRecord("s", _ME, State.RUNNING, 1), True, Step.DELETE),
    # another host holds it (moved away, gen went up): never written, whatever we know
    (State.RUNNING, SandboxRecord("s", _OTHER, State.SUSPENDED, 2), True, Step.LEAVE),
    (State.RUNNING, SandboxRecord("s", _OTHER, State.SUSPENDED, 2), False, Step.LEAVE),
    (State.DESTROYED, SandboxRecord("s", _OTHER, State.RUNNING, 2), True, Step.LEAVE),
    # ours
    (State.RUNNING, SandboxRecord("s", _ME, State.RUNNING, 1), True, Step.CONFIRM),
    (State.RUNNING, SandboxRecord("s", _ME, State.RUNNING, 1), False, Step.CONFIRM),
    (State.SUSPENDED, SandboxRecord("s", _ME, State.RUNNING, 1), True, Step.UPDATE),
], ids=lambda v: getattr(v, "value", None) or getattr(v, "host", None) or str(v))
def test_sync_decision(state: State, current: SandboxRecord | None, published: bool,
                       step: Step) -> None:
    assert plan(_ME, state, current, published) is step


async def test_a_published_sandbox_whose_record_is_gone_is_discarded_never_republished(
        tmp_path: Path) -> None:
    """The registry remembers (durably, per key prefix) what etcd held; a restart (a new
    Publisher on the same registry) destroys the copy of a deleted one and creates the
    record of one never published."""
    registry = Registry(tmp_path / "r.db")
    fake = FakeOwnership()

    def publisher() -> Publisher:
        pub = Publisher(fake, _ME, lambda: 7, backoff=0.01)  # type: ignore[arg-type]
        pub.landed = lambda sid: registry.mark_published(sid, "/agentbox")
        pub.was_published = lambda sid: registry.was_published(sid, "/agentbox")
        pub.discard = gone.append
        return pub

    gone: list[str] = []
    pub = publisher()
    pub.start()
    try:
        pub.changed("moved", State.RUNNING)
        pub.changed("confirmed", State.SUSPENDED)
        fake._put(SandboxRecord("confirmed", _ME, State.SUSPENDED, 2))  # adopted: found ours
        await settle(pub)
    finally:
        await pub.aclose()
    assert registry.was_published("moved", "/agentbox")
    assert registry.was_published("confirmed", "/agentbox")
    assert not registry.was_published("moved", "/other-fleet")
    # Down: "moved" and "confirmed" moved away and deleted there; "new" made meanwhile.
    del fake.store["moved"], fake.store["confirmed"]
    registry.close()
    registry = Registry(tmp_path / "r.db")
    fake.calls.clear()
    pub = publisher()
    pub.start()
    try:
        pub.sync([("moved", State.RUNNING), ("confirmed", State.SUSPENDED),
                  ("new", State.RUNNING)])
        await settle(pub)
        assert sorted(gone) == ["confirmed", "moved"] and pub.discarded == gone
        assert sorted(fake.store) == ["new"] and fake.calls == [("create", "new", State.RUNNING)]
        pub.changed("moved", State.DESTROYED)  # the discard's own transition: nothing
        await settle(pub)
        assert sorted(fake.store) == ["new"]
    finally:
        await pub.aclose()
        registry.close()


def test_the_published_table_is_added_to_an_older_data_dir(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    conn = sqlite3.connect(db)
    conn.executescript("CREATE TABLE sandboxes (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
                       "template TEXT NOT NULL, state TEXT NOT NULL, "
                       "metadata TEXT NOT NULL DEFAULT '{}', slot INTEGER NOT NULL, "
                       "root TEXT NOT NULL, golden TEXT NOT NULL, vmm TEXT, "
                       "idle_timeout REAL NOT NULL, host TEXT NOT NULL, created_at REAL NOT NULL, "
                       "updated_at REAL NOT NULL, last_activity REAL NOT NULL);")
    conn.close()
    registry = Registry(db)
    try:
        assert not registry.was_published("s1", "/agentbox")  # older data: never marked
        registry.mark_published("s1", "/agentbox")
        registry.mark_published("s1", "/agentbox")  # idempotent
        assert registry.was_published("s1", "/agentbox")
    finally:
        registry.close()
