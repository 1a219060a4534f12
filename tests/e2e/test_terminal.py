"""The terminal WebSocket through the real daemon, against real microVMs (issue 4)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

pytestmark = pytest.mark.e2e


async def open_terminal(daemon, session: aiohttp.ClientSession, sid: str,
                        **params) -> aiohttp.ClientWebSocketResponse:
    return await session.ws_connect(
        f"{daemon.url}/v1/sandboxes/{sid}/terminal", params={k: str(v) for k, v in
                                                           params.items()},
        headers={"Authorization": f"Bearer {daemon.admin_key}"}, max_msg_size=0)


async def read_until(ws, needle: bytes, timeout: float = 60) -> bytes:
    buf = b""
    async with asyncio.timeout(timeout):
        while needle not in buf:
            msg = await ws.receive()
            assert msg.type is aiohttp.WSMsgType.BINARY, (msg, buf[-500:])
            buf += msg.data
    return buf


def state(api, sid: str) -> dict:
    return api.get(f"/v1/sandboxes/{sid}").json()


async def test_echo_resize_and_exit(daemon, sandbox):
    async with aiohttp.ClientSession() as session:
        ws = await open_terminal(daemon, session, sandbox["id"], cols=100, rows=30)
        await ws.send_bytes(b"echo $((6 * 7)); tty\r")  # the echoed input holds no "42"
        assert b"42\r\n/dev/pts/" in await read_until(ws, b"/dev/pts/")
        await ws.send_bytes(b"stty size\r")
        await read_until(ws, b"30 100\r\n")
        await ws.send_str(json.dumps({"type": "resize", "cols": 132, "rows": 43}))
        await ws.send_bytes(b"stty size\r")
        await read_until(ws, b"43 132\r\n")
        await ws.send_bytes(b"exit 3\r")
        async with asyncio.timeout(30):
            msg = await ws.receive()
            while msg.type is aiohttp.WSMsgType.BINARY:  # the rest of the output
                msg = await ws.receive()
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            assert json.loads(msg.data) == {"type": "exit", "exit_code": 3}
            msg = await ws.receive()
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1000, msg
        assert ws.close_code == 1000


async def test_errors_before_the_upgrade_are_json(daemon, api, sandbox):
    r = api.get(f"/v1/sandboxes/{sandbox['id']}/terminal")  # not a WebSocket upgrade
    assert r.status_code == 400 and r.json()["error"]["code"] == "websocket_required"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await open_terminal(daemon, session, "0000000000000000")
        assert info.value.status == 404
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await open_terminal(daemon, session, sandbox["id"], cols=0)
        assert info.value.status == 400


async def test_a_terminal_wakes_a_suspended_sandbox(daemon, api, sandbox):
    sid = sandbox["id"]
    r = api.post(f"/v1/sandboxes/{sid}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
    async with aiohttp.ClientSession() as session:
        ws = await open_terminal(daemon, session, sid)
        assert state(api, sid)["state"] == "running"
        await ws.send_bytes(b"echo woke=$((40 + 2))\r")
        await read_until(ws, b"woke=42")
        await ws.close()
    assert state(api, sid)["restore_count"] >= 1


async def test_an_open_terminal_keeps_the_sandbox_awake(daemon, api, sandbox):
    sid = sandbox["id"]
    assert api.patch(f"/v1/sandboxes/{sid}", json={"idle_timeout": 1}).status_code == 200
    async with aiohttp.ClientSession() as session:
        ws = await open_terminal(daemon, session, sid)
        await asyncio.sleep(4)  # idle terminal, no requests: still counted as activity
        info = state(api, sid)
        assert info["state"] == "running" and info["suspend_count"] == 0, info
        await ws.send_bytes(b"echo still=$((40 + 2))\r")
        await read_until(ws, b"still=42")
        await ws.close()
    deadline = time.monotonic() + 60  # closed: the idle timeout applies again
    while (info := state(api, sid))["state"] != "suspended":
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.2)
