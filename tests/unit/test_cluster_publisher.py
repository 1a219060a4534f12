"""The owner's record publisher against a fake Ownership: a local change never waits on
etcd, the newest state wins, failures and hangs are retried within bounds, a record
another host holds is never overwritten, a destroy deletes."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from gateway.cluster.errors import EtcdUnavailable, OwnershipConflict
from gateway.cluster.ownership import Versioned
from gateway.cluster.publisher import Publisher
from gateway.cluster.records import SandboxRecord
from gateway.sandbox.states import State


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
