"""Keys, placement of creates and fleet quotas: the decisions, without etcd (the same
paths against real etcd: tests/cluster/test_fleet.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.cluster import routing, wire
from gateway.cluster.errors import EtcdUnavailable, ProtocolError
from gateway.cluster.keyring import KeyRecord, KeyRing, merge, plan
from gateway.cluster.keys import Keys
from gateway.cluster.placement import Request
from gateway.cluster.quota import FleetQuota, counts, encode, here, total
from gateway.cluster.records import HostRecord
from gateway.store.registry import Registry, hash_key
from gateway.errors import Unavailable
from gateway.tenancy.quotas import Limits, Usage
from tests.unit.cluster_gateways import KEY, FakeNode, build

KEYS = Keys("/t")


def record(key_id: str = "key_1", **changes: object) -> KeyRecord:
    base = dict(id=key_id, name="n", hash="a" * 64, admin=False, created_at=1.0,
                limits={}, revoked=False)
    return KeyRecord(**{**base, **changes})  # type: ignore[arg-type]


def test_what_crosses_is_the_registry_row_never_the_secret(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "r.db")
    key, secret = registry.create_key("t", limits={"max_sandboxes": 2})
    [(stored, key_hash)] = registry.keys_with_hashes()
    raw = KeyRecord.of(stored, key_hash).encode()
    assert secret.encode() not in raw and secret[3:].encode() not in raw
    assert json.loads(raw)["hash"] == hash_key(secret)
    assert KeyRecord.decode(raw) == KeyRecord.of(key, hash_key(secret))
    with pytest.raises(ProtocolError):
        KeyRecord.decode(json.dumps({**json.loads(raw), "hash": secret}).encode())
    with pytest.raises(ProtocolError):
        KeyRecord.decode(b"{")


def test_registry_applies_fleet_keys_without_echo_and_revocation_is_final(
        tmp_path: Path) -> None:
    a, b = Registry(tmp_path / "a.db"), Registry(tmp_path / "b.db")
    heard_a: list[str] = []
    heard_b: list[str] = []
    a.key_listeners.append(heard_a.append)
    b.key_listeners.append(heard_b.append)
    key, secret = a.create_key("t")
    a.set_key_limits(key.id, {"max_awake": 1})
    a.revoke_key(key.id)
    assert heard_a == [key.id] * 3
    assert not a.revoke_key("key_none") and heard_a == [key.id] * 3
    live = KeyRecord.of(key, hash_key(secret))
    b.store_key(live.api_key(), live.hash)
    assert b.lookup_key(secret) is not None and heard_b == []
    b.store_key(key.__class__(**{**key.__dict__, "revoked": True}), live.hash)
    assert b.lookup_key(secret) is None
    b.store_key(live.api_key(), live.hash)  # a late copy from before the revocation
    assert b.lookup_key(secret) is None and b.get_key(key.id).revoked


def test_plan_writes_new_and_changed_keys_and_keeps_a_fleet_revocation() -> None:
    same, changed, new = record("key_s"), record("key_c"), record("key_n")
    fleet = {"key_s": same, "key_c": record("key_c", limits={"rate": 1.0}),
             "key_r": record("key_r", revoked=True), "key_x": record("key_x")}
    local = {"key_s": same, "key_c": changed, "key_n": new, "key_r": record("key_r")}
    assert plan(local, fleet) == [changed, new]  # key_r: revoked stays; key_x: not ours
    assert merge(record(revoked=True), record()).revoked
    assert merge(record(), record(revoked=True)).revoked
    assert merge(record(), None) == record()


class _Store:
    def __init__(self) -> None:
        self.stored: list[tuple[str, str, bool]] = []

    def keys_with_hashes(self) -> list:
        return []

    def store_key(self, key, key_hash: str) -> None:
        self.stored.append((key.id, key_hash, key.revoked))


def test_watched_keys_are_applied_and_bad_records_skipped() -> None:
    store = _Store()
    ring = KeyRing(None, KEYS, store)  # type: ignore[arg-type]

    def put(value: bytes, rev: int) -> wire.Event:
        return wire.Event(wire.EventType.PUT, wire.KeyValue(b"/t/apikeys/k", value, rev,
                                                            rev, 1, 0))
    ring.apply((put(record(revoked=True).encode(), 5), put(b"junk", 6),
                wire.Event(wire.EventType.DELETE, wire.KeyValue(b"/t/apikeys/k", b"", 0, 7,
                                                                0, 0))))
    assert store.stored == [("key_1", "a" * 64, True)]
    assert ring.fleet == {"key_1": record(revoked=True)} and ring._revs == {"key_1": 5}


def host(name: str, free_mib: int, free_vcpus: int = 8) -> HostRecord:
    return HostRecord(name, f"10.0.0.{len(name)}:8080", 16000, free_mib, 8, free_vcpus, 0)


def test_place_keeps_a_create_here_unless_another_host_is_chosen() -> None:
    req, rng = Request(512, 1), random.Random(1)
    roomy, tight = host("host-a", 12000), host("host-b", 1000)
    assert routing.place([roomy, tight], "host-b", req, k=2, rng=rng) == \
        routing.Forward("host-a", roomy.address, 0)
    assert routing.place([roomy, tight], "host-a", req, k=2, rng=rng) == routing.ServeHere()
    assert routing.place([tight], "host-b", req, k=2, rng=rng) == routing.ServeHere()
    assert routing.place([], "host-b", req, k=2, rng=rng) == routing.ServeHere()
    full = host("host-a", 100)
    assert routing.place([full, host("host-b", 100)], "host-b", req, k=2, rng=rng) == \
        routing.ServeHere()  # nobody has room: this host answers with its own admission
    # seeded: the same seed makes the same choices among many equal hosts
    many = [host(f"h{i}", 8000) for i in range(9)]
    picks = [routing.place(many, "h0", req, k=2, rng=random.Random(3)) for _ in range(3)]
    assert len(set(picks)) == 1


async def test_a_create_is_forwarded_once_to_the_chosen_host() -> None:
    a, b = FakeNode("host-a"), FakeNode("host-b")
    server_a = TestServer(build(a, set()), host="127.0.0.1")
    server_b = TestServer(build(b, set()), host="127.0.0.1")
    await server_a.start_server()
    await server_b.start_server()
    b.placed = routing.Forward("host-a", f"127.0.0.1:{server_a.port}", 0)
    a.placed = routing.Forward("host-b", f"127.0.0.1:{server_b.port}", 0)  # never used
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(server_b.make_url("/v1/sandboxes"), data=b"{}",
                                 headers={"Authorization": KEY}) as resp:
                # A answered (the fake's 404 names it); the hop header stopped A placing
                # it again (A's placement would have sent it back to B).
                assert "on host-a" in (await resp.json())["error"]["message"]
            b.fenced = "lease lost"
            async with http.post(server_b.make_url("/v1/sandboxes"), data=b"{}",
                                 headers={"Authorization": KEY}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "host_fenced"
            b.fenced, b.placed = None, None
            async with http.post(server_b.make_url("/v1/sandboxes"), data=b"{}",
                                 headers={"Authorization": KEY}) as resp:
                assert "on host-b" in (await resp.json())["error"]["message"]
    finally:
        await server_b.close()
        await server_a.close()


def test_fleet_usage_sums_other_hosts_and_skips_junk() -> None:
    def kv(h: str, value: bytes) -> wire.KeyValue:
        return wire.KeyValue(KEYS.usage("key_1", h).encode(), value, 1, 1, 1, 0)
    kvs = [kv("host-a", encode(Usage(3, 2))), kv("host-b", encode(Usage(5, 5))),
           kv("host-c", b"nope"), kv("host-d", encode(Usage(1, 0)))]
    assert counts(KEYS, "key_1", "host-b", kvs) == (Usage(4, 2), Usage(5, 5))
    assert total(Usage(1, 1, 99), Usage(4, 2)) == Usage(5, 3, 99)
    # a create in flight here reserved 5 before its insert: count 5, not the registry's 4
    assert here(Usage(4, 4, 7), Usage(5, 5)) == Usage(5, 5, 7)
    assert here(Usage(6, 1), Usage(5, 5)) == Usage(6, 5)
    with pytest.raises(ValueError):
        KEYS.usage("key/../x", "host-a")


class _DeadEtcd:
    calls = 0

    async def get_prefix(self, *_: object, **__: object) -> None:
        self.calls += 1
        raise EtcdUnavailable("no etcd endpoint answered")


async def test_a_quota_that_cannot_be_counted_is_not_waived() -> None:
    etcd = _DeadEtcd()
    quota = FleetQuota(etcd, KEYS, "host-a", lambda t: Usage(), set)  # type: ignore[arg-type]
    with pytest.raises(Unavailable) as caught:
        await quota.check("key_1", Limits(max_sandboxes=3), Usage())
    assert caught.value.status == 503 and caught.value.headers["Retry-After"]
    await quota.check("key_1", Limits(), Usage())  # nothing to count: etcd not asked
    assert etcd.calls == 1
