"""The watcher: each revision delivered once and in order across broken streams; compaction
stops it; its task is owned and closed."""

from __future__ import annotations

import asyncio

import pytest

from gateway.cluster import wire
from gateway.cluster.errors import Compacted, EtcdUnavailable
from gateway.cluster.watch import Watcher


def kv(rev: int) -> wire.KeyValue:
    return wire.KeyValue(f"k{rev}".encode(), b"", rev, rev, 1, 0)


def events(*revs: int) -> wire.WatchBatch:
    return wire.WatchBatch(revision=max(revs),
                           events=tuple(wire.Event(wire.EventType.PUT, kv(r)) for r in revs))


CREATED = wire.WatchBatch(revision=1, events=(), created=True)


class _Client:
    """Each stream replays what the server would send from the asked revision: the events
    at or after it among ``history``, then breaks (or hangs, on the last one)."""

    endpoints = ("a", "b", "c")

    def __init__(self, history: list[int], breaks: int) -> None:
        self.history, self.breaks, self.asked, self.probed = history, breaks, [], []

    def order(self) -> list[int]:
        return [0, 1, 2]

    async def probe(self, index: int, timeout: float) -> bool:
        self.probed.append(index)
        return index != 0  # member "a" is cut off; the others answer

    async def watch_stream(self, index: int, body: dict):
        start = int(body["create_request"]["start_revision"])
        self.asked.append((index, start))
        yield CREATED
        # A reconnecting server may resend a revision we already had: overlap by one.
        for rev in self.history:
            if rev >= start - 1:
                yield events(rev)
        if len(self.asked) <= self.breaks:
            raise EtcdUnavailable("member died")
        await asyncio.sleep(3600)


async def test_every_revision_once_in_order_across_reconnects() -> None:
    seen: list[int] = []
    client = _Client([3, 4, 6, 9], breaks=2)
    watcher = Watcher(client, "k", None, 3, lambda b: seen.extend(e.kv.mod_revision for e in b),
                      name="t", retry_delay=0)
    watcher.start()
    for _ in range(50):
        await asyncio.sleep(0.01)
    assert seen == [3, 4, 6, 9]
    assert watcher.reconnects == 2 and watcher.next_revision == 10
    assert client.asked == [(0, 3), (1, 10), (2, 10)]  # moves on to the next member
    assert watcher.ready.is_set()
    await watcher.aclose()
    await watcher.aclose()
    assert not watcher.ready.is_set()


def test_deliver_skips_old_events_and_follows_progress_notices() -> None:
    seen: list[tuple[int, ...]] = []
    watcher = Watcher(_Client([], 0), "k", None, 5,
                      lambda b: seen.append(tuple(e.kv.mod_revision for e in b)), name="t")
    watcher.deliver(events(3, 4))
    watcher.deliver(events(4, 5, 6))
    watcher.deliver(wire.WatchBatch(revision=20, events=()))  # progress: nothing up to 20
    watcher.deliver(events(21))
    assert seen == [(5, 6), (21,)] and watcher.next_revision == 22


async def test_compaction_stops_the_watcher_and_tells_the_owner() -> None:
    errors: list[BaseException] = []

    class Compacting(_Client):
        async def watch_stream(self, index: int, body: dict):
            yield wire.WatchBatch(revision=9, events=(), canceled=True, compact_revision=7)

    watcher = Watcher(Compacting([], 0), "k", None, 2, lambda b: None, name="t",
                      on_error=errors.append)
    watcher.start()
    await asyncio.sleep(0.05)
    assert isinstance(watcher.exception, Compacted) and errors == [watcher.exception]
    assert watcher.exception.compact_revision == 7
    await watcher.aclose()


def test_start_revision_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Watcher(_Client([], 0), "k", None, 0, lambda b: None, name="t")


async def test_a_silent_member_that_fails_its_probe_is_left() -> None:
    seen: list[int] = []
    client = _Client([3], breaks=0)  # every stream goes quiet after its events
    watcher = Watcher(client, "k", None, 3, lambda b: seen.extend(e.kv.mod_revision for e in b),
                      name="t", retry_delay=0, probe_after=0.05)
    watcher.start()
    await asyncio.sleep(0.4)
    assert seen == [3]
    assert client.asked[:2] == [(0, 3), (1, 4)]  # left "a" for "b" after a failed probe
    assert len(client.asked) == 2 and client.probed[0] == 0 and set(client.probed[1:]) == {1}
    await watcher.aclose()
