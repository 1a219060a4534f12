"""Fleet-wide ``GET /v1/sandboxes`` between three in-process gateways on loopback: the host
asked merges every live host's page in cursor order (paging through gives every sandbox
exactly once), filters and an admin's ``?tenant=`` reach every host, a host that does not
answer in time is named in ``partial``, and the hop header stops the fan-out."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.cluster import listing as fleet
from gateway.sandbox.listing import cursor_at, decode_cursor
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord
from tests.unit.cluster_gateways import ADMIN, KEY, FakeNode, build

AUTH = {"Authorization": KEY}
HOSTS = ("host-a", "host-b", "host-c")
STATES = (State.RUNNING, State.SUSPENDED, State.FAILED)


def rec(sid: str, host: str, created: float, tenant: str = "k1", state: State = State.RUNNING,
        template: str = "python", **metadata: Any) -> SandboxRecord:
    return SandboxRecord(id=sid, tenant=tenant, template=template, state=state, slot=0,
                         root="", golden="", idle_timeout=300.0, host=host,
                         created_at=created, updated_at=created, last_activity=created,
                         metadata=metadata)


def records() -> dict[str, list[SandboxRecord]]:
    """Seven of k1's sandboxes per host, interleaved in time (two created at the same
    instant on different hosts: the id breaks the tie), and two of k2's on each."""
    out: dict[str, list[SandboxRecord]] = {h: [] for h in HOSTS}
    for i in range(21):
        host = HOSTS[(i * 7) % 3]
        created = 1000.0 + (i // 2)  # pairs share a created_at
        out[host].append(rec(f"sb{i:02d}-{host[-1]}", host, created, state=STATES[i % 3],
                             template="python" if i % 2 else "node",
                             team="red" if i % 4 else "blue"))
    for host in HOSTS:
        out[host] += [rec(f"k2-{host}-{j}", host, 2000.0 + j, tenant="k2") for j in range(2)]
    return out


def ordered(recs: list[SandboxRecord]) -> list[str]:
    return [r.id for r in sorted(recs, key=lambda r: (r.created_at, r.id))]


Fleet = tuple[dict[str, FakeNode], dict[str, TestServer], dict[str, list[SandboxRecord]]]


@pytest.fixture
async def fleet3() -> AsyncIterator[Fleet]:
    listed = records()
    nodes = {h: FakeNode(h) for h in HOSTS}
    servers = {h: TestServer(build(nodes[h], set(), listed=listed[h]), host="127.0.0.1")
               for h in HOSTS}
    for server in servers.values():
        await server.start_server()
    peers = {h: f"127.0.0.1:{servers[h].port}" for h in HOSTS}
    for node in nodes.values():
        node.routes.peers.update(peers)
    try:
        yield nodes, servers, listed
    finally:
        for server in servers.values():
            await server.close()


async def get(http: aiohttp.ClientSession, server: TestServer, query: str = "",
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with http.get(server.make_url(f"/v1/sandboxes{query}"),
                        headers=headers or AUTH) as resp:
        return resp.status, await resp.json()


async def test_paging_through_three_hosts_gives_every_sandbox_once_in_order(fleet3) -> None:
    nodes, servers, listed = fleet3
    everything = ordered([r for recs in listed.values() for r in recs if r.tenant == "k1"])
    async with aiohttp.ClientSession() as http:
        status, whole = await get(http, servers["host-a"], "?limit=1000")
        assert status == 200
        assert [s["id"] for s in whole["sandboxes"]] == everything
        assert whole["next_cursor"] is None and "partial" not in whole
        # Pages of 4, each asked of another host: the cursor is the fleet's, not a host's.
        seen: list[str] = []
        cursor, turn = None, 0
        while True:
            server = servers[HOSTS[turn % 3]]
            status, page = await get(http, server, "?limit=4" + (
                f"&cursor={cursor}" if cursor else ""))
            assert status == 200 and len(page["sandboxes"]) <= 4
            seen += [s["id"] for s in page["sandboxes"]]
            cursor, turn = page["next_cursor"], turn + 1
            if cursor is None:
                break
            assert decode_cursor(cursor)[1] == seen[-1]
        assert seen == everything  # each exactly once, in order
        assert turn == 6  # 21 sandboxes: five full pages and one of one
    # Each host served one list per page (its own and the others'), never more: the hop
    # header stops the peers from asking further.
    for host, node in nodes.items():
        assert len(node.lists) == 7
        assert {hop for hop in node.lists} <= {"", *HOSTS} - {host}


async def test_filters_reach_every_host(fleet3) -> None:
    _, servers, listed = fleet3
    want = ordered([r for recs in listed.values() for r in recs if r.tenant == "k1"
                    and r.state in (State.RUNNING, State.FAILED) and r.template == "python"
                    and r.metadata["team"] == "red"])
    assert len({r.split("-")[1] for r in want}) > 1  # on more than one host
    async with aiohttp.ClientSession() as http:
        got: list[str] = []
        cursor = ""
        while True:
            status, page = await get(http, servers["host-b"],
                                     "?state=running,failed&template=python&metadata.team=red"
                                     f"&limit=2{cursor}")
            assert status == 200
            got += [s["id"] for s in page["sandboxes"]]
            if page["next_cursor"] is None:
                break
            cursor = f"&cursor={page['next_cursor']}"
        assert got == want
        # A bad query is refused by the host asked, before any other host is asked.
        status, body = await get(http, servers["host-b"], "?state=sleepy")
        assert status == 400


async def test_an_admin_lists_another_keys_sandboxes_on_every_host(fleet3) -> None:
    nodes, servers, listed = fleet3
    async with aiohttp.ClientSession() as http:
        status, page = await get(http, servers["host-c"], "?tenant=k2",
                                 {"Authorization": ADMIN})
        assert status == 200
        assert [s["id"] for s in page["sandboxes"]] == ordered(
            [r for recs in listed.values() for r in recs if r.tenant == "k2"])
        before = {h: len(n.lists) for h, n in nodes.items()}
        # Not an admin: refused where it arrived; nobody else is asked.
        status, body = await get(http, servers["host-c"], "?tenant=k2")
        assert status == 403 and body["error"]["code"] == "forbidden"
        status, body = await get(http, servers["host-c"], "",
                                 {"Authorization": "Bearer nope"})
        assert status == 401
        assert {h: len(n.lists) for h, n in nodes.items()} == before


async def test_a_forwarded_list_answers_with_the_local_page_only(fleet3) -> None:
    nodes, servers, listed = fleet3
    async with aiohttp.ClientSession() as http:
        status, page = await get(http, servers["host-a"], "",
                                 {**AUTH, "X-AgentBox-Forwarded": "host-b"})
    assert status == 200
    assert [s["id"] for s in page["sandboxes"]] == ordered(
        [r for r in listed["host-a"] if r.tenant == "k1"])
    assert nodes["host-b"].lists == nodes["host-c"].lists == []


async def test_hosts_that_do_not_answer_are_named_partial_within_the_bound(fleet3) -> None:
    nodes, servers, listed = fleet3
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await done.wait()  # accepts, never answers
        writer.close()
        await writer.wait_closed()

    stall = await asyncio.start_server(silent, "127.0.0.1", 0)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    a = nodes["host-a"]
    a.timeout = 0.5
    a.routes.peers["host-d"] = f"127.0.0.1:{stall.sockets[0].getsockname()[1]}"
    a.routes.peers["host-e"] = f"127.0.0.1:{closed}"
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as http:
            t0 = loop.time()
            status, page = await get(http, servers["host-a"])
            assert loop.time() - t0 < 5
            assert status == 200
            assert page["partial"] == ["host-d", "host-e"]
            assert [s["id"] for s in page["sandboxes"]] == ordered(
                [r for recs in listed.values() for r in recs if r.tenant == "k1"])
    finally:
        done.set()
        stall.close()
        await stall.wait_closed()


async def test_a_host_that_refuses_the_key_is_partial(fleet3) -> None:
    nodes, servers, listed = fleet3
    nodes["host-c"].unknown_keys.add(KEY)  # not replicated there yet
    async with aiohttp.ClientSession() as http:
        status, page = await get(http, servers["host-b"])
    assert status == 200 and page["partial"] == ["host-c"]
    assert [s["id"] for s in page["sandboxes"]] == ordered(
        [r for h in ("host-a", "host-b") for r in listed[h] if r.tenant == "k1"])


async def test_a_dead_host_that_owns_some_of_the_tenants_sandboxes_is_partial(fleet3) -> None:
    """No host record (dead, cut off) but records naming it as an owner: the tenant is
    told its sandboxes there are missing; other tenants are not."""
    from gateway.cluster.records import SandboxRecord as Owned
    from gateway.cluster.routes import Route

    nodes, servers, _ = fleet3
    b = nodes["host-b"]
    b.routes.table["gone1"] = Route("gone1", "host-z", 1, None,
                                    Owned("gone1", "host-z", State.RUNNING, 1, tenant="k2"))
    async with aiohttp.ClientSession() as http:
        status, page = await get(http, servers["host-b"])
        assert status == 200 and "partial" not in page  # k1 has nothing on host-z
        status, page = await get(http, servers["host-b"], "?tenant=k2",
                                 {"Authorization": ADMIN})
        assert status == 200 and page["partial"] == ["host-z"]
        assert len(page["sandboxes"]) == 6  # the live hosts' are all there
        # Only host-b's cache knows; alone (no live peers) it still says so.
        b.routes.peers.clear()
        status, page = await get(http, servers["host-b"], "?tenant=k2",
                                 {"Authorization": ADMIN})
        assert page["partial"] == ["host-z"] and len(page["sandboxes"]) == 2


# -- the merge alone (no I/O) ------------------------------------------------------------------

def item(sid: str, created: float) -> dict[str, Any]:
    return {"id": sid, "created_at": created, "state": "running"}


def test_merge_takes_the_first_limit_and_says_more_when_a_host_has_more() -> None:
    a = fleet.HostPage("a", [item("a1", 1), item("a2", 3)], more=True)
    b = fleet.HostPage("b", [item("b1", 2)], more=False)
    page = fleet.merge([a, b], 2)
    assert [s["id"] for s in page.sandboxes] == ["a1", "b1"]
    assert page.next_cursor == cursor_at(2.0, "b1")
    page = fleet.merge([a, b], 3)  # everything fits, but a has more: a next page
    assert page.next_cursor == cursor_at(3.0, "a2")
    page = fleet.merge([fleet.HostPage("a", [item("a1", 1)], False), b], 5, ["c", "c"])
    assert page.next_cursor is None and page.partial == ["c"]
    assert fleet.merge([], 5).sandboxes == []


def test_merge_lists_a_sandbox_two_hosts_have_once_as_its_owner_has_it() -> None:
    old = fleet.HostPage("a", [{**item("s1", 1), "state": "suspended"}], False)
    new = fleet.HostPage("b", [item("s1", 1), item("s2", 2)], False)
    for pages in ([old, new], [new, old]):
        page = fleet.merge(pages, 10, owner_of={"s1": "b"})
        assert [(s["id"], s["state"]) for s in page.sandboxes] == [("s1", "running"),
                                                                    ("s2", "running")]


def test_a_page_that_is_not_a_sandbox_list_is_refused() -> None:
    from gateway.cluster.errors import ProtocolError

    for body in ([], {"sandboxes": 1}, {"sandboxes": [{"id": "x"}]},
                 {"sandboxes": [{"id": 1, "created_at": 1.0}]},
                 {"sandboxes": [{"id": "x", "created_at": True}]}):
        with pytest.raises(ProtocolError):
            fleet.page_of("h", body)
    assert fleet.page_of("h", {"sandboxes": [], "next_cursor": "c"}).more
