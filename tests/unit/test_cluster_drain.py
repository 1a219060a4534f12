"""Drain without etcd or VMs (gateway/cluster/drain.py): the draining mark in the route
table, placement skipping it, a Drainer pass over a host's sandboxes, and the checks a
moved sandbox's fields get on the destination (gateway/sandbox/migration.py)."""

from __future__ import annotations

import random

import pytest

from gateway.cluster import drain, wire
from gateway.cluster.keys import Keys
from gateway.cluster.records import HostRecord
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
    assert result.moved == ["a"] and result.left == ["s"]
    assert set(result.failed) == {"bad"}


async def test_with_nowhere_to_go_nothing_moves() -> None:
    async def move(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("no move expected")

    drainer = drain.Drainer("h0", None, KEYS, lambda: [host("h0")], lambda: {"h0"},  # type: ignore[arg-type]
                            lambda: [("a", State.RUNNING)], move, lambda: "key")
    result = await drainer.drain_once()
    assert result.moved == [] and "no other live host" in result.failed["a"]


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
