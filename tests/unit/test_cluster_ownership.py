"""Ownership transactions (no I/O): what each write is guarded by, and what a loss says."""

from __future__ import annotations

import pytest

from gateway.cluster import wire
from gateway.cluster.errors import EtcdUncertain, OwnershipConflict
from gateway.cluster.keys import Keys
from gateway.cluster.ownership import (Ownership, Versioned, outcome, plan_create, plan_delete,
                                       plan_move, plan_update)
from gateway.cluster.records import SandboxRecord
from gateway.sandbox.states import State

KEYS = Keys("/t")
REC = SandboxRecord("sb1", "host-a", State.RUNNING)
CUR = Versioned(REC, mod_revision=40)


def _guards(plan) -> set[tuple[str, str, str]]:
    return {(wire.unb64(c["key"]).decode(), c["target"], c["result"]) for c in plan.compares}


def test_create_needs_an_absent_key_and_the_owners_lease() -> None:
    plan = plan_create(KEYS, REC, host_lease=77)
    assert _guards(plan) == {("/t/sandboxes/sb1", "CREATE", "EQUAL"),
                             ("/t/hosts/host-a", "LEASE", "EQUAL")}
    assert plan.compares[1]["lease"] == "77"


def test_update_keeps_owner_and_generation_and_needs_the_read_revision() -> None:
    plan = plan_update(KEYS, CUR, REC.__class__("sb1", "host-a", State.PAUSED), host_lease=77)
    assert plan.compares[0]["mod_revision"] == "40"
    assert ("/t/hosts/host-a", "LEASE", "EQUAL") in _guards(plan)
    with pytest.raises(ValueError, match="move"):
        plan_update(KEYS, CUR, REC.moved_to("host-b", State.RUNNING), host_lease=77)


def test_move_bumps_the_generation_and_needs_no_lease() -> None:
    plan = plan_move(KEYS, CUR, "host-b", State.RESTORING)
    assert plan.new == SandboxRecord("sb1", "host-b", State.RESTORING, gen=2)
    assert _guards(plan) == {("/t/sandboxes/sb1", "MOD", "EQUAL")}


def test_delete_is_guarded_like_an_update() -> None:
    plan = plan_delete(KEYS, CUR, host_lease=5)
    assert plan.new is None and "request_delete_range" in plan.success[0]
    assert len(plan.compares) == 2


def _failed_with(record: SandboxRecord | None, mod: int = 50) -> wire.TxnResult:
    kvs = () if record is None else (wire.KeyValue(b"k", record.encode(), 1, mod, 2, 0),)
    return wire.TxnResult(revision=mod, succeeded=False,
                          responses=(wire.RangeResult(mod, kvs, len(kvs), False),))


def test_outcome_of_a_win_and_of_a_stale_generation() -> None:
    plan = plan_move(KEYS, CUR, "host-b", State.RESTORING)
    won = outcome(plan, wire.TxnResult(revision=41, succeeded=True, responses=({},)))
    assert won == Versioned(plan.new, 41)
    newer = REC.moved_to("host-c", State.RUNNING)  # someone else moved it first: gen 2
    with pytest.raises(OwnershipConflict, match="stale generation") as info:
        outcome(plan, _failed_with(newer))
    assert info.value.current == Versioned(newer, 50)
    with pytest.raises(OwnershipConflict, match="no record") as gone:
        outcome(plan, _failed_with(None))
    assert gone.value.current is None


class _LostAnswer:
    """A client whose txn answer is lost; reads return ``after``."""

    def __init__(self, after: wire.KeyValue | None) -> None:
        self.after = after

    txns = 0

    async def txn(self, *args):
        self.txns += 1
        raise EtcdUncertain("lost")

    async def get(self, key):
        return self.after


async def test_a_lost_answer_is_resolved_by_reading_back() -> None:
    moved = REC.moved_to("host-b", State.RESTORING)
    landed = wire.KeyValue(b"k", moved.encode(), 1, 41, 2, 0)
    assert await Ownership(_LostAnswer(landed), KEYS).move(CUR, "host-b", State.RESTORING) \
        == Versioned(moved, 41)
    other = wire.KeyValue(b"k", REC.moved_to("host-c", State.RUNNING).encode(), 1, 41, 2, 0)
    with pytest.raises(OwnershipConflict):
        await Ownership(_LostAnswer(other), KEYS).move(CUR, "host-b", State.RESTORING)
    unchanged = wire.KeyValue(b"k", REC.encode(), 1, 40, 1, 0)
    lost = _LostAnswer(unchanged)
    with pytest.raises(EtcdUncertain, match="after 3 tries"):
        await Ownership(lost, KEYS).move(CUR, "host-b", State.RESTORING)
    assert lost.txns == 3  # still as read each time: sent again (the compare makes it safe)
    assert await Ownership(_LostAnswer(None), KEYS).delete(CUR, host_lease=1) is None


def _range(kv: wire.KeyValue | None) -> wire.RangeResult:
    return wire.RangeResult(50, (kv,) if kv else (), 1 if kv else 0, False)


def test_a_loser_learns_which_guard_failed() -> None:
    plan = plan_update(KEYS, CUR, SandboxRecord("sb1", "host-a", State.PAUSED), host_lease=77)
    same = wire.KeyValue(b"k", REC.encode(), 1, 40, 1, 0)
    host_on_other_lease = wire.KeyValue(b"h", b"{}", 1, 45, 1, 78)
    for host_kv in (host_on_other_lease, None):
        result = wire.TxnResult(50, False, (_range(same), _range(host_kv)))
        with pytest.raises(OwnershipConflict, match="host-a's lease 4d is gone"):
            outcome(plan, result)
    host_ok = wire.KeyValue(b"h", b"{}", 1, 45, 1, 77)
    touched = wire.KeyValue(b"k", REC.encode(), 1, 49, 2, 0)
    with pytest.raises(OwnershipConflict, match="changed since read"):
        outcome(plan, wire.TxnResult(50, False, (_range(touched), _range(host_ok))))
    create = plan_create(KEYS, REC, host_lease=77)
    with pytest.raises(OwnershipConflict, match="already exists"):
        outcome(create, wire.TxnResult(50, False, (_range(same), _range(host_ok))))


class _LateLanding:
    """The first copy's answer is lost and the read-back still sees the record as read, so
    it is sent again; the first copy then lands, the second loses its compare, and the
    read-back finds our record: success, applied once."""

    def __init__(self, landed: wire.KeyValue) -> None:
        self.landed, self.txns, self.reads = landed, 0, 0

    async def txn(self, compares, success, failure):
        self.txns += 1
        if self.txns == 1:
            raise EtcdUncertain("lost")
        return wire.TxnResult(41, False, (_range(self.landed),))

    async def get(self, key):
        self.reads += 1
        return wire.KeyValue(b"k", REC.encode(), 1, 40, 1, 0) if self.reads == 1 \
            else self.landed


async def test_a_late_landing_copy_is_found_not_applied_twice() -> None:
    moved = REC.moved_to("host-b", State.RESTORING)
    client = _LateLanding(wire.KeyValue(b"k", moved.encode(), 1, 41, 2, 0))
    assert await Ownership(client, KEYS).move(CUR, "host-b", State.RESTORING) \
        == Versioned(moved, 41)
    assert client.txns == 2 and client.reads == 1


async def test_a_resent_plan_that_loses_a_guard_reports_the_guard() -> None:
    """Resent after a lost answer, the copy fails on a guard (record as read): that is a
    definite no, not 'unknown'."""
    class Deposed(_LateLanding):
        async def txn(self, compares, success, failure):
            self.txns += 1
            if self.txns == 1:
                raise EtcdUncertain("lost")
            return wire.TxnResult(41, False, (_range(wire.KeyValue(b"k", REC.encode(), 1, 40,
                                                                   1, 0)),))
    plan_guard = ({"key": "eA==", "target": "CREATE", "result": "EQUAL",
                   "create_revision": "3"},)
    with pytest.raises(OwnershipConflict, match="guard failed"):
        await Ownership(Deposed(None), KEYS).move(CUR, "host-b", State.RESTORING, plan_guard)


class _EpochEtcd:
    """Just enough etcd for the fleet epoch: one key, compare on create/value, a term."""

    def __init__(self, value: bytes | None) -> None:
        self.value, self.rev, self.txns = value, 10, []

    async def txn(self, compares, success, failure):
        self.txns.append(compares)
        if not compares:  # look: two gets
            out = tuple(_range(self.value and wire.KeyValue(KEYS.epoch.encode(), self.value,
                                                            3, 3, 1, 0)
                               if op["request_range"]["key"] == wire.b64(KEYS.epoch) else None)
                        for op in success)
            return wire.TxnResult(self.rev, True, out, raft_term=4)
        (guard,) = compares
        ok = self.value is None if guard["target"] == "CREATE" else \
            self.value is not None and wire.b64(self.value) == guard["value"]
        if ok:
            self.rev += 1
            self.value = wire.unb64(success[0]["request_put"]["value"])
            return wire.TxnResult(self.rev, True, ({},), raft_term=4)
        kv = None if self.value is None else wire.KeyValue(KEYS.epoch.encode(), self.value,
                                                           3, 3, 1, 0)
        return wire.TxnResult(self.rev, False, (_range(kv),), raft_term=4)


async def test_the_fleet_epoch_is_written_once_renewed_by_cas_and_read_with_a_record() -> None:
    etcd = _EpochEtcd(None)
    own = Ownership(etcd, KEYS)  # type: ignore[arg-type]
    first, rev, term = await own.epoch()  # none yet: written
    assert etcd.value == first.encode() and (rev, term) == (11, 4) and len(first) == 32
    assert (await own.epoch())[0] == first  # there: read, not rewritten
    renewed = (await own.epoch(replace=first))[0]
    assert renewed != first and etcd.value == renewed.encode()
    assert (await own.epoch(replace=first))[0] == renewed  # someone renewed it already
    look = await own.look("sbx1")
    assert (look.revision, look.current, look.epoch, look.term) == (etcd.rev, None, renewed, 4)
    etcd.value = None  # wiped
    assert (await own.look("sbx1")).epoch is None
    assert (await own.epoch(replace=renewed))[0] not in (None, renewed)  # gone: a first one
