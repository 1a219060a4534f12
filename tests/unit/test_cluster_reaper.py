"""The reaper's decision for a dead host's sandboxes, case by case (no I/O)."""

import asyncio
import dataclasses
import random

import pytest

from gateway.cluster.errors import ClusterError, OwnershipConflict
from gateway.cluster.ownership import Versioned
from gateway.cluster.placement import Request
from gateway.cluster.reaper import Move, Wait, decide, reap
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.sandbox.states import State

SNAP = "agentbox/snapshots/s/0123#" + "a" * 64
LIVE = [HostRecord("b", "b:1", total_mib=4096, free_mib=4096, total_vcpus=4, free_vcpus=4),
        HostRecord("c", "c:1", total_mib=4096, free_mib=1024, total_vcpus=4, free_vcpus=4)]


def run(records, live=LIVE, mib=512):
    return decide("a", records, live, request_for=lambda r: Request(mib, 1), k=5,
                  rng=random.Random(0))


AT = 1796392800.0  # 2026-12-04 14:00:00 UTC
F = State.FAILED


# One row per case of the reaper's table (docs/cluster.md "The reaper"): the record on the
# dead host "a" (state, snapshot, its base, reason), and the one action: (state it moves in,
# to which host, the snapshot it names, words its reason must hold), or None.
@pytest.mark.parametrize("state,snapshot,base,why,expect", [
    # suspended and shipped: moved SUSPENDED to the emptiest host; adopted and woken there
    (State.SUSPENDED, SNAP, "", "", (State.SUSPENDED, "b", SNAP, [])),
    # suspended, upload unfinished: moved FAILED with nothing
    (State.SUSPENDED, "", "", "", (F, "b", "", [
        "host a died; it was suspended but its snapshot was not uploaded yet",
        "nothing of it was uploaded: everything is lost; delete it"])),
    # running, never shipped: moved FAILED with nothing
    (State.RUNNING, "", "", "", (F, "b", "", [
        "host a died; it was running: its memory is lost",
        "nothing of it was uploaded: everything is lost"])),
    # paused, shipped before (woken since): moved FAILED with its last disk; cold-booted there
    (State.PAUSED, SNAP, "", "", (F, "b", SNAP, [
        "it was paused: its memory is lost",
        "its disk is as of its last suspend at 2026-12-04 14:00:00 UTC",
        "files written since are lost"])),
    (State.RESTORING, "", "", "", (F, "b", "", ["it was restoring", "everything is lost"])),
    (State.CREATING, "", "", "", (F, "b", "", ["it was creating", "everything is lost"])),
    (State.SUSPENDING, SNAP, "", "", (F, "b", SNAP, ["it was suspending", "its disk is as of"])),
    # running, shipped, its base held only by c (b is emptier): to c, with the disk
    (State.RUNNING, SNAP, "1" * 64, "", (F, "c", SNAP, ["its disk is as of"])),
    # running, shipped, no live host holds its base: FAILED with nothing, the upload kept
    (State.RUNNING, SNAP, "3" * 64, "", (F, "b", "", [
        "stands on base 3333333333333333, which no live host holds",
        "the upload stays in the object store"])),
    # already FAILED on the dead host (an earlier version's reaper left it there, or it
    # failed before the host died): moved, its old reason kept in the new one
    (F, SNAP, "", "crashed", (F, "b", SNAP, ["it had failed (crashed)", "its disk is as of"])),
    (F, "", "", "", (F, "b", "", ["it had failed (no reason recorded)", "everything is lost"])),
    (State.DESTROYED, "", "", "", None),
])
def test_one_sandbox(state, snapshot, base, why, expect):
    live = [LIVE[0], HostRecord("c", "c:1", total_mib=4096, free_mib=1024, total_vcpus=4,
                                free_vcpus=4, bases=("1" * 64,))]
    got = run([SandboxRecord("s", "a", state, gen=3, snapshot=snapshot, base=base,
                             reason=why, snapshot_at=AT if snapshot else 0.0)], live=live)
    if expect is None:
        assert got == []
        return
    [move] = got
    to_state, host, snap, words = expect
    assert (move.state, move.to_host, move.snapshot) == (to_state, host, snap), move
    for w in words:
        assert w in move.reason, (w, move.reason)
    assert move.reason == "" if to_state is State.SUSPENDED else len(move.reason) <= 1024


def test_a_failed_one_goes_even_to_a_full_fleet_but_waits_for_a_live_host():
    # A FAILED sandbox holds nothing until a request boots it: no room is no reason to
    # leave it unreachable on a dead host's name. With no live host at all it waits.
    [move] = run([SandboxRecord("s", "a", State.RUNNING)], mib=8192)
    assert (move.state, move.to_host) == (State.FAILED, "b")
    [wait] = run([SandboxRecord("s", "a", State.RUNNING)], live=[])
    assert isinstance(wait, Wait) and "no live host" in wait.reason
    # A suspended one still waits for room (waking it will need it).
    assert isinstance(run([SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP)],
                          mib=8192)[0], Wait)


def test_records_of_other_hosts_are_left_alone():
    # Already moved (by an earlier pass or a drain): the record names the new owner.
    assert run([SandboxRecord("s", "b", State.SUSPENDED, gen=2, snapshot=SNAP)]) == []


def test_no_host_can_take_it_waits():
    got = run([SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP)], mib=8192)
    assert len(got) == 1 and isinstance(got[0], Wait) and "8192 MiB" in got[0].reason
    assert isinstance(run([SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP)],
                          live=[])[0], Wait)


def test_the_dead_host_is_never_chosen_even_if_listed():
    dead = HostRecord("a", "a:1", total_mib=1 << 20, free_mib=1 << 20, total_vcpus=64,
                      free_vcpus=64)
    got = run([SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP)], live=[dead, *LIVE])
    assert got == [Move("s", "b", SNAP)]


def test_a_pass_counts_what_it_already_placed():
    # b has room for eight 512 MiB sandboxes, c for two: eleven suspended ones become ten
    # moves that fit (none overfills a host, as if each move's RAM were already taken) and
    # one wait, and c gets its share before b is full rather than none at all.
    live = [HostRecord(h.name, h.address, total_mib=h.total_mib, free_mib=h.free_mib,
                       total_vcpus=16, free_vcpus=16) for h in LIVE]
    records = [SandboxRecord(f"s{i:02}", "a", State.SUSPENDED, snapshot=SNAP)
               for i in range(11)]
    got = run(records, live=live)
    to = [m.to_host for m in got if isinstance(m, Move)]
    assert (to.count("b"), to.count("c")) == (8, 2)
    assert [type(a).__name__ for a in got].count("Wait") == 1
    assert "c" in to[:8]


class FakeOwnership:
    """Records moves; a move of ``conflict`` loses its compare-and-set."""

    def __init__(self, records, conflict=()):
        self.records = {r.id: Versioned(r, i + 1) for i, r in enumerate(records)}
        self.conflict, self.moves = set(conflict), []

    async def list(self):
        return 99, dict(self.records)

    async def move(self, current, to_host, state, guards=(), **changes):
        if current.record.id in self.conflict:
            raise OwnershipConflict("changed since read", None)
        self.moves.append((current.record.id, to_host, state, guards))
        new = dataclasses.replace(current.record.moved_to(to_host, state), **changes)
        self.records[new.id] = Versioned(new, 100)
        return self.records[new.id]


async def test_reap_applies_moves_and_failures_with_the_leader_guard():
    fake = FakeOwnership([
        SandboxRecord("s1", "a", State.SUSPENDED, gen=4, snapshot=SNAP),
        SandboxRecord("s2", "a", State.RUNNING, snapshot=SNAP),
        SandboxRecord("s3", "a", State.SUSPENDED, snapshot=SNAP),  # its owner came back
        SandboxRecord("s4", "b", State.RUNNING)],  # a live host's: untouched
        conflict={"s3"})
    guard = {"target": "CREATE", "key": "bGVhZGVy"}
    done = await reap(fake, "a", LIVE, guard=guard, request_for=lambda r: Request(512, 1),
                      k=5)
    assert [(m[0], m[1], m[2]) for m in fake.moves] == [
        ("s1", "b", State.SUSPENDED), ("s2", "b", State.FAILED)]
    s2 = fake.records["s2"].record
    assert (s2.host, s2.gen, s2.state, s2.snapshot) == ("b", 2, State.FAILED, SNAP)
    assert s2.reason.startswith("host a died; it was running: its memory is lost; its disk")
    assert all(m[3] == (guard,) for m in fake.moves)
    assert fake.records["s1"].record.gen == 5
    assert [a.sandbox_id for a in done] == ["s1", "s2"]


BASE_X, BASE_Y = "1" * 64, "2" * 64


def test_only_a_host_holding_its_base_is_chosen_and_its_shape_is_placed():
    # b is emptier but lacks the base: c (which holds it) is chosen. The record's own shape
    # (1 GiB) is what placement checks: c has 1 GiB free, so a 2 GiB sandbox waits.
    live = [HostRecord("b", "b:1", total_mib=8192, free_mib=8192, total_vcpus=4,
                       free_vcpus=4, bases=(BASE_Y,)),
            HostRecord("c", "c:1", total_mib=4096, free_mib=1024, total_vcpus=4,
                       free_vcpus=4, bases=(BASE_X, BASE_Y))]
    rec = SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP, base=BASE_X, vcpus=1,
                        memory_mib=1024)
    assert decide("a", [rec], live, k=5) == [Move("s", "c", SNAP)]
    big = SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP, base=BASE_X,
                        memory_mib=2048)
    [wait] = decide("a", [big], live, k=5)
    assert isinstance(wait, Wait) and "2048 MiB" in wait.reason


def test_sandboxes_moved_asleep_are_placed_by_memory_not_vcpus():
    # Two 2-core hosts whose cores are taken by awake sandboxes (free_vcpus 0) still take a
    # dead host's suspended 2-vCPU sandboxes, all in one pass: asleep they hold no vCPU
    # (bench/failover.py saw one move per host per pass when vCPUs were counted).
    live = [HostRecord(n, f"{n}:1", total_mib=8192, free_mib=8192, total_vcpus=2,
                       free_vcpus=0, bases=(BASE_X,)) for n in ("b", "c")]
    records = [SandboxRecord(f"s{i}", "a", State.SUSPENDED, snapshot=SNAP, base=BASE_X,
                             vcpus=2, memory_mib=512) for i in range(5)]
    got = decide("a", records, live, k=2, rng=random.Random(0))
    assert all(isinstance(m, Move) for m in got) and len(got) == 5


def test_no_live_host_holding_its_base_waits():
    live = [HostRecord("b", "b:1", total_mib=8192, free_mib=8192, total_vcpus=4,
                       free_vcpus=4, bases=(BASE_Y,))]
    rec = SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP, base=BASE_X)
    [wait] = decide("a", [rec], live)
    assert isinstance(wait, Wait) and "base" in wait.reason
    # A record from before bases (base unknown) goes to any host; its fetch checks.
    old = SandboxRecord("s", "a", State.SUSPENDED, snapshot=SNAP)
    assert decide("a", [old], live) == [Move("s", "b", SNAP)]


def test_records_and_host_records_without_the_new_fields_still_parse():
    old = b'{"id": "s", "host": "a", "state": "suspended", "gen": 2, "snapshot": ""}'
    rec = SandboxRecord.decode(old)
    assert (rec.base, rec.vcpus, rec.memory_mib, rec.reason) == ("", 0, 0, "")
    host = HostRecord.decode(b'{"name": "a", "address": "a:1"}')
    assert host.bases == ()
    again = HostRecord.decode(HostRecord("a", "a:1", bases=[BASE_Y, BASE_X]).encode())
    assert again.bases == (BASE_X, BASE_Y)
    with pytest.raises(ValueError):
        HostRecord("a", "a:1", bases=("not-a-digest",))


def test_a_host_is_due_only_after_it_has_been_gone_for_the_grace():
    from gateway.cluster.reaper import due

    since: dict[str, float] = {}
    assert due({"a", "b"}, {"b"}, since, now=100.0, grace=60.0) == []
    assert since == {"a": 100.0}
    assert due({"a", "b"}, {"b"}, since, now=159.0, grace=60.0) == []
    assert due({"a", "b"}, {"b"}, since, now=160.0, grace=60.0) == ["a"]
    # It came back (a daemon restart within the grace): forgotten, its clock restarts.
    assert due({"a", "b"}, {"a", "b"}, since, now=161.0, grace=60.0) == [] and since == {}
    assert due({"a"}, set(), since, now=170.0, grace=0.0) == ["a"]


async def test_the_loop_reaps_only_due_hosts_with_work_left():
    from gateway.cluster.reaper import ReaperLoop
    from gateway.cluster.routes import RouteTable
    from gateway.cluster.keys import Keys

    table = RouteTable(Keys("/x"))
    table.hosts = {h.name: h for h in LIVE}
    table.sandboxes = {
        "s1": SandboxRecord("s1", "a", State.SUSPENDED, snapshot=SNAP),
        "s2": SandboxRecord("s2", "d", State.FAILED),  # FAILED on dead d: moved too
        "s3": SandboxRecord("s3", "b", State.RUNNING),  # live b's: untouched
        "s4": SandboxRecord("s4", "e", State.DESTROYED)}  # nothing left to do: e not reaped
    fake = FakeOwnership(list(table.sandboxes.values()))
    loop = ReaperLoop(None, fake, table, "b", lambda: 7, grace=0.0)
    done = await loop.one_pass({"guard": 1})
    assert done[0] == Move("s1", "b", SNAP)
    assert [m[:3] for m in fake.moves] == [("s1", "b", State.SUSPENDED),
                                           ("s2", "b", State.FAILED)]
    assert set(loop.absent_since) == {"a", "d"}


async def test_a_campaign_is_made_again_when_the_lease_changes_or_it_hangs():
    """A campaign sent to a member that was then cut off never answers: it is given up
    when this host's lease changes (fenced, rejoined) or after ``campaign_for``, and the
    cancelled one withdraws (the election's own cancel path)."""
    from gateway.cluster.reaper import ReaperLoop

    calls, cancelled = [], []

    class HungElection:
        async def campaign(self, lease, value):
            calls.append(lease)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(lease)
                raise

    lease = [7]
    loop = ReaperLoop(HungElection(), None, None, "b", lambda: lease[0], grace=0.0,
                      campaign_for=0.5)
    task = asyncio.ensure_future(loop._campaign(7, poll=0.01))
    await asyncio.sleep(0.05)
    lease[0] = 8  # rejoined with a new lease
    with pytest.raises(ClusterError, match="replaced"):
        await task
    assert calls == [7] and cancelled == [7]
    with pytest.raises(ClusterError, match="no answer"):
        await loop._campaign(8, poll=0.01)
    assert calls == [7, 8] and cancelled == [7, 8]
