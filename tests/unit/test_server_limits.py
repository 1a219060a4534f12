"""Server-side bounds from config: the header-read timeout (slowloris) proven with a raw
socket against the server options the daemon really runs with, and config validation."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from gateway.http.app import server_options
from gateway.config import Config, ConfigError, ServerConfig, load


async def serve(config: Config) -> tuple[web.AppRunner, int]:
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app.router.add_get("/", hello)
    opts = server_options(config)
    opts.pop("access_log")  # AppRunner takes the logger itself; None = no access log
    runner = web.AppRunner(app, access_log=None, **opts)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_headers_sent_a_byte_at_a_time_are_cut_off():
    runner, port = await serve(Config(server=ServerConfig(header_read_timeout=1.0)))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        request = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
        cut_off = None
        for byte in request:  # one byte every 50 ms: complete headers would take 50 s
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                cut_off = time.monotonic() - started
                break
            if reader.at_eof() or writer.is_closing():
                cut_off = time.monotonic() - started
                break
            try:
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    cut_off = time.monotonic() - started
                    break
            except TimeoutError:
                pass
            except ConnectionError:
                cut_off = time.monotonic() - started
                break
        writer.close()
        assert cut_off is not None, "the slow client was never disconnected"
        assert 0.9 <= cut_off < 3.0, cut_off
    finally:
        await runner.cleanup()


async def test_a_prompt_client_is_served_and_an_idle_one_closed():
    runner, port = await serve(Config(server=ServerConfig(header_read_timeout=1.0)))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(2), 5) == b"hi"
        # The keep-alive connection, idle after its response, is closed after the timeout.
        assert await asyncio.wait_for(reader.read(1), 5) == b""
        writer.close()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("key,value", [("max_ws_message_bytes", 0),
                                       ("max_ws_message_bytes", 100),
                                       ("header_read_timeout", 0)])
def test_bad_limits_fail_start_up_naming_the_key(tmp_path, key, value):
    path = tmp_path / "c.toml"
    path.write_text(f"[server]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=key):
        load(path)


def test_shipped_config_sets_the_limits():
    server = load().server
    assert server.max_ws_message_bytes == 16 << 20 and server.header_read_timeout == 15
