"""Live migration between hosts: the TCP leg the daemons carry for their confined VMMs.

A confined QEMU runs chrooted in its sandbox's network namespace, so it cannot reach
another host, and must not: it parses guest-controlled traffic. It talks only to Unix
sockets in its own directory (``QemuDriver.listen_incoming`` / ``send_live``) and the
daemons bridge those over TCP:

    source QEMU --unix--> source daemon ==TCP==> destination daemon --unix--> dest QEMU

Two channels, each one TCP connection: ``disk`` (the source's NBD client mirroring its
top disk layer into the destination's NBD export) and ``ram`` (QEMU's migration
stream: RAM, then device state). The destination listens on a port of its own for one
migration (``Incoming``); each connection must first send ``MAGIC``, the migration's
one-time token (32 random bytes, handed to the source over the authenticated
host-to-host API) and its channel's code. Only then does the daemon connect it to
QEMU's socket: no byte from an unauthenticated peer ever reaches QEMU. Each channel is
accepted once; after both, the port closes.

Why not pass the sockets themselves to QEMU (``getfd``): QEMU's NBD client connects
from a worker thread, where a monitor fd name cannot be resolved, and the TCP leg would
then end in QEMU, so a peer's first bytes (the token) would reach it. The relay costs a
copy through the daemon; at TCG speeds the guest, not the copy, is the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmctl import streams
from vmctl.driver import Connect, LiveStats
from vmctl.errors import MigrationError
from vmctl.machine import Machine

__all__ = ["Incoming", "MigrationError", "Offer", "dialer", "migrate"]

log = logging.getLogger(__name__)

MAGIC = b"AGENTBOX-MIGRATE/1\n"
TOKEN_BYTES = 32
CHANNELS = {"disk": b"D", "ram": b"R"}
HEADER_LEN = len(MAGIC) + TOKEN_BYTES + 1
HEADER_TIMEOUT_S = 10.0  # a connection that does not say who it is within this is closed
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Offer:
    """Where the source sends one migration's streams, and the token they must carry."""

    host: str
    port: int
    token: str  # hex

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not 0 < len(self.host) <= 253:
            raise ValueError("offer host must be a host name or address")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError("offer port must be 1..65535")
        try:
            if len(bytes.fromhex(self.token)) != TOKEN_BYTES:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"offer token must be {TOKEN_BYTES} bytes in hex") from None

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "token": self.token}

    @classmethod
    def from_dict(cls, data: object) -> Offer:
        if not isinstance(data, dict):
            raise ValueError("offer must be an object")
        return cls(host=data.get("host"), port=data.get("port"), token=data.get("token"))  # type: ignore[arg-type]


def dialer(offer: Offer, timeout: float = CONNECT_TIMEOUT_S) -> Connect:
    """The source's side: open a channel's TCP connection to the destination."""
    token = bytes.fromhex(offer.token)

    async def connect(channel: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(offer.host, offer.port), timeout)
        except (OSError, TimeoutError) as exc:
            raise MigrationError(f"cannot reach the destination {offer.host}:{offer.port} "
                                 f"for the {channel} stream: {exc}") from exc
        writer.write(MAGIC + token + CHANNELS[channel])
        return reader, writer

    return connect


class Incoming:
    """The destination's side of one migration: a ``Machine`` whose VMM waits for the
    streams (``Machine.receive``), and the TCP port they come in on."""

    def __init__(self, machine: Machine, sockets: dict[str, Path], host: str) -> None:
        self.machine = machine
        self._sockets = sockets
        self._host = host
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._claimed: set[str] = set()
        self._server: asyncio.AbstractServer | None = None
        self._relays: set[asyncio.Task] = set()
        self.refused = 0  # connections turned away (bad magic, token or channel)

    @classmethod
    async def open(cls, machine: Machine, disk_bytes: int, bind: str,
                   advertise: str | None = None) -> Incoming:
        """Start the destination VMM and listen on ``bind`` (port chosen by the kernel).
        ``advertise``: the address the source connects to, if not ``bind``."""
        sockets = await machine.receive(disk_bytes)
        incoming = cls(machine, sockets, advertise or bind)
        try:
            incoming._server = await asyncio.start_server(incoming._accept, bind, 0)
        except BaseException:
            await asyncio.shield(machine.destroy())
            raise
        return incoming

    @property
    def offer(self) -> Offer:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return Offer(host=self._host, port=port, token=self._token.hex())

    async def commit(self, timeout: float = 60.0) -> None:
        """Wait for the whole stream, then run the guest here. Raises ``MigrationError``
        (or is cancelled) only after the destination is torn down: the source may then
        run again."""
        try:
            await self.machine.finish_receive(timeout)
        except BaseException as exc:
            driver = self.machine.driver
            detail = driver.exit_detail() if driver is not None else ""
            if detail:  # the log only: the VMM's own messages name host paths
                log.warning("migration of %s: the destination VMM failed%s",
                            self.machine.plan.vm_id, detail)
            await asyncio.shield(self.abort())
            if isinstance(exc, Exception) and not isinstance(exc, MigrationError):
                raise MigrationError(f"the destination did not start: {exc}") from exc
            raise
        await self.close()

    async def abort(self) -> None:
        """Tear the destination down: streams, port, VMM, namespace, files. Idempotent."""
        await self.close()
        await self.machine.destroy()

    async def close(self) -> None:
        """Stop listening and end the relays (the VM, if it runs, stays)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        relays = set(self._relays)
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        try:
            channel = await self._check(reader)
            if channel is None:
                self.refused += 1
                writer.close()
                return
            try:
                qemu = await streams.open_unix(self._sockets[channel])
            except OSError as exc:
                log.warning("migration of %s: cannot reach its VMM's %s socket: %s",
                            self.machine.plan.vm_id, channel, exc)
                writer.close()
                return
            await streams.splice((reader, writer), qemu)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            writer.close()
        finally:
            self._relays.discard(task)

    async def _check(self, reader: asyncio.StreamReader) -> str | None:
        """The channel a connection's header names, if its magic and token are right and
        the channel is not taken; None otherwise."""
        try:
            header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), HEADER_TIMEOUT_S)
        except (asyncio.IncompleteReadError, TimeoutError, OSError):
            return None
        magic, token, code = (header[:len(MAGIC)], header[len(MAGIC):-1], header[-1:])
        if magic != MAGIC or not hmac.compare_digest(token, self._token):
            log.warning("migration of %s: a connection with a wrong token was refused",
                        self.machine.plan.vm_id)
            return None
        channel = next((name for name, c in CHANNELS.items() if c == code), None)
        if channel is None or channel in self._claimed:
            return None
        self._claimed.add(channel)
        if self._claimed == set(CHANNELS) and self._server is not None:
            self._server.close()  # one-time: nothing else connects to this migration
        return channel


async def migrate(source: Machine, incoming: Incoming, timeout: float = 300.0,
                  live: bool | None = None) -> LiveStats:
    """Move ``source`` to ``incoming``'s machine (both in this process: tests, and the
    shape the daemons follow with an HTTP call in the middle). A failure or cancellation
    leaves the source running and the destination torn down."""
    committed = False

    async def commit() -> None:
        nonlocal committed
        await incoming.commit()
        committed = True

    try:
        return await source.migrate_out(dialer(incoming.offer), commit, timeout, live)
    except BaseException:
        if not committed:  # after the commit the destination is the sandbox
            with contextlib.suppress(Exception):
                await asyncio.shield(incoming.abort())
        raise
