"""Request rate limits at the HTTP edge: two middlewares, on either side of
authentication, over the token buckets of gateway.tenancy.ratelimit.

* ``address_rate_middleware`` (before auth) limits every API request by its
  peer address, so guessing keys or flooding without one is limited too.
* ``key_rate_middleware`` (after auth) limits by key, with the key's own
  ``rate``/``burst`` if it has overrides.

A request over its limit is answered 429 ``rate_limited`` with ``Retry-After`` (the
``RateLimited`` error, mapped by gateway.http.middleware).

Exempt: ``GET /healthz`` (load balancers and monitoring poll it; it touches no
sandbox). Preview and session hosts never reach these middlewares
(``gateway.preview.hosts`` answers them first); their traffic is a guest app's.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.middleware import TENANT_KEY, Handler
from gateway.tenancy.ratelimit import RateLimiter

__all__ = ["LIMITER_KEY", "RateLimiter", "address_rate_middleware", "key_rate_middleware"]

EXEMPT_PATHS = frozenset({"/healthz"})

LIMITER_KEY = web.AppKey("rate_limiter", RateLimiter)


@web.middleware
async def address_rate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path not in EXEMPT_PATHS:
        request.app[LIMITER_KEY].check_address(request.remote)
    return await handler(request)


@web.middleware
async def key_rate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.get(TENANT_KEY)  # None on the public paths (no key needed)
    if key is not None and request.path not in EXEMPT_PATHS:
        request.app[LIMITER_KEY].check_key(key.id, key.limits, key.admin)
    return await handler(request)
