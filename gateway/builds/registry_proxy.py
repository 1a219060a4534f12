"""The package-registry proxy a builder VM reaches the internet through.

Guests have no egress (vmctl.egress). A builder VM gets one hole: TCP to this proxy, which
listens on the builder's host-side veth address and connects only to the configured
registry hosts (``[build] registry_hosts``): ``CONNECT host:443`` is tunnelled (TLS stays
end to end), and a plain ``GET http://host/...`` (apt) is forwarded with ``Connection:
close``. Names are resolved by the host, so the guest needs no DNS. Anything else gets 403.
Headers are bounded (16 KiB), connects and silences time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
CONNECT_TIMEOUT = 15.0
IDLE_TIMEOUT = 300.0


def parse_target(request_line: str) -> tuple[str, str, int, str] | None:
    """(method, host, port, origin-form path) of a proxy request line, or None."""
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    method, target, _ = parts
    if method == "CONNECT":
        host, _, port = target.rpartition(":")
        return (method, host.lower(), int(port), "") if port.isdigit() and host else None
    if not target.startswith("http://"):
        return None
    rest = target[len("http://"):]
    hostport, slash, path = rest.partition("/")
    host, _, port = hostport.partition(":")
    if port and not port.isdigit():
        return None
    return method, host.lower(), int(port or 80), slash + path


def allowed(hosts: Iterable[str], method: str, host: str, port: int) -> bool:
    return host in set(hosts) and port == (443 if method == "CONNECT" else 80)


class RegistryProxy:
    """One listener per builder VM; ``aclose`` ends it and every tunnel it opened."""

    def __init__(self, hosts: Iterable[str]) -> None:
        self.hosts = tuple(h.lower() for h in hosts)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.denied: list[str] = []

    async def start(self, address: str, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, address, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (TimeoutError, OSError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        if len(head) > MAX_HEAD:
            return
        lines = head.decode("latin-1").split("\r\n")
        target = parse_target(lines[0])
        if target is None or not allowed(self.hosts, target[0], target[1], target[2]):
            self.denied.append(lines[0][:200])
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            await writer.drain()
            return
        method, host, port, path = target
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port),
                                            CONNECT_TIMEOUT)
        try:
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                headers = [h for h in lines[1:] if h and not h.lower().startswith(
                    ("connection:", "proxy-connection:", "keep-alive:", "proxy-authorization:"))]
                up_w.write(f"{method} {path} HTTP/1.1\r\n".encode("latin-1") +
                           "".join(f"{h}\r\n" for h in headers).encode("latin-1") +
                           b"Connection: close\r\n\r\n")
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        finally:
            up_w.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await asyncio.wait_for(src.read(65536), IDLE_TIMEOUT)
            if not data:
                break
            dst.write(data)
            await dst.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()
