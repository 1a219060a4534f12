"""The transition feed: every state change the registry records, fanned out live.

The registry calls :meth:`Feed.publish` right after a transition commits (synchronously,
on the event loop thread). Publishing never blocks and never fails the registry: each
subscriber has its own bounded buffer, and a subscriber whose buffer is full is *dropped*
(its reader sees the end of its stream with ``dropped`` set and starts over from a fresh
listing). Subscriptions are bounded per key and in total, and :meth:`Feed.close` ends them
all at shutdown. ``GET /v1/events`` (gateway.http.events_routes) is the one reader.

Scoping: a subscription made with ``tenant=None`` (an admin key) sees every sandbox's
transitions; any other sees only those of sandboxes its key owns.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass

from gateway.errors import RateLimited

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transition:
    """One recorded state change (a row of the registry's ``transitions`` table)."""

    seq: int
    sandbox_id: str
    tenant: str
    from_state: str | None
    to_state: str
    event: str
    cause: str
    at: float


@dataclass(frozen=True)
class FeedLimits:
    queue: int = 256  # transitions buffered per subscriber before it is dropped
    per_key: int = 4  # open subscriptions per API key
    total: int = 256  # open subscriptions in all

    def __post_init__(self) -> None:
        for name in ("queue", "per_key", "total"):
            if getattr(self, name) < 1:
                raise ValueError(f"feed limit {name} must be at least 1")


class Subscription:
    """One reader's view of the feed: ``await next()`` until it returns None."""

    def __init__(self, feed: Feed, key_id: str, tenant: str | None, size: int) -> None:
        self.feed, self.key_id, self.tenant = feed, key_id, tenant
        self.dropped = False  # True: it fell behind and lost transitions
        self.closed = False
        self._items: collections.deque[Transition] = collections.deque()
        self._size = size
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        state = "dropped" if self.dropped else "closed" if self.closed else "open"
        return f"<Subscription {self.key_id} {state} {len(self._items)} queued>"

    def wants(self, item: Transition) -> bool:
        return self.tenant is None or item.tenant == self.tenant

    def offer(self, item: Transition) -> bool:
        """Buffer ``item``; False (and the subscription is over) if the buffer is full."""
        if len(self._items) >= self._size:
            self.dropped = True
            self._end()
            return False
        self._items.append(item)
        self._wake.set()
        return True

    async def next(self) -> Transition | None:
        """The next transition; None once closed or dropped (buffered ones are discarded
        when dropped: the reader must reload anyway)."""
        while True:
            if self.dropped or (self.closed and not self._items):
                return None
            if self._items:
                return self._items.popleft()
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        """Idempotent; the reader's ``next`` returns None after what is buffered."""
        self.feed._forget(self)
        self._end()

    def _end(self) -> None:
        self.closed = True
        self._wake.set()


class Feed:
    def __init__(self, limits: FeedLimits | None = None) -> None:
        self.limits = limits or FeedLimits()
        self._subs: list[Subscription] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.get_ident()
        self._closed = False

    def __len__(self) -> int:
        return len(self._subs)

    def subscribe(self, key_id: str, tenant: str | None) -> Subscription:
        """A new subscription for ``key_id`` (``tenant`` None: every sandbox). Raises
        RateLimited (429) over the per-key or total bound."""
        if self._closed:
            raise RateLimited("the server is shutting down", headers={"Retry-After": "5"})
        if len(self._subs) >= self.limits.total:
            raise RateLimited("too many event streams open on this server",
                              headers={"Retry-After": "5"})
        if sum(s.key_id == key_id for s in self._subs) >= self.limits.per_key:
            raise RateLimited(f"at most {self.limits.per_key} event streams per key",
                              headers={"Retry-After": "5"})
        self._loop = self._loop or asyncio.get_running_loop()
        self._thread = threading.get_ident()
        sub = Subscription(self, key_id, tenant, self.limits.queue)
        self._subs.append(sub)
        return sub

    def publish(self, item: Transition) -> None:
        """Hand ``item`` to every subscriber that may see it. Never blocks or raises; safe to
        call from another thread (it hops to the loop)."""
        if not self._subs:
            return
        if threading.get_ident() != self._thread and self._loop is not None:
            self._loop.call_soon_threadsafe(self._fan_out, item)
            return
        self._fan_out(item)

    def _fan_out(self, item: Transition) -> None:
        for sub in list(self._subs):
            if sub.wants(item) and not sub.offer(item):
                log.info("event stream of key %s fell behind: dropped", sub.key_id)
                self._forget(sub)

    def close(self) -> None:
        """End every subscription (shutdown); later subscribes are refused."""
        self._closed = True
        for sub in list(self._subs):
            sub.close()

    def _forget(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
