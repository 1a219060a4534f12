"""GET /ports and POST /ports/{port}/expose against the real agent app and the host's
real socket tables; forwarders bind 127.0.0.2 here (GUEST_ADDR in a VM)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import pytest

from guest import ports
from guest.agent import create_app
from guest.protocol import AGENT_PORT, PortExposure, PortInfo

pytestmark = pytest.mark.timeout(60)
FORWARD_ADDR = "127.0.0.2"


@pytest.fixture
async def client(aiohttp_client, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTBOX_FORWARD_ADDR", FORWARD_ADDR)
    return await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))


async def _echo_then_bye(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # Echo until the client half-closes, then say "bye" and close.
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write(b"bye")
    await writer.drain()
    writer.close()


@pytest.fixture
async def local_server():
    """An echo server that listens on 127.0.0.1 only (a typical dev server)."""
    server = await asyncio.start_server(_echo_then_bye, "127.0.0.1", 0)
    yield server
    server.close()


def port_of(server: asyncio.AbstractServer) -> int:
    return server.sockets[0].getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def expose(client, port: int) -> PortExposure:
    resp = await client.post(f"/ports/{port}/expose")
    assert resp.status == 200, await resp.text()
    return PortExposure.from_dict(await resp.json())


async def listed(client) -> dict[int, PortInfo]:
    resp = await client.get("/ports")
    assert resp.status == 200
    return {p.port: p for p in map(PortInfo.from_dict, (await resp.json())["ports"])}


async def error_of(resp) -> tuple[int, str]:
    return resp.status, (await resp.json())["error"]["code"]


async def roundtrip(port: int, payload: bytes) -> bytes:
    """Send ``payload`` through the forwarder, half-close, read everything back."""
    reader, writer = await asyncio.open_connection(FORWARD_ADDR, port)
    try:
        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        got = await reader.read()  # to EOF
        await sender
        return got
    finally:
        writer.close()


async def test_expose_forwards_to_a_loopback_only_server(client, local_server):
    port = port_of(local_server)
    with pytest.raises(OSError):  # not reachable on the forward address before
        await asyncio.open_connection(FORWARD_ADDR, port)
    assert await expose(client, port) == PortExposure(port, forwarded=True, listening=True)
    assert await roundtrip(port, b"hello") == b"hellobye"  # data both ways, then half-close
    assert await expose(client, port) == PortExposure(port, forwarded=True, listening=True)
    info = (await listed(client))[port]
    assert info.addresses == ["127.0.0.1"] and info.forwarded  # our own socket is left out


async def test_large_transfer_both_ways_concurrently(client, local_server):
    port = port_of(local_server)
    await expose(client, port)
    payload = os.urandom(8 * 1024 * 1024)  # more than every buffer on the way: backpressure
    results = await asyncio.gather(roundtrip(port, payload), roundtrip(port, payload[:1000]))
    assert results == [payload + b"bye", payload[:1000] + b"bye"]


async def test_nothing_listening_is_404(client):
    resp = await client.post(f"/ports/{free_port()}/expose")
    assert await error_of(resp) == (404, "port_not_listening")


async def test_bad_and_reserved_ports(client):
    assert await error_of(await client.post("/ports/70000/expose")) == (400, "bad_request")
    assert await error_of(await client.post("/ports/0/expose")) == (400, "bad_request")
    resp = await client.post(f"/ports/{AGENT_PORT}/expose")
    assert await error_of(resp) == (400, "port_reserved")
    assert (await client.post("/ports/abc/expose")).status == 404


async def test_a_server_on_every_address_needs_no_forwarder(client):
    server = await asyncio.start_server(_echo_then_bye, "0.0.0.0", 0)
    try:
        port = port_of(server)
        assert await expose(client, port) == PortExposure(port, forwarded=False, listening=True)
        info = (await listed(client))[port]
        assert info.addresses == ["0.0.0.0"] and not info.forwarded
    finally:
        server.close()


async def test_forwarder_closes_when_the_service_goes_away(client, local_server):
    port = port_of(local_server)
    await expose(client, port)
    local_server.close()
    await local_server.wait_closed()
    # The next connection finds nothing to pass on to: it is closed, and so is the forwarder.
    reader, writer = await asyncio.open_connection(FORWARD_ADDR, port)
    with contextlib.suppress(ConnectionError):
        assert await reader.read() == b""
    writer.close()
    async with asyncio.timeout(5):
        while True:
            try:
                _, w = await asyncio.open_connection(FORWARD_ADDR, port)
                w.close()
                await asyncio.sleep(0.02)
            except ConnectionRefusedError:
                break
    assert port not in await listed(client)
    resp = await client.post(f"/ports/{port}/expose")
    assert await error_of(resp) == (404, "port_not_listening")


async def test_concurrent_exposes_start_one_forwarder(client, local_server):
    port = port_of(local_server)
    results = await asyncio.gather(*(expose(client, port) for _ in range(5)))
    assert all(r.forwarded for r in results)
    assert await roundtrip(port, b"x") == b"xbye"


async def test_app_cleanup_closes_forwarders(client, local_server):
    port = port_of(local_server)
    await expose(client, port)
    reader, writer = await asyncio.open_connection(FORWARD_ADDR, port)  # an open connection
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    await client.server.close()
    with contextlib.suppress(ConnectionError):
        assert await reader.read() == b""  # closed by the agent
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(FORWARD_ADDR, port)


# -- /proc/net/tcp parsing ------------------------------------------------------------------

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 00000000:C2AF 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 1500FEA9:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 0100007F:1F90 0100007F:D8F2 01 00000000:00000000 00:00000000 00000000     0        0 4 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue
   0: 00000000000000000000000001000000:0BB8 00000000000000000000000000000000:0000 0A 0:0
   1: 00000000000000000000000000000000:0050 00000000000000000000000000000000:0000 0A 0:0
   2: 0000000000000000FFFF00000100007F:1F91 00000000000000000000000000000000:0000 0A 0:0
"""


@pytest.mark.skipif(socket.htonl(1) == 1, reason="the samples are little-endian")
def test_parse_proc_net_tcp():
    v4 = ports.parse_listeners(TCP, v6=False)
    assert v4 == [("127.0.0.1", 8080), ("0.0.0.0", 49839), ("169.254.0.21", 22)]
    v6 = ports.parse_listeners(TCP6, v6=True)
    assert v6 == [("::1", 3000), ("::", 80), ("127.0.0.1", 8081)]
    assert ports.group_listeners(v4 + v6 + [("::1", 8080)]) == {
        22: ["169.254.0.21"], 80: ["::"], 3000: ["::1"], 8080: ["127.0.0.1", "::1"],
        8081: ["127.0.0.1"], 49839: ["0.0.0.0"]}


def test_pick_target_prefers_ipv4_loopback():
    assert ports.pick_target(["::1", "127.0.0.1"]) == "127.0.0.1"
    assert ports.pick_target(["::1"]) == "::1"
    assert ports.pick_target(["10.0.0.5", "127.0.0.5"]) == "127.0.0.5"
    assert ports.pick_target(["10.0.0.5"]) == "10.0.0.5"
