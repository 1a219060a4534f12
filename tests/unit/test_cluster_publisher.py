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
from gateway.cluster.ownership import Look, Versioned
from gateway.cluster.publisher import Mark, Publisher, Seen, Step, plan
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

    epoch_value: str | None = "epoch-1"
    term = 5  # etcd's raft term

    async def epoch(self, replace: str | None = None) -> tuple[str, int, int]:
        if self.epoch_value is None or (replace is not None and self.epoch_value == replace):
            self.rev += 1
            self.epoch_value = f"epoch-r{self.rev}"
        return self.epoch_value, self.rev, self.term

    async def look(self, sandbox_id: str) -> Look:
        return Look(self.rev, self.store.get(sandbox_id), self.epoch_value, self.term)

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


_M = Mark("e1", 40)  # seen published in epoch e1 at revision 40
_NEWER = Seen("e1", 90, 60)  # absent, same epoch, etcd past all we saw: a delete after a move


@pytest.mark.parametrize(("state", "current", "mark", "seen", "step"), [
    # never published, no record: created (made during an etcd outage, or just now)
    (State.RUNNING, None, None, None, Step.CREATE),
    (State.SUSPENDED, None, None, _NEWER, Step.CREATE),
    # published before, record absent, same epoch, newer revision: its new owner deleted
    # it after a move: destroy ours
    (State.RUNNING, None, _M, _NEWER, Step.DISCARD),
    (State.SUSPENDED, None, _M, Seen("e1", 40, 0), Step.DISCARD),
    (State.FAILED, None, _M, _NEWER, Step.DISCARD),
    # published, absent, but etcd not looked at yet: never a discard
    (State.RUNNING, None, _M, None, Step.REPUBLISH),
    # etcd went back: wiped (no epoch), replaced (another epoch), restored from a backup
    # (same epoch, revision below the mark's or below the highest this host saw)
    (State.RUNNING, None, _M, Seen(None, 3, 0), Step.REPUBLISH),
    (State.RUNNING, None, _M, Seen("e2", 900, 0), Step.REPUBLISH),
    (State.SUSPENDED, None, _M, Seen("e1", 39, 0), Step.REPUBLISH),
    (State.RUNNING, None, _M, Seen("e1", 50, 60), Step.REPUBLISH),
    # a mark made before fleet epochs: republished, never destroyed
    (State.RUNNING, None, Mark("", 0), Seen("e1", 90, 0), Step.REPUBLISH),
    # destroyed here: nothing to delete / our record deleted, published or not
    (State.DESTROYED, None, _M, _NEWER, Step.NOTHING),
    (State.DESTROYED, None, None, None, Step.NOTHING),
    (State.DESTROYED, SandboxRecord("s", _ME, State.RUNNING, 1), _M, None, Step.DELETE),
    # another host holds it (moved away, gen went up): never written, whatever we know
    (State.RUNNING, SandboxRecord("s", _OTHER, State.SUSPENDED, 2), _M, None, Step.LEAVE),
    (State.RUNNING, SandboxRecord("s", _OTHER, State.SUSPENDED, 2), None, None, Step.LEAVE),
    (State.DESTROYED, SandboxRecord("s", _OTHER, State.RUNNING, 2), _M, None, Step.LEAVE),
    # ours
    (State.RUNNING, SandboxRecord("s", _ME, State.RUNNING, 1), _M, None, Step.CONFIRM),
    (State.RUNNING, SandboxRecord("s", _ME, State.RUNNING, 1), None, None, Step.CONFIRM),
    (State.SUSPENDED, SandboxRecord("s", _ME, State.RUNNING, 1), _M, None, Step.UPDATE),
], ids=lambda v: getattr(v, "value", None) or getattr(v, "host", None) or str(v))
def test_sync_decision(state: State, current: SandboxRecord | None, mark: Mark | None,
                       seen: Seen | None, step: Step) -> None:
    assert plan(_ME, state, current, mark, seen) is step


async def test_a_published_sandbox_whose_record_is_gone_is_discarded_never_republished(
        tmp_path: Path) -> None:
    """The registry remembers (durably, per key prefix) what etcd held; a restart (a new
    Publisher on the same registry) destroys the copy of a deleted one and creates the
    record of one never published."""
    registry = Registry(tmp_path / "r.db")
    fake = FakeOwnership()

    def publisher() -> Publisher:
        pub = Publisher(fake, _ME, lambda: 7, backoff=0.01)  # type: ignore[arg-type]
        pub.landed = lambda sid, mark: registry.mark_published(sid, "/agentbox", mark.epoch,
                                                                mark.revision)
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
        assert registry.was_published("s1", "/agentbox") == ("", 0, 0)  # before epochs
        registry.mark_published("s1", "/agentbox", "e1", 41, 3)  # a later mark replaces it
        assert registry.was_published("s1", "/agentbox") == ("e1", 41, 3)
    finally:
        registry.close()


def test_the_published_table_gains_epoch_and_revision(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    Registry(db).close()
    conn = sqlite3.connect(db)  # the table as the previous daemon made it
    conn.executescript("DROP TABLE published; CREATE TABLE published (sandbox_id TEXT NOT NULL, "
                       "key_prefix TEXT NOT NULL, at REAL NOT NULL, "
                       "PRIMARY KEY (sandbox_id, key_prefix)); "
                       "INSERT INTO published VALUES ('old', '/agentbox', 1.0);")
    conn.close()
    registry = Registry(db)
    try:
        assert registry.was_published("old", "/agentbox") == ("", 0, 0)  # republished
        registry.mark_published("old", "/agentbox", "e1", 7, 2)
        assert registry.was_published("old", "/agentbox") == ("e1", 7, 2)
    finally:
        registry.close()


async def _publish(pub: Publisher, *items: tuple[str, State]) -> None:
    pub.sync(items)
    await settle(pub)


def _marking(registry: Registry, pub: Publisher) -> None:
    pub.landed = lambda sid, mark: registry.mark_published(sid, "/agentbox", mark.epoch,
                                                           mark.revision, mark.term)
    pub.was_published = lambda sid: registry.was_published(sid, "/agentbox")


@pytest.mark.parametrize("how", ["wiped", "restored", "restored-bumped", "restored-young"])
async def test_an_etcd_that_went_back_never_discards_it_republishes_and_says_so_once(
        tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Wiped (no epoch, revisions from 1) or restored from an older backup (same epoch,
    older revision): every published sandbox whose record is missing is created again,
    none is destroyed, one error is logged; the epoch is renewed, so a later delete after
    a move (in the new epoch) still discards."""
    registry = Registry(tmp_path / "r.db")
    fake = FakeOwnership()
    gone: list[str] = []
    pub = Publisher(fake, _ME, lambda: 7, backoff=0.01)  # type: ignore[arg-type]
    _marking(registry, pub)
    pub.discard = gone.append
    pub.relist = lambda: [("a", State.SUSPENDED), ("b", State.SUSPENDED), ("c", State.RUNNING)]
    pub.start()
    try:
        await _publish(pub, ("a", State.RUNNING), ("b", State.SUSPENDED))
        backup = (dict(fake.store), fake.rev)
        await _publish(pub, ("c", State.RUNNING), ("a", State.SUSPENDED))  # after the backup
        assert registry.was_published("c", "/agentbox") == ("epoch-1", 3, 5)
        fake.term = 2  # a new raft log (wiped or restored)
        if how == "wiped":
            fake.store.clear()
            fake.rev, fake.epoch_value = 0, None
        else:
            fake.store, fake.rev = dict(backup[0]), backup[1]
        if how == "restored-bumped":  # etcdutl snapshot restore --bump-revision
            fake.rev += 1_000_000
        if how == "restored-young":  # a cluster restored at the same raft term: revisions
            fake.term = 5            # tell (as long as it has not grown past ours since)
        else:
            for _ in range(50):  # many writes after: revisions grow past ours
                fake._put(SandboxRecord("other", _OTHER, State.RUNNING))
        await _publish(pub, ("a", State.SUSPENDED), ("b", State.SUSPENDED),
                       ("c", State.RUNNING))
        assert gone == [] and pub.discarded == []
        assert {"a", "b", "c"} <= set(fake.store)
        assert fake.store["a"].record.state is State.SUSPENDED
        assert pub.epoch == fake.epoch_value != "epoch-1"
        assert {registry.was_published(s, "/agentbox")[0] for s in "abc"} == {pub.epoch}
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "etcd lost data" in errors[0].getMessage()
        # In the new epoch, a sandbox moved away and deleted there is discarded again.
        del fake.store["c"]
        fake._put(SandboxRecord("other", _OTHER, State.SUSPENDED))
        await _publish(pub, ("c", State.RUNNING))
        assert gone == ["c"] and "c" not in fake.store
    finally:
        await pub.aclose()
        registry.close()


async def test_a_host_restarted_after_a_restore_republishes(tmp_path: Path) -> None:
    """A new Publisher on the same registry (the daemon was down during the restore): its
    marks' epoch matches, but etcd's revision is older than the mark's: republished."""
    registry = Registry(tmp_path / "r.db")
    fake = FakeOwnership()
    gone: list[str] = []
    pub = Publisher(fake, _ME, lambda: 7, backoff=0.01)  # type: ignore[arg-type]
    _marking(registry, pub)
    pub.start()
    try:
        await _publish(pub, ("a", State.RUNNING))
        backup = (dict(fake.store), fake.rev)
        await _publish(pub, ("z", State.RUNNING))
    finally:
        await pub.aclose()
    fake.store, fake.rev = backup
    pub = Publisher(fake, _ME, lambda: 7, backoff=0.01)  # type: ignore[arg-type]
    _marking(registry, pub)
    pub.discard = gone.append
    pub.start()
    try:
        await _publish(pub, ("a", State.RUNNING), ("z", State.RUNNING))
        assert gone == [] and sorted(fake.store) == ["a", "z"] and pub.republished == ["z"]
        assert fake.epoch_value != "epoch-1"  # renewed: other hosts' marks stop counting
    finally:
        await pub.aclose()
        registry.close()
