"""The etcd client's HTTP edge against scripted fake members on loopback: failover, the
per-attempt and per-call deadlines, which writes are retried, bounded answers, and the
watch stream's framing. (tests/cluster runs it against real etcd.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from gateway.cluster import wire
from gateway.cluster.errors import (EtcdRequestError, EtcdUncertain, EtcdUnavailable,
                                    LeaseNotFound, ProtocolError)
from gateway.cluster.etcd import EtcdClient

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OK_PUT = {"header": {"revision": "8"}}


class Member:
    """One fake etcd member: every request goes to ``handler``; ``hits`` counts them."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.hits, self.url = handler, 0, ""
        self.headers: list[dict[str, str]] = []

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.headers.append(dict(request.headers))
        return await self.handler(request)


@pytest.fixture
async def members() -> AsyncIterator[Callable[..., Awaitable[Member]]]:
    runners: list[web.AppRunner] = []

    async def make(handler: Handler) -> Member:
        member = Member(handler)
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", member._serve)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        member.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return member

    yield make
    for runner in runners:
        await runner.cleanup()


def answer(body: dict, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)
    return handler


def hang() -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.json_response({})
    return handler


DEAD = "http://127.0.0.1:1"  # nothing listens: connection refused


async def test_fails_over_past_a_dead_and_a_hanging_member_and_remembers(members) -> None:
    slow, good = await members(hang()), await members(answer(OK_PUT))
    client = EtcdClient([DEAD, slow.url, good.url], timeout=3, attempt_timeout=0.2)
    try:
        assert await client.range("k") == wire.RangeResult(8, (), 0, False)
        assert client.endpoints[client.order()[0]] == good.url
        await client.range("k")
        assert (slow.hits, good.hits) == (1, 2)  # the one that answered is tried first
        assert good.headers[0]["Grpc-Metadata-hasleader"] == "true"
    finally:
        await client.aclose()


async def test_the_call_deadline_bounds_everything(members) -> None:
    slow = await members(hang())
    client = EtcdClient([slow.url, DEAD], timeout=0.5, attempt_timeout=0.2)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(EtcdUnavailable):
        await client.range("k")
    assert loop.time() - start < 0.8
    await client.aclose()


async def test_a_write_that_may_have_applied_is_not_retried(members) -> None:
    slow, good = await members(hang()), await members(answer(OK_PUT))
    client = EtcdClient([slow.url, good.url], timeout=3, attempt_timeout=0.2)
    with pytest.raises(EtcdUncertain):
        await client.put("k", "v")
    assert good.hits == 0
    await client.aclose()


async def test_no_leader_is_retried_elsewhere_but_a_timed_out_proposal_is_uncertain(
        members) -> None:
    leaderless = await members(answer({"code": 14, "message": "etcdserver: no leader"}, 503))
    good = await members(answer(OK_PUT))
    client = EtcdClient([leaderless.url, good.url], timeout=3)
    assert await client.put("k", "v") == 8
    timed_out = await members(answer({"code": 14, "message": "etcdserver: request timed out"},
                                     503))
    client2 = EtcdClient([timed_out.url, good.url], timeout=3)
    with pytest.raises(EtcdUncertain, match="request timed out"):
        await client2.put("k", "v")
    assert await client2.range("k") == wire.RangeResult(8, (), 0, False)  # reads move on
    await client.aclose()
    await client2.aclose()


async def test_errors_map_into_our_family(members) -> None:
    gone = await members(answer({"code": 5, "message": "etcdserver: requested lease not found"},
                                404))
    bad = await members(answer({"code": 3, "message": "etcdserver: key is not provided"}, 400))
    text = await members(lambda r: _text("Not Found", 404))
    for url, cls in ((gone.url, LeaseNotFound), (bad.url, EtcdRequestError),
                     (text.url, ProtocolError)):
        client = EtcdClient([url], timeout=1)
        with pytest.raises(cls):
            await client.put("k", "v", lease=5)
        await client.aclose()
    keepalive_gone = await members(answer({"result": {"ID": "5"}}))  # no TTL: the lease is gone
    client = EtcdClient([keepalive_gone.url], timeout=1)
    with pytest.raises(LeaseNotFound):
        await client.lease_keepalive(5)
    await client.aclose()


async def _text(body: str, status: int) -> web.Response:
    return web.Response(text=body, status=status)


async def test_answers_are_bounded(members) -> None:
    big = await members(answer({"header": {}, "kvs": [{"key": "aw==",
                                                       "value": "x" * 5000}]}))
    client = EtcdClient([big.url], timeout=1, max_response_bytes=4096)
    with pytest.raises(ProtocolError, match="over 4096"):
        await client.range("k")
    await client.aclose()


def _stream(lines: list[bytes], chunk: int = 7) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        data = b"".join(lines)
        for i in range(0, len(data), chunk):  # split messages across writes
            await resp.write(data[i:i + chunk])
            await asyncio.sleep(0)
        return resp
    return handler


def _event_line(rev: int) -> bytes:
    kv = {"key": wire.b64(f"k{rev}"), "mod_revision": str(rev)}
    return json.dumps({"result": {"header": {"revision": str(rev)},
                                  "events": [{"kv": kv}]}}).encode() + b"\n"


async def test_watch_stream_framing_and_bound(members) -> None:
    lines = [json.dumps({"result": {"header": {"revision": "3"}, "created": True}}).encode()
             + b"\n", _event_line(4), b"\n", _event_line(5)]
    member = await members(_stream(lines))
    client = EtcdClient([member.url])
    got = [b async for b in client.watch_stream(0, wire.watch_body("k", None, 1))]
    assert [b.created for b in got] == [True, False, False]
    assert [e.kv.mod_revision for b in got for e in b.events] == [4, 5]
    await client.aclose()
    huge = await members(_stream([b'{"result": {"header": {}, "events": [' + b" " * 5000]))
    client = EtcdClient([huge.url], max_response_bytes=1024)
    with pytest.raises(ProtocolError, match="over 1024"):
        async for _ in client.watch_stream(0, wire.watch_body("k", None, 1)):
            pass
    await client.aclose()


async def test_closed_client_refuses() -> None:
    client = EtcdClient(["http://127.0.0.1:1"])
    await client.aclose()
    await client.aclose()
    with pytest.raises(EtcdUnavailable, match="closed"):
        await client.range("k")
