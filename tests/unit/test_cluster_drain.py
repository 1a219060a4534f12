"""Drain without etcd or VMs (gateway/cluster/drain.py): the draining mark in the route
table, placement skipping it, a Drainer pass over a host's sandboxes, and the checks a
moved sandbox's fields get on the destination (gateway/sandbox/migration.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.cluster import drain, wire
from gateway.cluster.keys import Keys
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.cluster.routes import RouteTable
from gateway.cluster.routing import Forward, ServeHere, place
from gateway.cluster.placement import Request
from gateway.errors import BadRequest
from gateway.sandbox import migration
from gateway.sandbox.states import State

KEYS = Keys("/t")


def kv(key: str, value: bytes, rev: int) -> wire.KeyValue:
    return wire.KeyValue(key.encode(), value, rev, rev, 1, 0)


def host(name: str, free: int = 8000) -> HostRecord:
    return HostRecord(name, f"10.0.0.{name[-1]}:8080", 16000, free, 8, 8, 0)


def test_the_mark_comes_and_goes_with_its_key() -> None:
    table = RouteTable(KEYS)
    table.load(1, [kv(KEYS.host("h0"), host("h0").encode(), 1),
                   kv(KEYS.drain("h0"), b"{}", 1)])
    assert table.draining == {"h0"}
    table.apply((wire.Event(wire.EventType.PUT, kv(KEYS.drain("h1"), b"{}", 2)),
                 wire.Event(wire.EventType.DELETE, kv(KEYS.drain("h0"), b"", 3))))
    assert table.draining == {"h1"} and set(table.hosts) == {"h0"}


def test_placement_never_chooses_a_draining_host() -> None:
    hosts = [host("h0", free=15000), host("h1", free=1000), host("h2", free=900)]
    rng = random.Random(1)
    for _ in range(50):
        chosen = place(drain.eligible(hosts, {"h0"}), "h1", Request(256, 1), k=3, rng=rng)
        assert isinstance(chosen, (ServeHere, Forward))
        assert not (isinstance(chosen, Forward) and chosen.host == "h0")
    assert [h.name for h in drain.eligible(hosts, {"h0"}, exclude="h1")] == ["h2"]


async def test_a_pass_moves_running_sandboxes_and_lists_the_rest() -> None:
    moves: list[tuple[str, str]] = []

    async def move(sandbox_id, dest, peer, record_move):  # type: ignore[no-untyped-def]
        if sandbox_id == "bad":
            raise RuntimeError("destination refused")
        moves.append((sandbox_id, dest))

    local = [("a", State.RUNNING), ("s", State.SUSPENDED), ("bad", State.RUNNING),
             ("gone", State.DESTROYED)]
    drainer = drain.Drainer("h0", None, KEYS, lambda: [host("h0"), host("h1"), host("h2")],  # type: ignore[arg-type]
                            lambda: {"h0", "h2"}, lambda: local, move, lambda: "key",
                            rng=random.Random(0))
    result = await drainer.drain_once()
    assert moves == [("a", "h1")]  # h2 drains too, h0 is itself
    assert result.moved == ["a"] and list(result.left) == ["s"]  # no record: not shipped
    assert set(result.failed) == {"bad"}


async def test_with_nowhere_to_go_nothing_moves() -> None:
    async def move(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("no move expected")

    drainer = drain.Drainer("h0", None, KEYS, lambda: [host("h0")], lambda: {"h0"},  # type: ignore[arg-type]
                            lambda: [("a", State.RUNNING)], move, lambda: "key")
    result = await drainer.drain_once()
    assert result.moved == [] and "no other live host" in result.left["a"]


GOOD = {"id": "abc123", "tenant": "k1", "template": "python",
        "golden": "/var/lib/agentbox/images/python/x/golden", "idle_timeout": 0.0,
        "created_at": 1.0, "metadata": {"a": "b"}, "expires_at": None,
        "auto_delete_after": 0.0, "egress": None, "vcpus": 2, "memory_mib": 512,
        "disk_mib": 0}


def test_a_moved_sandboxs_fields_are_checked() -> None:
    assert migration._checked(GOOD) == GOOD
    for bad in ({**GOOD, "id": "../x"}, {**GOOD, "golden": "rel/path"},
                {**GOOD, "vcpus": "2"}, {**GOOD, "metadata": []}, {**GOOD, "slot": 3},
                {k: v for k, v in GOOD.items() if k != "tenant"}, None):
        with pytest.raises(BadRequest):
            migration._checked(bad)


BASE, OTHER = "b" * 64, "c" * 64
SNAP = "p/snapshots/s/0#" + "a" * 64


def based(name: str, free: int = 8000, vcpus: int = 8, bases: tuple[str, ...] = (BASE,)
          ) -> HostRecord:
    return HostRecord(name, f"10.0.0.{name[-1]}:8080", 16000, free, 8, vcpus, 0, bases)


def suspended(sid: str, host: str = "h0", snapshot: str = SNAP, base: str = BASE,
              memory_mib: int = 0, state: State = State.SUSPENDED) -> SandboxRecord:
    return SandboxRecord(sid, host, state, 3, snapshot, base, 1, memory_mib)


def test_a_pass_plans_each_sandbox_by_its_state_shape_and_base() -> None:
    hosts = [based("h0"), based("h1", free=1500), based("h2", free=9000, bases=(OTHER,)),
             based("h3", free=12000), based("h4", free=16000)]
    local = [("big", State.RUNNING), ("small", State.RUNNING), ("shipped", State.SUSPENDED),
             ("fresh", State.SUSPENDED), ("nobase", State.SUSPENDED), ("lag", State.SUSPENDED),
             ("p", State.PAUSED), ("gone", State.DESTROYED), ("f", State.FAILED)]
    records = {"shipped": suspended("shipped", memory_mib=4000),
               "fresh": suspended("fresh", snapshot=""),  # uploaded not yet
               "nobase": suspended("nobase", base=""),
               "lag": suspended("lag", state=State.RUNNING)}  # the record lags the host
    shapes = {"big": Request(memory_mib=8000, vcpus=2), "small": Request(256, 1)}
    actions = drain.plan("h0", local, records, hosts, {"h0", "h4"}, shape=shapes.__getitem__,
                         k=5, rng=random.Random(3))
    by_id = {a.sandbox_id: a for a in actions}
    assert "gone" not in by_id
    # the running one by its own shape: only h2 and h3 have 8000 MiB free (h4 drains)
    assert isinstance(by_id["big"], drain.Migrate) and by_id["big"].to_host in {"h2", "h3"}
    assert isinstance(by_id["small"], drain.Migrate)
    # the shipped one by its record's shape, to a holder of its base (not h2), with room
    assert by_id["shipped"] == drain.HandOver("shipped", "h3", SNAP)
    for sid, words in (("fresh", "not uploaded"), ("nobase", "no base"),
                       ("lag", "record does not say"), ("p", "paused"), ("f", "failed")):
        assert isinstance(by_id[sid], drain.Left) and words in by_id[sid].reason, by_id[sid]


def test_a_pass_counts_what_it_already_placed() -> None:
    hosts = [based("h0"), based("h1", free=5000), based("h2", free=4000)]
    local = [(f"s{i}", State.SUSPENDED) for i in range(3)]
    records = {sid: suspended(sid, memory_mib=3000) for sid, _ in local}
    actions = drain.plan("h0", local, records, hosts, {"h0"}, k=2, rng=random.Random(1))
    assert [type(a) for a in actions] == [drain.HandOver, drain.HandOver, drain.Left]
    assert {a.to_host for a in actions[:2]} == {"h1", "h2"}  # not both on the emptiest


def test_nowhere_holds_the_base_the_suspended_one_waits() -> None:
    actions = drain.plan("h0", [("s", State.SUSPENDED)], {"s": suspended("s")},
                         [based("h0"), based("h1", bases=(OTHER,))], {"h0"})
    assert actions == [drain.Left("s", f"no live host holds its base {BASE[:16]}")]


class FakeOwnership:
    def __init__(self, record: SandboxRecord) -> None:
        self.record, self.moves = record, []

    async def get(self, sandbox_id):  # type: ignore[no-untyped-def]
        from gateway.cluster.ownership import Versioned

        return Versioned(self.record, 7)

    async def move(self, current, to_host, state, guards=()):  # type: ignore[no-untyped-def]
        self.moves.append((current.record.id, to_host, state))
        self.record = current.record.moved_to(to_host, state)


async def test_a_move_marks_the_sandbox_busy_for_the_adopter_until_it_ends() -> None:
    """Both kinds of move: while it runs, the adopter is told the record moved away (as
    the route cache would) and must not evict the local copy; after, it looks again."""
    from gateway.cluster.adopter import Adopter, Local

    evicted: list[str] = []
    local_state = {"r": State.RUNNING, "s": State.SUSPENDED}

    async def evict(sandbox_id, holder):  # type: ignore[no-untyped-def]
        evicted.append(sandbox_id)
        return True

    async def nothing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("no adoption expected")

    adopter = Adopter("h0", None, None, lambda: 1, Local(  # type: ignore[arg-type]
        state=local_state.get, adoptable=lambda s: False, adopt=nothing, evict=evict,
        bases=lambda: (BASE,)))
    records = {"s": suspended("s"), "r": SandboxRecord("r", "h0", State.RUNNING, 3)}
    seen_busy: list[tuple[str, bool]] = []
    own = FakeOwnership(records["s"])

    async def landed(sandbox_id: str, dest: str) -> None:
        # the record's move landed; the route cache tells the adopter at once
        seen_busy.append((sandbox_id, sandbox_id in adopter.busy))
        adopter.consider(SandboxRecord(sandbox_id, dest, State.RUNNING, 4))
        await asyncio.sleep(0.01)
        assert adopter.working == 0  # left alone: no eviction started

    async def move(sandbox_id, dest, peer, record_move):  # type: ignore[no-untyped-def]
        await landed(sandbox_id, dest)
        local_state.pop(sandbox_id)  # the move's end: DESTROYED here

    async def hand_over(sandbox_id, dest, record_move):  # type: ignore[no-untyped-def]
        await record_move()
        await landed(sandbox_id, dest)
        local_state.pop(sandbox_id)

    drainer = drain.Drainer("h0", None, KEYS, lambda: [based("h0"), based("h1")],  # type: ignore[arg-type]
                            lambda: {"h0"}, lambda: sorted(local_state.items()), move,
                            lambda: "key", records=lambda: records, hand_over=hand_over,
                            busy=adopter.busy,
                            after=lambda sid: adopter.consider(records[sid]))
    drainer.ownership = own  # type: ignore[assignment]
    result = await drainer.drain_once()
    assert result.moved == ["r", "s"] and not result.failed, result
    assert seen_busy == [("r", True), ("s", True)] and adopter.busy == set()
    assert own.moves == [("s", "h1", State.SUSPENDED)]
    await asyncio.sleep(0.01)
    assert evicted == []


async def test_a_handover_moves_only_the_record_the_pass_saw() -> None:
    """The record's compare-and-set refuses (and the sandbox stays here) if a local change
    waits to be published, or the record no longer names this host's shipped suspend."""
    own = FakeOwnership(suspended("s"))
    pending = {"s"}
    drainer = drain.Drainer("h0", None, KEYS, list, set, list, None, str,  # type: ignore[arg-type]
                            settled=lambda sid: sid not in pending)
    drainer.ownership = own  # type: ignore[assignment]
    action = drain.HandOver("s", "h1", SNAP)
    with pytest.raises(drain.ClusterError, match="published"):
        await drainer._handover_record(action)()
    pending.clear()
    own.record = suspended("s", snapshot="p/snapshots/s/1#" + "d" * 64)  # a newer suspend
    with pytest.raises(drain.ClusterError, match="changed"):
        await drainer._handover_record(action)()
    assert own.moves == []
    own.record = suspended("s")
    await drainer._handover_record(action)()
    assert own.moves == [("s", "h1", State.SUSPENDED)] and own.record.gen == 4


async def test_the_node_gives_the_drainer_the_adopters_busy_set() -> None:
    from gateway.cluster.config import ClusterConfig
    from gateway.cluster.node import ClusterNode, Load

    node = ClusterNode(ClusterConfig(
        enabled=True, endpoints=["http://127.0.0.1:1"], host="h1", advertise="127.0.0.1:8080",
        objstore_endpoint="http://127.0.0.1:2", objstore_bucket="snaps",
        objstore_access_key="AK", objstore_secret_key="SK"), lambda: Load(100, 50, 2, 2, 0))
    try:
        async def give(*args):  # type: ignore[no-untyped-def]
            return None
        node.start_drainer(list, None, str, hand_over=give)
        assert node.adopter is not None and node.drainer.busy is node.adopter.busy
        assert node.drainer.hand_over is give
        assert node.drainer.settled == node.publisher.settled
    finally:
        await node.aclose()


def test_what_the_cli_says_is_left() -> None:
    assert "migration" in drain.why_left(SandboxRecord("r", "h0", State.RUNNING))
    assert "not uploaded" in drain.why_left(suspended("s", snapshot=""))
    assert "holding its base" in drain.why_left(suspended("s"))
    assert drain.why_left(suspended("p", state=State.PAUSED)).startswith("paused")


async def test_drain_wait_says_empty_or_what_is_left(monkeypatch, capsys) -> None:
    """``agentbox-server drain HOST --wait S``: 0 and "empty" once only FAILED records name
    the host; 1 after S seconds with each sandbox left and why."""
    from gateway import cli
    from gateway.cluster import etcd, ownership
    from gateway.cluster.config import ClusterConfig
    from gateway.cluster.ownership import Versioned

    views = [{"r": SandboxRecord("r", "h0", State.RUNNING), "s": suspended("s"),
              "f": SandboxRecord("f", "h0", State.FAILED, reason="x")},
             {"s": suspended("s"), "f": SandboxRecord("f", "h0", State.FAILED, reason="x")},
             {"f": SandboxRecord("f", "h0", State.FAILED, reason="x"),
              "s": suspended("s", host="h1")}]

    class FakeClient:
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            pass

        async def put(self, *args):  # type: ignore[no-untyped-def]
            return None

        async def aclose(self) -> None:
            return None

    class FakeOwnership:
        def __init__(self, *args):  # type: ignore[no-untyped-def]
            pass

        async def list(self):  # type: ignore[no-untyped-def]
            view = views.pop(0) if len(views) > 1 else views[0]
            return 1, {sid: Versioned(r, 1) for sid, r in view.items()}

    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(etcd, "EtcdClient", FakeClient)
    monkeypatch.setattr(ownership, "Ownership", FakeOwnership)
    monkeypatch.setattr(cli.asyncio, "sleep", no_sleep)
    config = ClusterConfig(enabled=True, endpoints=["http://127.0.0.1:1"], host="h9",
                           advertise="127.0.0.1:8080")
    assert await cli._drain(config, "h0", False, 60.0) == 0
    out = capsys.readouterr().out
    assert "h0: empty: 1 running and 1 suspended sandbox(es) moved" in out, out
    assert "1 FAILED record(s) stay on its name" in out and ": f" in out

    views[:] = [{"s": suspended("s", snapshot="")}]
    assert await cli._drain(config, "h0", False, 0.001) == 1  # spins (no sleep) past it
    err = capsys.readouterr().err
    assert "not empty" in err and "s: suspended: its snapshot is not uploaded yet" in err, err


async def test_a_handover_whose_answer_is_lost_reads_the_record_back() -> None:
    """etcd did not say whether the record's move landed: while the requests are still
    held, the record is read back; landed -> moved, as it was -> not moved (stays here)."""
    from gateway.cluster.errors import EtcdUncertain

    class LostAnswer(FakeOwnership):
        def __init__(self, record: SandboxRecord, lands: bool) -> None:
            super().__init__(record)
            self.lands = lands

        async def move(self, current, to_host, state, guards=()):  # type: ignore[no-untyped-def]
            if self.lands:
                await super().move(current, to_host, state)
            raise EtcdUncertain("answer lost")

    action = drain.HandOver("s", "h1", SNAP)
    for lands in (True, False):
        drainer = drain.Drainer("h0", None, KEYS, list, set, list, None, str)  # type: ignore[arg-type]
        own = LostAnswer(suspended("s"), lands)
        drainer.ownership = own  # type: ignore[assignment]
        if lands:
            await drainer._handover_record(action)()
            assert (own.record.host, own.record.gen) == ("h1", 4)
        else:
            with pytest.raises(drain.ClusterError, match="did not land"):
                await drainer._handover_record(action)()
            assert own.record.host == "h0"
