"""Token buckets and the rate-limit middlewares (a fake clock; no sleeping)."""

from __future__ import annotations

import pytest
from aiohttp import web

from gateway.http.middleware import REGISTRY_KEY, api_error_middleware, auth_middleware
from gateway.tenancy.quotas import TenancyConfig
from gateway.http.ratelimit import LIMITER_KEY, address_rate_middleware, key_rate_middleware
from gateway.tenancy.ratelimit import (
    BucketTable,
    RateLimiter,
    TokenBucket,
    address_bucket,
    peer_ip,
)
from gateway.errors import RateLimited
from gateway.store.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_its_burst_then_says_how_long_to_wait():
    bucket = TokenBucket(rate=2.0, burst=3, tokens=3.0, stamp=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token at 2/s
    assert bucket.take(0.25) == pytest.approx(0.25)  # half refilled
    assert bucket.take(0.5) == 0.0
    assert bucket.take(0.5) > 0


def test_bucket_refills_to_burst_and_no_further():
    bucket = TokenBucket(rate=10.0, burst=2, tokens=0.0, stamp=0.0)
    assert bucket.take(3600.0) == 0.0
    assert bucket.take(3600.0) == 0.0
    assert bucket.take(3600.0) > 0  # an hour idle still holds only `burst` tokens


def test_table_is_bounded_when_names_cycle():
    table = BucketTable(size=100)
    for i in range(10_000):
        table.take(f"10.0.{i // 256}.{i % 256}", 1.0, 1, 0.0)
    assert len(table) == 100


def test_table_restarts_a_bucket_whose_limits_changed():
    table = BucketTable(size=10)
    assert table.take("k", 1.0, 1, 0.0) == 0.0
    assert table.take("k", 1.0, 1, 0.0) > 0
    assert table.take("k", 1.0, 5, 0.0) == 0.0  # new burst: a new, full bucket


def test_ipv6_peers_share_a_bucket_per_64_and_mapped_v4_is_v4():
    a, b = peer_ip("2001:db8:1:2::1"), peer_ip("2001:db8:1:2:ffff::9")
    assert address_bucket(a) == address_bucket(b) == "2001:db8:1:2::/64"
    assert address_bucket(peer_ip("2001:db8:1:3::1")) != address_bucket(a)
    assert address_bucket(peer_ip("::ffff:192.0.2.7")) == "192.0.2.7"


def test_limiter_exempts_loopback_but_not_others():
    clock = Clock()
    limiter = RateLimiter(TenancyConfig(address_rate=1, address_burst=1), clock)
    for _ in range(5):
        limiter.check_address("127.0.0.1")
        limiter.check_address("::ffff:127.0.0.1")
    limiter.check_address("192.0.2.1")
    with pytest.raises(RateLimited) as info:
        limiter.check_address("192.0.2.1")
    assert info.value.headers == {"Retry-After": "1"}
    clock.now += 1.0
    limiter.check_address("192.0.2.1")


def test_key_overrides_replace_the_default_rate():
    clock = Clock()
    limiter = RateLimiter(TenancyConfig(rate=0), clock)  # default: no key limit
    for _ in range(50):
        limiter.check_key("a", {})
    limiter.check_key("b", {"rate": 0.1, "burst": 1})
    with pytest.raises(RateLimited) as info:
        limiter.check_key("b", {"rate": 0.1, "burst": 1})
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "10"


# -- the middlewares in an app ---------------------------------------------------------------

@web.middleware
async def fake_peer(request, handler):
    """Tests choose the peer address (the test client always connects from loopback)."""
    peer = request.headers.get("X-Test-Peer")
    return await handler(request.clone(remote=peer) if peer else request)


@pytest.fixture
async def env(tmp_path, aiohttp_client):
    clock = Clock()
    app = web.Application(middlewares=[api_error_middleware, fake_peer, address_rate_middleware,
                                       auth_middleware, key_rate_middleware])
    registry = Registry(tmp_path / "r.sqlite")
    app[REGISTRY_KEY] = registry
    app[LIMITER_KEY] = RateLimiter(TenancyConfig(rate=1, burst=2, address_rate=1,
                                                 address_burst=3), clock)

    async def ok(request):
        return web.json_response({"ok": True})

    app.router.add_get("/healthz", ok)
    app.router.add_get("/v1/thing", ok)
    _, slow = registry.create_key("slow")
    _, fast = registry.create_key("fast", limits={"rate": 100, "burst": 100})
    client = await aiohttp_client(app)
    yield client, clock, slow, fast
    registry.close()


async def test_a_key_past_its_burst_gets_429_json_with_retry_after(env):
    client, clock, slow, _ = env
    auth = {"Authorization": f"Bearer {slow}"}
    assert [(await client.get("/v1/thing", headers=auth)).status for _ in range(2)] == [200, 200]
    resp = await client.get("/v1/thing", headers=auth)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "1"
    body = await resp.json()
    assert body["error"]["code"] == "rate_limited" and "retry in 1s" in body["error"]["message"]
    clock.now += 1.0  # one token back
    assert (await client.get("/v1/thing", headers=auth)).status == 200


async def test_per_key_override_and_keys_do_not_share_buckets(env):
    client, _, slow, fast = env
    for _ in range(3):
        await client.get("/v1/thing", headers={"Authorization": f"Bearer {slow}"})
    statuses = [(await client.get("/v1/thing", headers={"Authorization": f"Bearer {fast}"}))
                .status for _ in range(20)]
    assert statuses == [200] * 20


async def test_an_address_is_limited_before_auth_and_healthz_is_exempt(env):
    client, clock, _, _ = env
    peer = {"X-Test-Peer": "192.0.2.9", "Authorization": "Bearer wrong"}
    assert [(await client.get("/v1/thing", headers=peer)).status for _ in range(3)] == [401] * 3
    resp = await client.get("/v1/thing", headers=peer)
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    assert (await client.get("/healthz", headers=peer)).status == 200
    other = {"X-Test-Peer": "192.0.2.10", "Authorization": "Bearer wrong"}
    assert (await client.get("/v1/thing", headers=other)).status == 401
    clock.now += 1.0
    assert (await client.get("/v1/thing", headers=peer)).status == 401
