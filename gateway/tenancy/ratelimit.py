"""Request rate limits: a token bucket per API key and per source address.

Theory of operation
-------------------
Each bucket holds up to ``burst`` tokens and gains ``rate`` tokens a second; a
request takes one, or is refused with ``RateLimited`` (429 ``rate_limited``, with
``Retry-After``: the whole seconds until a token is back). Buckets are refilled lazily
from a monotonic clock when next used, so an idle bucket costs nothing but its entry.

``RateLimiter.check_address`` limits by peer address: IPv6 peers share one bucket per
/64 (one customer's allocation); addresses in ``address_exempt`` (loopback by default)
are not limited, as behind a TLS proxy on this host every client has the proxy's
address. ``RateLimiter.check_key`` limits by key, with the key's own ``rate``/``burst``
if it has overrides. The HTTP middlewares that call them, and what they exempt, are in
gateway.http.ratelimit; this module knows nothing of HTTP.

Memory is bounded: each table is a ``cachetools.LRUCache`` of ``table_size``
buckets, so an attacker cycling source addresses only evicts old entries. An
evicted bucket comes back full, which is what it would have refilled to unless
it was used within the last ``burst / rate`` seconds; the table should hold far
more addresses than are active in that window.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import cachetools

from gateway.errors import RateLimited
from gateway.tenancy.quotas import TenancyConfig


@dataclass
class TokenBucket:
    rate: float
    burst: int
    tokens: float
    stamp: float

    def take(self, now: float) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there is."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class BucketTable:
    """Named buckets, at most ``size`` of them (least recently used dropped)."""

    def __init__(self, size: int) -> None:
        self._buckets: cachetools.LRUCache[str, TokenBucket] = cachetools.LRUCache(size)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, name: str, rate: float, burst: int, now: float) -> float:
        bucket = self._buckets.get(name)
        if bucket is None or (bucket.rate, bucket.burst) != (rate, burst):
            # New, or the key's limits changed: start full at the new size.
            bucket = TokenBucket(rate, burst, float(burst), now)
            self._buckets[name] = bucket
        return bucket.take(now)


def peer_ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address a peer is limited as (an IPv4-mapped IPv6 address is its IPv4 one)."""
    ip = ipaddress.ip_address(addr)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def address_bucket(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The bucket name of a peer address (IPv6: its /64)."""
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)


class RateLimiter:
    def __init__(self, config: TenancyConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.keys = BucketTable(config.table_size)
        self.addresses = BucketTable(config.table_size)
        self._exempt = [ipaddress.ip_network(n, strict=False) for n in config.address_exempt]

    def check_address(self, addr: str | None) -> None:
        cfg = self.config
        if not cfg.address_rate or not addr:
            return
        try:
            ip = peer_ip(addr)
        except ValueError:  # a Unix socket peer, say: no address to limit by
            return
        if any(ip in net for net in self._exempt):
            return
        wait = self.addresses.take(address_bucket(ip), cfg.address_rate, cfg.address_burst,
                                   self.clock())
        if wait:
            raise _limited(f"too many requests from {addr}", wait)

    def check_key(self, key_id: str, overrides: dict,  # type: ignore[type-arg]
                  admin: bool = False) -> None:
        limits = self.config.limits_for(admin, overrides)
        if not limits.rate:
            return
        wait = self.keys.take(key_id, limits.rate, limits.burst, self.clock())
        if wait:
            raise _limited(f"too many requests for key {key_id} (rate={limits.rate:g}/s, "
                           f"burst={limits.burst})", wait)


def _limited(message: str, wait: float) -> RateLimited:
    retry = max(1, math.ceil(wait))
    return RateLimited(f"{message}: retry in {retry}s", headers={"Retry-After": str(retry)})
