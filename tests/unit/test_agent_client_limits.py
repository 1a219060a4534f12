"""The host's guest-agent client against a hostile fake agent (a raw TCP server): every
reply is bounded in size and time, and each way of breaking that is a typed error."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest

from vmctl import agent_client, agent_interp
from vmctl.agent_client import MAX_REPLY_BYTES, AgentClient, AgentError
from vmctl.errors import GuestReplyError, GuestReplyTimeout, GuestReplyTooLarge

CHUNK = b"[" + b"1," * 32767  # 64 KiB of a JSON array that never closes


class FakeAgent:
    """Answers every request the way ``mode`` says; counts the body bytes it got out."""

    def __init__(self, mode: str, stop_after: int = 128 << 20) -> None:
        self.mode, self.stop_after, self.sent = mode, stop_after, 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeAgent:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await getattr(self, "_" + self.mode)(writer)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client gave up: what we want
        finally:
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)

    async def _endless_body(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
        while self.sent < self.stop_after:  # "endless", but finite in case the client is not
            await self._send(writer, chunk)
        await self._send(writer, b"0\r\n\r\n")

    async def _huge_length(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n")
        await asyncio.sleep(5)

    async def _endless_headers(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\n")
        for i in range(100000):
            await self._send(writer, b"X-Filler-%d: %s\r\n" % (i, b"a" * 100))

    async def _trickle(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):
            await self._send(writer, b" ")
            await asyncio.sleep(0.05)

    async def _trickle_headers(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\nX-Slow: ")
        for _ in range(1000):
            await self._send(writer, b"a")
            await asyncio.sleep(0.05)

    async def _not_json(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    async def _long_error(self, writer: asyncio.StreamWriter) -> None:
        body = json.dumps({"error": {"code": "bad_request", "message": "x" * 50000}}).encode()
        await self._send(writer, b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))

    async def _huge_error(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
        while self.sent < self.stop_after:
            await self._send(writer, chunk)

    async def _stream_line(self, writer: asyncio.StreamWriter) -> None:
        await self._send(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
        first = b'{"type": "start", "pid": 1}\n'
        await self._send(writer, b"%x\r\n%s\r\n" % (len(first), first))
        chunk = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
        while self.sent < self.stop_after:
            await self._send(writer, chunk)


async def call(mode: str, fn, **fake):
    async with FakeAgent(mode, **fake) as fake_agent:
        agent = AgentClient("127.0.0.1", fake_agent.port)
        try:
            return fake_agent, await fn(agent)
        finally:
            await agent.aclose()


async def test_endless_json_body_stops_at_the_cap_with_bounded_memory():
    tracemalloc.start()
    try:
        with pytest.raises(GuestReplyTooLarge) as info:
            await asyncio.wait_for(call("endless_body", lambda a: a.health()), 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 502 and info.value.code == "agent_reply_too_large"
    # The whole 128 MiB "endless" body would have been read; the cap stops it at 8 MiB.
    assert peak < 3 * MAX_REPLY_BYTES, peak


async def test_declared_length_over_the_cap_fails_before_reading():
    with pytest.raises(GuestReplyTooLarge):
        await asyncio.wait_for(call("huge_length", lambda a: a.health()), 3)


async def test_endless_headers_are_a_protocol_error_not_a_500():
    with pytest.raises(GuestReplyError) as info:
        await asyncio.wait_for(call("endless_headers", lambda a: a.health()), 10)
    assert info.value.code == "agent_protocol_error" and info.value.status == 502


async def test_a_trickling_body_times_out(monkeypatch):
    monkeypatch.setattr(agent_client, "REPLY_BODY_TIMEOUT", 0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(GuestReplyTimeout) as info:
        await call("trickle", lambda a: a._json("GET", "/commands", timeout=None))
    assert loop.time() - started < 3
    assert info.value.status == 504 and isinstance(info.value, TimeoutError)


async def test_trickling_headers_hit_the_request_timeout_as_a_typed_error():
    with pytest.raises(GuestReplyTimeout):
        await asyncio.wait_for(call("trickle_headers", lambda a: a._json(
            "GET", "/commands", timeout=0.3)), 5)


async def test_a_reply_that_is_not_json_is_a_protocol_error():
    with pytest.raises(GuestReplyError) as info:
        await call("not_json", lambda a: a.health())
    assert info.value.code == "agent_protocol_error"


async def test_guest_error_text_is_bounded():
    with pytest.raises(AgentError) as info:
        await call("long_error", lambda a: a.health())
    assert info.value.code == "bad_request" and info.value.status == 400
    assert len(str(info.value)) < agent_client.MAX_ERROR_TEXT + 50


async def test_an_endless_error_body_is_cut_and_reported_generically():
    with pytest.raises(AgentError) as info:
        await asyncio.wait_for(call("huge_error", lambda a: a.health()), 20)
    assert info.value.code == "agent_error" and "500" in str(info.value)


async def test_an_endless_ndjson_line_is_bounded():
    async def consume(agent):
        resp = await agent._request("GET", "/commands/1/output", timeout=None)
        try:
            return [e async for e in agent_interp.iter_events(resp, max_line=1 << 20)]
        finally:
            resp.release()

    with pytest.raises(GuestReplyTooLarge):
        await asyncio.wait_for(call("stream_line", consume), 20)
