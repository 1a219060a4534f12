"""``GET /v1/events``: the registry's transitions as server-sent events, live.

Each recorded state change of a sandbox the key may see (its own; an admin key: every
one) is one event ``transition`` whose data is a ``TransitionEvent``. The stream opens
with ``event: ready`` and sends a comment every ``HEARTBEAT`` seconds, so a proxy or the
client notices a dead connection. It ends with ``event: dropped`` if the client read too
slowly (its buffer in gateway.store.feed filled up: it must reload what it shows and
reconnect), and at shutdown. Nothing is replayed: a client lists, then follows.

Authenticated like every API path (``Authorization`` header): browsers read it with
``fetch()`` and a stream reader, since ``EventSource`` cannot send headers.
"""

from __future__ import annotations

import asyncio
from types import EllipsisType

from aiohttp import web

from gateway.http import wire
from gateway.http.middleware import current_key
from gateway.store.feed import Feed, Subscription, Transition

routes = web.RouteTableDef()
FEED_KEY = web.AppKey("transition_feed", Feed)
HEARTBEAT = 15.0


def encode(item: Transition) -> bytes:
    """One SSE record: ``id`` is the transition's number."""
    data = wire.dumps(wire.TransitionEvent(
        seq=item.seq, sandbox_id=item.sandbox_id, tenant=item.tenant, at=item.at,
        from_=item.from_state, to=item.to_state, event=item.event, cause=item.cause))
    return b"id: %d\nevent: transition\ndata: %s\n\n" % (item.seq, data)


@routes.get("/v1/events")
async def events(request: web.Request) -> web.StreamResponse:
    key = current_key(request)
    sub = request.app[FEED_KEY].subscribe(key.id, None if key.admin else key.id)
    try:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-store",
            "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            await _pump(resp, sub)
        except ConnectionResetError:  # the client left while we wrote to it
            pass
        return resp
    finally:  # also when the client left (the handler is cancelled)
        sub.close()


async def _pump(resp: web.StreamResponse, sub: Subscription) -> None:
    await resp.write(b"retry: 3000\nevent: ready\ndata: {}\n\n")
    while True:
        item = await _next(sub)
        if item is None:
            break
        await resp.write(encode(item) if isinstance(item, Transition) else b": ping\n\n")
    if sub.dropped:
        await resp.write(b"event: dropped\ndata: {}\n\n")


async def _next(sub: Subscription) -> Transition | EllipsisType | None:
    """The next transition, ``...`` after HEARTBEAT seconds of none, None at the end."""
    try:
        return await asyncio.wait_for(sub.next(), HEARTBEAT)
    except TimeoutError:
        return ...


def setup(app: web.Application, feed: Feed | None = None) -> Feed:
    """Register the route and a feed; the caller connects the feed to the registry
    (``registry.listeners.append(feed.publish)``). Shutdown ends every stream."""
    feed = feed or Feed()
    app[FEED_KEY] = feed
    app.add_routes(routes)

    async def _close(_: web.Application) -> None:
        feed.close()

    app.on_shutdown.append(_close)
    return feed
