"""The route table (no I/O) and the cache's list-then-watch, re-listing after compaction."""

from __future__ import annotations

import asyncio

from gateway.cluster import wire
from gateway.cluster.errors import EtcdUnavailable
from gateway.cluster.keys import Keys
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.cluster.routes import RouteCache, RouteTable
from gateway.sandbox.states import State

KEYS = Keys("/t")
HOST_A = HostRecord("host-a", "10.0.0.1:8080")
SB = SandboxRecord("sb1", "host-a", State.RUNNING)


def kv(key: str, value: bytes, rev: int) -> wire.KeyValue:
    return wire.KeyValue(key.encode(), value, 1, rev, 1, 0)


def put(key: str, value: bytes, rev: int) -> wire.Event:
    return wire.Event(wire.EventType.PUT, kv(key, value, rev))


def delete(key: str, rev: int) -> wire.Event:
    return wire.Event(wire.EventType.DELETE, kv(key, b"", rev))


def test_lookups_follow_the_listing_and_the_events() -> None:
    table = RouteTable(KEYS)
    table.load(10, [kv(KEYS.host("host-a"), HOST_A.encode(), 5),
                    kv(KEYS.sandbox("sb1"), SB.encode(), 9),
                    kv("/t/elections/reaper", b"x", 3)])
    route = table.route("sb1")
    assert route is not None and route.live and route.address == "10.0.0.1:8080"
    assert route.gen == 1 and table.route("nope") is None
    moved = SB.moved_to("host-b", State.RESTORING)
    table.apply((put(KEYS.sandbox("sb1"), moved.encode(), 11),))
    route = table.route("sb1")
    assert (route.host, route.gen, route.live) == ("host-b", 2, False)  # host-b has no record
    table.apply((delete(KEYS.host("host-a"), 12), put(KEYS.host("host-b"),
                 HostRecord("host-b", "10.0.0.2:8080").encode(), 12)))
    assert table.route("sb1").address == "10.0.0.2:8080" and "host-a" not in table.hosts
    table.apply((delete(KEYS.sandbox("sb1"), 13),))
    assert table.route("sb1") is None and table.revision == 13


def test_events_already_in_the_listing_are_ignored_and_bad_records_skipped() -> None:
    table = RouteTable(KEYS)
    table.load(10, [kv(KEYS.sandbox("sb1"), SB.encode(), 9),
                    kv(KEYS.sandbox("bad"), b"{not json", 8)])
    assert table.skipped == 1 and set(table.sandboxes) == {"sb1"}
    table.apply((delete(KEYS.sandbox("sb1"), 9),))  # older than the listing
    assert table.route("sb1") is not None


class _Client:
    """A listing in pages, then watch streams: the first says 'compacted', the next one
    (after the re-list) delivers one event and then stays open."""

    endpoints = ("a",)

    def __init__(self) -> None:
        self.store = [kv(KEYS.host("host-a"), HOST_A.encode(), 2),
                      kv(KEYS.sandbox("sb1"), SB.encode(), 3),
                      kv(KEYS.sandbox("sb2"), SB.encode().replace(b"sb1", b"sb2"), 4)]
        self.revision, self.ranges, self.watches, self.fail_lists = 4, [], [], 0

    def order(self) -> list[int]:
        return [0]

    async def range(self, key, end=None, *, limit=0, revision=0):
        self.ranges.append((key, limit, revision))
        if self.fail_lists:
            self.fail_lists -= 1
            raise EtcdUnavailable("down")
        rest = [k for k in self.store if k.key >= key]
        page = rest[:limit]
        return wire.RangeResult(revision or self.revision, tuple(page), len(rest),
                                more=len(rest) > limit)

    async def probe(self, index, timeout=None) -> bool:
        return True

    async def watch_stream(self, index, body):
        start = int(body["create_request"]["start_revision"])
        self.watches.append(start)
        yield wire.WatchBatch(revision=self.revision, events=(), created=True)
        if len(self.watches) == 1:
            yield wire.WatchBatch(revision=9, events=(), canceled=True, compact_revision=8)
            return
        moved = SB.moved_to("host-b", State.RESTORING)
        yield wire.WatchBatch(revision=10, events=(put(KEYS.sandbox("sb1"), moved.encode(),
                                                       10),))
        await asyncio.sleep(3600)


async def test_the_cache_lists_in_pages_then_relists_after_compaction(monkeypatch) -> None:
    monkeypatch.setattr("gateway.cluster.routes.PAGE", 2)
    client = _Client()
    cache = RouteCache(client, KEYS)
    await cache.start()
    assert set(cache.table.sandboxes) == {"sb1", "sb2"}
    # two pages, the second pinned at the first one's revision
    assert [(r[1], r[2]) for r in client.ranges[:2]] == [(2, 0), (2, 4)]
    client.revision, client.fail_lists = 9, 1  # the re-list fails once, then works
    for _ in range(100):
        if cache.relists and cache.route("sb1").gen == 2:
            break
        await asyncio.sleep(0.02)
    assert cache.relists == 1 and client.watches == [5, 10]
    assert cache.route("sb1").host == "host-b"
    await cache.aclose()
    await cache.aclose()
