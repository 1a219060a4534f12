"""Placement: least-loaded live host by free RAM fraction, awake count, vCPUs; best-of-K."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.cluster.errors import NoCapacity
from gateway.cluster.placement import Request, choose
from gateway.cluster.records import HostRecord

REQ = Request(memory_mib=1024, vcpus=1)


def host(name: str, free_mib: int, total_mib: int = 16384, free_vcpus: int = 8,
         awake: int = 0) -> HostRecord:
    return HostRecord(name, f"{name}:8080", total_mib, free_mib, 16, free_vcpus, awake)


def test_most_free_ram_fraction_wins_when_k_covers_all() -> None:
    hosts = [host("a", 4096), host("b", 12000), host("c", 8000)]
    assert choose(hosts, REQ, k=3).name == "b"
    # Fractions, not absolutes: 6 of 8 GiB free beats 8 of 32 GiB free.
    small, big = host("small", 6144, total_mib=8192), host("big", 8192, total_mib=32768)
    assert choose([small, big], REQ, k=2).name == "small"


def test_ties_go_to_fewer_awake_then_more_vcpus_then_name() -> None:
    assert choose([host("a", 8000, awake=5), host("b", 8000, awake=1)], REQ, k=2).name == "b"
    assert choose([host("a", 8000, free_vcpus=2), host("b", 8000, free_vcpus=6)], REQ,
                  k=2).name == "b"
    assert choose([host("b", 8000), host("a", 8000)], REQ, k=2).name == "a"


def test_no_room_says_why_for_each_host() -> None:
    hosts = [host("a", 512), host("b", 8000, free_vcpus=0), host("c", 8000)]
    with pytest.raises(NoCapacity) as info:
        choose(hosts, REQ, exclude={"c"})
    assert set(info.value.reasons) == {"a", "b", "c"}
    assert "MiB" in info.value.reasons["a"] and "vCPU" in info.value.reasons["b"]
    assert info.value.reasons["c"] == "excluded"
    with pytest.raises(NoCapacity, match="no live hosts"):
        choose([], REQ)


def test_best_of_two_spreads_load_and_never_picks_the_worst() -> None:
    hosts = [host(f"h{i}", 1024 + 1000 * i) for i in range(6)]
    rng = random.Random(7)
    picks = Counter(choose(hosts, REQ, k=2, rng=rng).name for _ in range(600))
    assert "h0" not in picks  # the emptiest-last host loses every pair it is in
    assert picks["h5"] > picks["h4"] > picks["h1"]  # better hosts win more pairs
    assert len(picks) == 5  # but not all go to one host (no herd)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        Request(0, 1)
    with pytest.raises(ValueError):
        choose([host("a", 8000)], REQ, k=0)
