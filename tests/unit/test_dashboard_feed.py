"""The transition feed (gateway.store.feed) and the registry's publish hook: fan-out,
tenant scoping, bounds (a slow subscriber is dropped, never blocks), shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.errors import RateLimited
from gateway.sandbox.states import Event, IllegalTransition, State
from gateway.store.feed import Feed, FeedLimits, Transition
from gateway.store.registry import Registry, SandboxRecord


def item(n: int, tenant: str = "key_a", sandbox: str = "sb1") -> Transition:
    return Transition(n, sandbox, tenant, "running", "suspended", "suspend", "idle", 1.0 * n)


async def test_each_subscriber_gets_the_transitions_its_key_may_see():
    feed = Feed()
    mine, other, admin = (feed.subscribe("key_a", "key_a"), feed.subscribe("key_b", "key_b"),
                          feed.subscribe("key_admin", None))
    feed.publish(item(1, "key_a"))
    feed.publish(item(2, "key_b"))
    assert (await mine.next()).seq == 1
    assert (await other.next()).seq == 2
    assert [(await admin.next()).seq for _ in range(2)] == [1, 2]
    assert not mine._items and not other._items


async def test_a_reader_waits_for_the_next_transition():
    feed = Feed()
    sub = feed.subscribe("key_a", "key_a")
    waiting = asyncio.create_task(sub.next())
    await asyncio.sleep(0)
    assert not waiting.done()
    feed.publish(item(7))
    assert (await asyncio.wait_for(waiting, 1)).seq == 7


async def test_a_slow_subscriber_is_dropped_and_others_keep_going():
    feed = Feed(FeedLimits(queue=3))
    slow, fast = feed.subscribe("key_a", None), feed.subscribe("key_b", None)
    started = time.perf_counter()
    for n in range(1, 6):
        feed.publish(item(n))
        assert (await fast.next()).seq == n
    assert time.perf_counter() - started < 0.5  # publishing never waited for the slow one
    assert slow.dropped and "dropped" in repr(slow)
    assert await slow.next() is None  # what it had buffered is discarded: it must reload
    assert len(feed) == 1  # the dropped one is gone, the fast one stays


async def test_subscriptions_are_bounded_per_key_and_in_total():
    feed = Feed(FeedLimits(per_key=2, total=3))
    a1, _ = feed.subscribe("key_a", "key_a"), feed.subscribe("key_a", "key_a")
    with pytest.raises(RateLimited, match="per key"):
        feed.subscribe("key_a", "key_a")
    feed.subscribe("key_b", "key_b")
    with pytest.raises(RateLimited, match="too many event streams"):
        feed.subscribe("key_c", "key_c")
    a1.close()
    a1.close()  # idempotent
    feed.subscribe("key_c", "key_c")
    with pytest.raises(ValueError, match="queue"):
        FeedLimits(queue=0)


async def test_close_ends_every_stream_after_what_it_buffered_and_refuses_new_ones():
    feed = Feed()
    sub, waiter = feed.subscribe("key_a", None), feed.subscribe("key_b", None)
    got = asyncio.create_task(waiter.next())
    await asyncio.sleep(0)
    got.cancel()  # a reader cancelled mid-wait loses nothing
    feed.publish(item(1))
    feed.close()
    assert (await sub.next()).seq == 1 and await sub.next() is None
    assert (await waiter.next()).seq == 1 and await waiter.next() is None
    assert len(feed) == 0
    with pytest.raises(RateLimited):
        feed.subscribe("key_a", None)


async def test_publish_from_another_thread_hops_to_the_loop():
    feed = Feed()
    sub = feed.subscribe("key_a", None)
    thread = threading.Thread(target=feed.publish, args=(item(3),))
    thread.start()
    thread.join()
    assert (await asyncio.wait_for(sub.next(), 1)).seq == 3


def _record(sid: str, tenant: str) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(id=sid, tenant=tenant, template="python", state=State.CREATING,
                         slot=1, root="/r", golden="/g", idle_timeout=60, host="h",
                         created_at=now, updated_at=now, last_activity=now)


def test_the_registry_publishes_each_committed_transition(tmp_path):
    registry = Registry(tmp_path / "r.sqlite")
    seen: list[Transition] = []
    registry.listeners.append(seen.append)
    registry.listeners.append(lambda _: 1 / 0)  # a broken listener never breaks the registry
    registry.insert_sandbox(_record("sb1", "key_a"))
    registry.transition("sb1", Event.CREATED, cause="booted")
    with pytest.raises(IllegalTransition):
        registry.transition("sb1", Event.CREATED)  # illegal now: nothing published
    rows = registry.transitions("sb1")
    assert [(t.seq, t.from_state, t.to_state, t.event, t.cause, t.tenant) for t in seen] == [
        (r["seq"], r["from_state"], r["to_state"], r["event"], r["cause"], "key_a")
        for r in rows]
    assert seen[0].from_state is None and seen[1].to_state == "running"
    registry.close()
