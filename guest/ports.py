"""Listening ports and exposing loopback-only services: ``GET /ports``,
``POST /ports/{port}/expose``.

Theory of operation. The host reaches the guest at ``GUEST_ADDR`` (its DNAT sends
every port there), so a service bound to 0.0.0.0 or GUEST_ADDR is reachable as it
is, but one bound to 127.0.0.1 (or ::1) -- most dev servers' default -- is not.
Exposing such a port starts a forwarder: an asyncio TCP server on
``GUEST_ADDR:port`` that pipes each connection to the loopback listener, both
directions concurrently, each waiting for the other side to drain (backpressure),
passing a half-close (EOF) on, and closing both sockets once both directions
ended or either one broke.

What listens is read from the kernel's socket tables (``/proc/net/tcp`` and
``tcp6``, LISTEN entries), parsed by pure functions. Our own forwarders' sockets
are left out of the answers. Exposing is idempotent; a forwarder whose target
stopped listening closes itself at the next connection it fails to pass on (the
client's connection is closed) or at the next expose of that port.

:class:`Forwards` owns the servers and their connections' tasks; ``aclose`` (the
app's cleanup) closes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import struct
from collections.abc import AsyncIterator

from aiohttp import web

from guest.errors import AgentError, BadRequest, NotFound
from guest.protocol import AGENT_PORT, GUEST_ADDR, PortExposure, PortInfo, validate_port

log = logging.getLogger("agentbox.guest.ports")

PROC_TABLES = (("/proc/net/tcp", False), ("/proc/net/tcp6", True))
TCP_LISTEN = 0x0A  # the kernel's TCP_LISTEN in the ``st`` column
WILDCARDS = frozenset({"0.0.0.0", "::"})
CHUNK = 64 * 1024
CLOSE_TIMEOUT = 5.0


class PortNotListening(NotFound):
    code = "port_not_listening"


class PortReserved(BadRequest):
    code = "port_reserved"


class ForwardFailed(AgentError):
    code = "forward_failed"


# -- what listens (sans-IO) ----------------------------------------------------------------

def decode_address(hex_addr: str, v6: bool) -> str:
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host order) -> text.
    An IPv4-mapped IPv6 address comes back as plain IPv4."""
    raw = b"".join(struct.pack("=I", int(hex_addr[i:i + 8], 16))
                   for i in range(0, len(hex_addr), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def parse_listeners(text: str, v6: bool) -> list[tuple[str, int]]:
    """``(address, port)`` of each LISTEN socket in one /proc/net/tcp{,6} table."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or int(fields[3], 16) != TCP_LISTEN:
            continue
        hex_addr, _, hex_port = fields[1].partition(":")
        out.append((decode_address(hex_addr, v6), int(hex_port, 16)))
    return out


def group_listeners(pairs: list[tuple[str, int]]) -> dict[int, list[str]]:
    ports: dict[int, set[str]] = {}
    for addr, port in pairs:
        ports.setdefault(port, set()).add(addr)
    return {port: sorted(addrs) for port, addrs in sorted(ports.items())}


def pick_target(addresses: list[str]) -> str:
    """The address a forwarder connects to: IPv4 loopback, IPv6 loopback, else any."""
    for preferred in ("127.0.0.1", "::1"):
        if preferred in addresses:
            return preferred
    loopback = [a for a in addresses if ipaddress.ip_address(a).is_loopback]
    return (loopback or addresses)[0]


def read_listeners() -> dict[int, list[str]]:
    pairs: list[tuple[str, int]] = []
    for path, v6 in PROC_TABLES:
        try:
            with open(path, encoding="ascii") as f:
                pairs += parse_listeners(f.read(), v6)
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
    return group_listeners(pairs)


# -- forwarders ------------------------------------------------------------------------------

class Forwards:
    """The forwarders, one per exposed port, bound to ``bind_addr`` (default GUEST_ADDR)."""

    def __init__(self, bind_addr: str | None = None) -> None:
        self.bind_addr = bind_addr or os.environ.get("AGENTBOX_FORWARD_ADDR", GUEST_ADDR)
        self._servers: dict[int, asyncio.AbstractServer] = {}
        self._conns: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()

    def listeners(self) -> dict[int, list[str]]:
        """Listening ports -> their users' bind addresses (without our forwarders)."""
        ports = read_listeners()
        for port in self._servers:
            if port in ports:
                ports[port] = [a for a in ports[port] if a != self.bind_addr]
        return {p: a for p, a in ports.items() if a and p != AGENT_PORT}

    def listing(self) -> list[PortInfo]:
        return [PortInfo(port, addrs, port in self._servers)
                for port, addrs in self.listeners().items()]

    async def expose(self, port: int) -> PortExposure:
        if port == AGENT_PORT:
            raise PortReserved(f"port {port} is the guest agent's")
        async with self._lock:  # two exposes of one port must not both bind it
            addrs = self.listeners().get(port, [])
            if not addrs:
                self._drop(port)
                raise PortNotListening(f"nothing listens on port {port} in the sandbox")
            if port in self._servers:
                return PortExposure(port, forwarded=True, listening=True)
            if any(a in WILDCARDS or a == self.bind_addr for a in addrs):
                return PortExposure(port, forwarded=False, listening=True)
            await self._start(port, pick_target(addrs))
            return PortExposure(port, forwarded=True, listening=True)

    async def _start(self, port: int, target: str) -> None:
        serve = functools.partial(self._serve, port, target)
        try:
            server = await asyncio.start_server(serve, self.bind_addr, port, reuse_address=True)
        except OSError as exc:
            raise ForwardFailed(f"cannot listen on {self.bind_addr}:{port}: "
                                f"{exc.strerror or exc}") from exc
        self._servers[port] = server
        log.info("forwarding %s:%d -> %s:%d", self.bind_addr, port, target, port)

    def _drop(self, port: int, server: asyncio.AbstractServer | None = None) -> None:
        current = self._servers.get(port)
        if current is not None and (server is None or server is current):
            del self._servers[port]
            current.close()
            log.info("stopped forwarding port %d: nothing listens on it", port)

    async def _serve(self, port: int, target: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        server = self._servers.get(port)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(target, port)
            except BaseException as exc:
                writer.close()
                if isinstance(exc, OSError):
                    self._drop(port, server)  # the service went away
                    return
                raise
            await splice((reader, writer), (up_reader, up_writer))
        finally:
            self._conns.discard(task)

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        yield
        await self.aclose()

    async def aclose(self) -> None:
        for port in list(self._servers):
            self._servers.pop(port).close()
        for task in self._conns:
            task.cancel()
        if self._conns:
            await asyncio.wait(set(self._conns), timeout=CLOSE_TIMEOUT)

    # -- handlers ----------------------------------------------------------------------------

    async def handle_list(self, request: web.Request) -> web.Response:
        return web.json_response({"ports": [p.to_dict() for p in self.listing()]})

    async def handle_expose(self, request: web.Request) -> web.Response:
        port = validate_port(int(request.match_info["port"]))
        return web.json_response((await self.expose(port)).to_dict())


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def splice(a: Stream, b: Stream) -> None:
    """Pipe two connections into each other until both directions ended or one broke."""
    pipes = {asyncio.create_task(_pipe(a[0], b[1]), name="forward-up"),
             asyncio.create_task(_pipe(b[0], a[1]), name="forward-down")}
    clean = True
    try:
        pending = pipes
        while pending and clean:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            clean = all(t.result() for t in done)
    finally:
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        for _, writer in (a, b):
            if clean:
                writer.close()
            else:
                writer.transport.abort()  # a reset on one side is a reset on the other
        for _, writer in (a, b):
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copy until EOF, then pass the EOF on (half-close). False if either side broke."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
        return True
    except OSError:  # ConnectionResetError, BrokenPipeError, ...
        return False


def add_routes(app: web.Application) -> Forwards:
    forwards = Forwards()
    app.cleanup_ctx.append(forwards.lifespan)
    app.router.add_get("/ports", forwards.handle_list, allow_head=False)
    app.router.add_post(r"/ports/{port:\d+}/expose", forwards.handle_expose)
    return forwards
