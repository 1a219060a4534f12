"""The TCP leg of a live migration (vmctl/migrate.py) without VMs: a fake destination
machine whose "VMM sockets" are Unix servers of the test. What reaches them, and what
never does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from vmctl import migrate


class FakeVMM:
    """Unix servers standing for the destination QEMU's NBD and migration sockets."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.received: dict[str, bytes] = {"disk": b"", "ram": b""}
        self.connections = 0
        self.servers: list[asyncio.AbstractServer] = []

    async def start(self) -> dict[str, Path]:
        paths = {}
        for channel in ("disk", "ram"):
            path = self.dir / f"{channel}.sock"

            async def serve(reader, writer, channel=channel):  # type: ignore[no-untyped-def]
                self.connections += 1
                data = await reader.read()
                self.received[channel] += data
                writer.write(b"ack:" + data[:8])
                await writer.drain()
                writer.close()

            self.servers.append(await asyncio.start_unix_server(serve, str(path)))
            paths[channel] = path
        return paths

    def close(self) -> None:
        for server in self.servers:
            server.close()


class FakeMachine:
    def __init__(self, vmm: FakeVMM) -> None:
        self.vmm = vmm
        self.destroyed = False
        self.finished = False
        self.fail_finish = False
        self.plan = type("Plan", (), {"vm_id": "fake"})()
        self.driver = None

    async def receive(self, disk_bytes: int) -> dict[str, Path]:
        return await self.vmm.start()

    async def finish_receive(self, timeout: float) -> None:
        if self.fail_finish:
            raise RuntimeError("guest did not come up")
        self.finished = True

    async def destroy(self) -> None:
        self.destroyed = True
        self.vmm.close()


@pytest.fixture
async def incoming(tmp_path: Path):  # type: ignore[no-untyped-def]
    machine = FakeMachine(FakeVMM(tmp_path))
    inc = await migrate.Incoming.open(machine, 1 << 30, "127.0.0.1")  # type: ignore[arg-type]
    yield inc
    await inc.abort()


async def send(connect, channel: str, payload: bytes) -> bytes:  # type: ignore[no-untyped-def]
    reader, writer = await connect(channel)
    writer.write(payload)
    await writer.drain()
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_both_channels_reach_their_sockets_and_the_port_closes_after(incoming) -> None:
    connect = migrate.dialer(incoming.offer)
    assert await send(connect, "disk", b"DISKDATA" * 1000) == b"ack:DISKDATA"
    assert await send(connect, "ram", b"RAMBYTES" * 100_000) == b"ack:RAMBYTES"
    vmm = incoming.machine.vmm
    assert vmm.received == {"disk": b"DISKDATA" * 1000, "ram": b"RAMBYTES" * 100_000}
    # One-time: with both channels claimed nothing else may connect.
    await asyncio.sleep(0.05)
    with pytest.raises(migrate.MigrationError):
        await connect("ram")


async def test_a_wrong_token_or_a_second_claim_never_reaches_the_vmm(incoming) -> None:
    offer = incoming.offer
    forged = migrate.dialer(migrate.Offer(offer.host, offer.port, "ab" * migrate.TOKEN_BYTES))
    assert await send(forged, "ram", b"x" * 4096) == b""
    good = migrate.dialer(offer)
    assert await send(good, "disk", b"first") == b"ack:first"
    assert await send(good, "disk", b"second") == b""  # the channel was claimed
    # Garbage instead of a header, and a peer that says nothing.
    reader, writer = await asyncio.open_connection(offer.host, offer.port)
    writer.write(b"GET / HTTP/1.1\r\n" + b"x" * 200)
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    vmm = incoming.machine.vmm
    assert vmm.connections == 1 and vmm.received["ram"] == b""
    assert incoming.refused == 3


async def test_a_failed_commit_tears_the_destination_down(incoming) -> None:
    incoming.machine.fail_finish = True
    with pytest.raises(migrate.MigrationError, match="did not come up"):
        await incoming.commit()
    assert incoming.machine.destroyed


def test_offers_are_checked() -> None:
    good = {"host": "10.0.0.2", "port": 4000, "token": "00" * migrate.TOKEN_BYTES}
    assert migrate.Offer.from_dict(good).to_dict() == good
    for bad in ({**good, "port": 0}, {**good, "port": "80"}, {**good, "token": "zz"},
                {**good, "token": "00"}, {**good, "host": ""}, [], None):
        with pytest.raises(ValueError):
            migrate.Offer.from_dict(bad)
