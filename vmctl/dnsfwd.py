"""The sandboxes' resolver: a filtering DNS forwarder, one UDP and one TCP socket per sandbox.

Theory of operation. Every guest's resolver is its gateway, ``TAP_ADDR``:53 (the kernel
command line says ``agentbox.dns=``; guest/init.py writes /etc/resolv.conf). The daemon
opens that socket *inside the sandbox's network namespace* (a thread ``setns()``es, binds,
and hands the socket back; a socket keeps the namespace it was made in), so the guest talks
to it without any NAT, no host port is exposed, and which socket a query arrived on says
which sandbox asked: nothing the guest puts in the packet can claim another's policy.

A query is parsed strictly (``vmctl.dnsmsg``); a malformed one is dropped. A name the
sandbox's ``EgressPolicy`` does not allow gets NXDOMAIN. An allowed one is forwarded
unchanged to the upstream resolver (``network.dns_upstream``, else the host's
/etc/resolv.conf) over the same transport; when an allow-domain rule matched, the A/AAAA
addresses of the answer are added to the namespace's nftables sets ``dns4``/``dns6`` with
the record's TTL (at least ``MIN_TTL``, so a connect right after a zero-TTL answer still
works) *before* the answer is returned, so the guest's connect that follows finds them.
Bounded: queries per sandbox in flight, TCP connections per sandbox, message sizes, and
a timeout on every upstream exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from guest.protocol import TAP_ADDR
from vmctl import dnsmsg
from vmctl.egress import DNS_SETS, TABLE, EgressPolicy

log = logging.getLogger(__name__)

DNS_PORT = 53
UPSTREAM_TIMEOUT = 4.0
TCP_IDLE = 10.0
MAX_INFLIGHT = 32  # per sandbox
MAX_TCP = 8  # per sandbox
MIN_TTL, MAX_TTL = 30, 86400
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def upstream_from(text: str, resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int]:
    """``ADDR``, ``ADDR:PORT`` or ``[V6]:PORT``; empty: the host's first nameserver."""
    if not text:
        text_conf = resolv_conf.read_text() if resolv_conf.exists() else ""
        for line in text_conf.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                return str(ipaddress.ip_address(parts[1].split("%")[0])), DNS_PORT
        log.warning("no nameserver in %s: the sandboxes' resolver forwards to 127.0.0.1",
                    resolv_conf)
        return "127.0.0.1", DNS_PORT
    host, port = text, DNS_PORT
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else DNS_PORT
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = int(p)
    if not 0 < port < 65536:
        raise ValueError(f"bad port in {text!r}")
    return str(ipaddress.ip_address(host)), port


def _sockets_in(netns: str) -> tuple[socket.socket, socket.socket]:
    """A UDP and a listening TCP socket on TAP_ADDR:53 inside ``netns``."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns})")
            finally:
                os.close(fd)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            for s in (udp, tcp):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((TAP_ADDR, DNS_PORT))
                s.setblocking(False)
            tcp.listen(MAX_TCP)
            out["value"] = (udp, tcp)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"dns-{netns}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


@dataclass
class _Sandbox:
    netns: str
    policy: EgressPolicy
    udp: asyncio.DatagramTransport | None = None
    tcp: asyncio.Server | None = None
    inflight: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_INFLIGHT))
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    tcp_conns: int = 0


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver, box: _Sandbox) -> None:
        self.resolver, self.box = resolver, box
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.box.inflight.locked():
            return  # over the bound: dropped, the guest retries
        task = asyncio.get_running_loop().create_task(self._answer(data, addr),
                                                      name=f"dns-udp-{self.box.netns}")
        self.box.tasks.add(task)
        task.add_done_callback(self.box.tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        async with self.box.inflight:
            reply = await self.resolver.answer(self.box, data, tcp=False)
        if reply is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)


class Resolver:
    """Owns every sandbox's resolver sockets; ``aclose`` closes them all."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._boxes: dict[str, _Sandbox] = {}

    async def attach(self, netns: str, policy: EgressPolicy) -> None:
        """Serve ``netns`` with ``policy`` (a new policy applies to the next query)."""
        box = self._boxes.get(netns)
        if box is not None:
            box.policy = policy
            return
        udp_sock, tcp_sock = await asyncio.to_thread(_sockets_in, netns)
        box = _Sandbox(netns, policy)
        self._boxes[netns] = box
        loop = asyncio.get_running_loop()
        try:
            box.udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self, box),
                                                             sock=udp_sock)
            box.tcp = await asyncio.start_server(
                lambda r, w: self._tcp_client(box, r, w), sock=tcp_sock)
        except BaseException:
            self.detach(netns)
            udp_sock.close()
            tcp_sock.close()
            raise

    def detach(self, netns: str) -> None:
        box = self._boxes.pop(netns, None)
        if box is None:
            return
        if box.udp is not None:
            box.udp.close()
        if box.tcp is not None:
            box.tcp.close()
        for task in box.tasks:
            task.cancel()

    async def aclose(self) -> None:
        for netns in list(self._boxes):
            self.detach(netns)

    def policy_of(self, netns: str) -> EgressPolicy | None:
        box = self._boxes.get(netns)
        return box.policy if box else None

    async def answer(self, box: _Sandbox, data: bytes, tcp: bool) -> bytes | None:
        """The reply to one query from ``box``'s guest (None: drop it)."""
        try:
            query = dnsmsg.parse_query(data)
        except dnsmsg.DnsError:
            return None
        policy = box.policy
        if not policy.name_allowed(query.name):
            return dnsmsg.error_reply(data, query, dnsmsg.NXDOMAIN)
        try:
            reply = await asyncio.wait_for(self._exchange(data, tcp), UPSTREAM_TIMEOUT)
            if policy.learns(query.name):
                await self._learn(box.netns, dnsmsg.answer_addresses(reply, query))
        except (TimeoutError, OSError, dnsmsg.DnsError, subprocess.SubprocessError,
                struct.error) as exc:
            log.info("dns %s %s: %r", box.netns, query.name, exc)
            return dnsmsg.error_reply(data, query, dnsmsg.SERVFAIL)
        return reply

    async def _exchange(self, data: bytes, tcp: bool) -> bytes:
        host, port = self.upstream
        if tcp:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(struct.pack("!H", len(data)) + data)
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                return await reader.readexactly(length)
            finally:
                writer.close()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bytes] = loop.create_future()

        class Once(asyncio.DatagramProtocol):
            def datagram_received(self, reply: bytes, addr: object) -> None:
                if not done.done() and reply[:2] == data[:2]:
                    done.set_result(reply)

        transport, _ = await loop.create_datagram_endpoint(Once, remote_addr=(host, port))
        try:
            transport.sendto(data)
            return await done
        finally:
            transport.close()

    async def _learn(self, netns: str, found: list[tuple[str, int]]) -> None:
        """Open the answer's addresses (for their TTL) in ``netns``'s firewall."""
        if not found:
            return
        lines = []
        for addr, ttl in found:
            name = DNS_SETS[ipaddress.ip_address(addr).version]
            elem = f"{{ {addr} timeout {max(MIN_TTL, min(ttl, MAX_TTL))}s }}"
            # add + delete + add: one transaction that (re)sets the timeout whether or not
            # the element was there.
            lines += [f"add element inet {TABLE} {name} {{ {addr} }}",
                      f"delete element inet {TABLE} {name} {{ {addr} }}",
                      f"add element inet {TABLE} {name} {elem}"]
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", netns, "nft", "-f", "-", stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate("\n".join(lines).encode()), 10)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
            raise
        if proc.returncode != 0:
            raise OSError(f"nft in {netns}: {err.decode(errors='replace').strip()[:300]}")

    async def _tcp_client(self, box: _Sandbox, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        if box.tcp_conns >= MAX_TCP:
            writer.close()
            return
        box.tcp_conns += 1
        try:
            while True:
                (length,) = struct.unpack("!H", await asyncio.wait_for(
                    reader.readexactly(2), TCP_IDLE))
                if length > dnsmsg.MAX_QUERY:
                    return
                data = await asyncio.wait_for(reader.readexactly(length), TCP_IDLE)
                reply = await self.answer(box, data, tcp=True)
                if reply is None:
                    return
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            box.tcp_conns -= 1
            writer.close()
