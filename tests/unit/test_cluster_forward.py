"""Forwarding between two in-process gateways on loopback: host B forwards requests for a
sandbox host A owns (API paths, preview hosts, WebSockets), bodies streamed both ways, the
Host and Authorization headers kept, a hop header added; loops, fences, dead and
unreachable owners are refused with their codes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.cluster.records import SandboxRecord
from gateway.cluster.routes import Route
from gateway.sandbox.states import State
from tests.unit.cluster_gateways import KEY, FakeNode, build

AUTH = {"Authorization": KEY}


def owned_by(host: str, address: str | None) -> Route:
    return Route("sbx1", host, 2, address, SandboxRecord("sbx1", host, State.RUNNING, 2))


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[FakeNode, FakeNode, TestServer, TestServer]]:
    a, b = FakeNode("host-a"), FakeNode("host-b")
    server_a = TestServer(build(a, {"sbx1"}), host="127.0.0.1")
    server_b = TestServer(build(b, set()), host="127.0.0.1")
    await server_a.start_server()
    await server_b.start_server()
    a.routes.table["sbx1"] = b.routes.table["sbx1"] = owned_by(
        "host-a", f"127.0.0.1:{server_a.port}")
    try:
        yield a, b, server_a, server_b
    finally:
        await server_b.close()
        await server_a.close()


async def test_http_is_forwarded_with_its_headers_and_a_streamed_body(fleet) -> None:
    _, _, server_a, server_b = fleet
    sent = [b"x" * 65536 for _ in range(32)]  # 2 MiB, sent chunk by chunk

    async def body() -> AsyncIterator[bytes]:
        for chunk in sent:
            yield chunk
            await asyncio.sleep(0)

    async with aiohttp.ClientSession() as http:
        async with http.post(server_b.make_url("/v1/sandboxes/sbx1/files?path=/a%20b"),
                             data=body(), headers=AUTH) as resp:
            got = await resp.read()
            assert resp.status == 200, got
            assert resp.headers["X-Served-By"] == "host-a"
            assert resp.headers["X-Seen-Hop"] == "host-b"
            assert resp.headers["X-Seen-Host"] == f"127.0.0.1:{server_b.port}"  # kept
            assert resp.headers["X-Seen-Path"] == "/v1/sandboxes/sbx1/files?path=/a%20b"
            assert got == b"".join(sent)
        # At the owner, a fleet host's forwarded request counts as its client's for the
        # per-address limits (the last X-Forwarded-For entry); nobody else is believed.
        for extra, remote in (({"X-AgentBox-Forwarded": "host-b"}, "203.0.113.9"),
                              ({}, "127.0.0.1")):
            async with http.get(server_a.make_url("/v1/sandboxes/sbx1"), headers={
                    **AUTH, **extra, "X-Forwarded-For": "198.51.100.1, 203.0.113.9"}) as resp:
                assert resp.headers["X-Seen-Remote"] == remote
        # The owner authenticates: a bad key is refused there, its answer relayed as is.
        async with http.get(server_b.make_url("/v1/sandboxes/sbx1"),
                            headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_preview_hosts_are_forwarded_with_the_original_host(fleet) -> None:
    _, _, _, server_b = fleet
    async with aiohttp.ClientSession() as http:
        async with http.get(server_b.make_url("/index.html"), headers={
                **AUTH, "Host": "3000-sbx1.preview.test"}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Served-By"] == "host-a"
            assert resp.headers["X-Seen-Host"] == "3000-sbx1.preview.test"


async def test_websockets_are_forwarded_frame_by_frame(fleet) -> None:
    _, _, _, server_b = fleet
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server_b.make_url("/v1/sandboxes/sbx1/terminal"),
                                   headers=AUTH, protocols=["agentbox.v1"]) as ws:
            assert ws.protocol == "agentbox.v1"
            await ws.send_str("hello")
            assert await ws.receive_str(timeout=5) == "host-a:hello"
            await ws.send_bytes(b"abc")
            assert await ws.receive_bytes(timeout=5) == b"cba"
            await ws.close()
        # A WebSocket the owner refuses (bad key) is a 502 naming the owner's status.
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(server_b.make_url("/v1/sandboxes/sbx1/terminal"))
        assert refused.value.status == 502


async def test_a_forwarded_request_is_not_forwarded_again(fleet) -> None:
    a, _, server_a, server_b = fleet
    # A's cache says B owns it now while B's says A: a forwarded request must stop at A.
    a.routes.table["sbx1"] = owned_by("host-b", f"127.0.0.1:{server_b.port}")
    async with aiohttp.ClientSession() as http:
        async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
            assert resp.status == 508
            error = (await resp.json())["error"]
            assert error["code"] == "forward_loop" and "host-b" in error["message"]


async def test_a_fenced_owner_refuses_and_the_forwarder_relays_it(fleet) -> None:
    a, b, server_a, server_b = fleet
    a.fenced = "lease expired"
    async with aiohttp.ClientSession() as http:
        for server in (server_a, server_b):
            async with http.get(server.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "host_fenced"
        # A fenced host creates nothing either; other paths still answer.
        async with http.post(server_a.make_url("/v1/sandboxes"), headers=AUTH) as resp:
            assert resp.status == 503
        a.fenced = None  # rejoined: serves again
        async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
            assert resp.status == 200


async def test_dead_or_unreachable_owners_are_unavailable(fleet) -> None:
    _, b, _, server_b = fleet
    b.routes.table["sbx1"] = owned_by("host-a", None)  # no host record: dead
    async with aiohttp.ClientSession() as http:
        async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "owner_unavailable"
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        b.routes.table["sbx1"] = owned_by("host-a", f"127.0.0.1:{closed}")
        async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error["code"] == "owner_unavailable" and str(closed) in error["message"]
        # Unknown to the fleet: served (here, a 404 from B's own service).
        b.routes.table.clear()
        async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
            assert resp.status == 404


async def test_a_silent_owner_times_out_within_the_bound() -> None:
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await done.wait()  # accepts, never answers
        writer.close()
        await writer.wait_closed()

    stall = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = stall.sockets[0].getsockname()[1]
    b = FakeNode("host-b")
    b.routes.table["sbx1"] = owned_by("host-a", f"127.0.0.1:{port}")
    server_b = TestServer(build(b, set(), timeout=0.5), host="127.0.0.1")
    await server_b.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            t0 = asyncio.get_running_loop().time()
            async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
                assert resp.status == 504
                assert (await resp.json())["error"]["code"] == "upstream_timeout"
            assert asyncio.get_running_loop().time() - t0 < 3
    finally:
        await server_b.close()
        done.set()
        stall.close()
        await stall.wait_closed()


async def test_what_is_in_flight_ends_when_the_owner_leaves_the_fleet() -> None:
    """A request waiting on an owner that stops answering (cut off: its pooled connection
    just goes silent) ends about LIVENESS_POLL after the route cache says the owner is
    gone, not after the read timeout (30 s here); a spliced WebSocket is closed (1001)."""
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await done.wait()
        writer.close()
        await writer.wait_closed()

    stall = await asyncio.start_server(silent, "127.0.0.1", 0)
    b = FakeNode("host-b")
    b.routes.table["sbx1"] = owned_by("host-a", f"127.0.0.1:{stall.sockets[0].getsockname()[1]}")
    server_b = TestServer(build(b, set(), timeout=30), host="127.0.0.1")
    await server_b.start_server()
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as http:
            loop.call_later(0.5, b.routes.table.__setitem__, "sbx1", owned_by("host-a", None))
            t0 = loop.time()
            async with http.get(server_b.make_url("/v1/sandboxes/sbx1"), headers=AUTH) as resp:
                assert resp.status == 504
                body = await resp.json()
            assert body["error"]["code"] == "upstream_timeout"
            assert "left the fleet" in body["error"]["message"]
            assert loop.time() - t0 < 5
    finally:
        await server_b.close()
        done.set()
        stall.close()
        await stall.wait_closed()


async def test_a_delete_whose_record_goes_before_the_answer_gets_the_owners_answer() -> None:
    """The owner removes a deleted sandbox's record before it answers the DELETE; the
    forwarder waits for that answer (the owner is still live), it is not a 504."""
    from aiohttp import web

    async def slow_delete(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # the record is gone from B's cache meanwhile
        return web.Response(status=204)

    owner = web.Application()
    owner.router.add_delete("/v1/sandboxes/sbx1", slow_delete)
    server_a = TestServer(owner, host="127.0.0.1")
    await server_a.start_server()
    b = FakeNode("host-b")
    b.routes.hosts.add("host-a")
    b.routes.table["sbx1"] = owned_by("host-a", f"127.0.0.1:{server_a.port}")
    server_b = TestServer(build(b, set()), host="127.0.0.1")
    await server_b.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            asyncio.get_running_loop().call_later(0.3, b.routes.table.pop, "sbx1")
            async with http.delete(server_b.make_url("/v1/sandboxes/sbx1"),
                                   headers=AUTH) as resp:
                assert resp.status == 204
    finally:
        await server_b.close()
        await server_a.close()


async def test_a_spliced_websocket_is_closed_when_the_owner_leaves(fleet) -> None:
    _, b, server_a, server_b = fleet
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server_b.make_url("/v1/sandboxes/sbx1/terminal"),
                                   headers=AUTH) as ws:
            await ws.send_str("hello")
            assert await ws.receive_str(timeout=5) == "host-a:hello"
            b.routes.table["sbx1"] = owned_by("host-a", None)
            msg = await ws.receive(timeout=5)
            assert msg.type is aiohttp.WSMsgType.CLOSE
            assert ws.close_code == aiohttp.WSCloseCode.GOING_AWAY


def test_the_middleware_is_installed_only_with_cluster_on() -> None:
    import dataclasses
    import subprocess
    import sys

    from gateway.cluster.config import ClusterConfig
    from gateway.config import load
    from gateway.http import cluster_forward
    from gateway.http.app import build_app

    off = load(None)
    assert cluster_forward.cluster_middleware not in build_app(off).middlewares
    on = dataclasses.replace(off, cluster=ClusterConfig(
        enabled=True, endpoints=("http://127.0.0.1:2379",), host="host-a",
        advertise="127.0.0.1:8080"))
    assert cluster_forward.cluster_middleware in build_app(on).middlewares
    # Off, the daemon does not even import the routing modules.
    probe = ("import sys; from gateway.config import load; from gateway.http.app import "
             "build_app; build_app(load(None)); print(sorted(m for m in sys.modules if m in "
             "('gateway.http.cluster_forward', 'gateway.http.cluster_list', "
             "'gateway.cluster.listing', 'gateway.preview.forward', "
             "'gateway.cluster.routing', 'gateway.cluster.publisher', "
             "'gateway.cluster.ownership', 'gateway.cluster.objstore', "
             "'gateway.cluster.shipping', 'gateway.cluster.shipper', "
             "'gateway.cluster.reaper', 'gateway.sandbox.shipped')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


async def test_a_node_deletes_records_of_sandboxes_it_no_longer_has() -> None:
    from gateway.cluster.config import ClusterConfig
    from gateway.cluster.node import ClusterNode, Load

    node = ClusterNode(ClusterConfig(enabled=True, endpoints=("http://127.0.0.1:1",),
                                     host="host-a", advertise="127.0.0.1:8080"),
                       lambda: Load(1, 1, 1, 1, 0))
    noted: list[tuple[str, State]] = []
    node.publisher.sync = lambda items: noted.extend(items)  # type: ignore[method-assign]
    table = node.routes.table
    for sandbox_id, host in (("kept", "host-a"), ("gone", "host-a"), ("theirs", "host-b")):
        table.sandboxes[sandbox_id] = SandboxRecord(sandbox_id, host, State.RUNNING)
    try:
        node.publish_local(lambda: [("kept", State.SUSPENDED), ("new", State.RUNNING)])
        assert noted == [("kept", State.SUSPENDED), ("new", State.RUNNING),
                         ("gone", State.DESTROYED)]
    finally:
        await node.aclose()
