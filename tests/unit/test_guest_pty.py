"""GET /pty against the real agent app: real shells on real pseudo-terminals on the host."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from guest import execution
from guest.agent import create_app
from guest.protocol import Health

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def client(aiohttp_client, tmp_path, monkeypatch):
    # The login shell reads ~/.profile: on a host that is the developer's (pyenv init and
    # friends can take a minute), in the guest it is the image's. Give it an empty home.
    real_default_env = execution.default_env
    monkeypatch.setattr(execution, "default_env",
                        lambda shell: {**real_default_env(shell), "HOME": str(tmp_path)})
    return await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))


async def connect(client, **params) -> aiohttp.ClientWebSocketResponse:
    return await client.ws_connect("/pty", params={k: str(v) for k, v in params.items()})


async def read_until(ws, needle: bytes, timeout: float = 15) -> bytes:
    """Terminal output up to and including ``needle``."""
    buf = b""
    async with asyncio.timeout(timeout):
        while needle not in buf:
            msg = await ws.receive()
            assert msg.type is aiohttp.WSMsgType.BINARY, (msg, buf)
            buf += msg.data
    return buf


async def read_to_exit(client, ws, timeout: float = 15) -> tuple[bytes, dict]:
    """All output, then the exit message (which must be followed by close 1000); then
    the shell is no longer counted as running."""
    buf = b""
    async with asyncio.timeout(timeout):
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.TEXT:
                exit_msg = json.loads(msg.data)
                break
            assert msg.type is aiohttp.WSMsgType.BINARY, (msg, buf)
            buf += msg.data
        closing = await ws.receive()
    assert closing.type is aiohttp.WSMsgType.CLOSE and ws.close_code == 1000, closing
    async with asyncio.timeout(timeout):
        while await running(client):
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)  # the handler returns (aiohttp 3.8's tests would see it pending)
    return buf, exit_msg


async def running(client) -> int:
    return Health.from_dict(await (await client.get("/health")).json()).running


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_echo_through_the_terminal_and_exit(client):
    ws = await connect(client)
    assert await running(client) == 1  # an open terminal keeps the sandbox awake
    await ws.send_bytes(b"echo $((6 * 7)); tty\r")  # the echo of the input shows no 42
    out = await read_until(ws, b"/dev/pts/")
    assert b"42\r\n/dev/pts/" in out
    await ws.send_bytes(b"exit 7\r")
    _, exit_msg = await read_to_exit(client, ws)
    assert exit_msg == {"type": "exit", "exit_code": 7}


async def test_resize_changes_stty_size(client):
    ws = await connect(client, cols=100, rows=30)
    await ws.send_bytes(b"stty size\r")
    await read_until(ws, b"30 100\r\n")
    await ws.send_str(json.dumps({"type": "resize", "cols": 132, "rows": 43}))
    await ws.send_str("not json")  # ignored, as is any other malformed control message
    await ws.send_str(json.dumps({"type": "resize", "cols": 0, "rows": 43}))
    await ws.send_bytes(b"stty size\r")
    await read_until(ws, b"43 132\r\n")
    await ws.close()


async def test_ctrl_c_interrupts_the_foreground_job(client):
    ws = await connect(client)
    # The job says it runs (from the process that becomes the sleep) before ^C is sent: a
    # fixed delay let a loaded machine send ^C before the job existed (lost, 30 s sleep).
    await ws.send_bytes(b"sh -c 'echo job=$((20 + 1)); exec sleep 30'\r")
    await read_until(ws, b"job=21")
    await ws.send_bytes(b"\x03")  # the terminal is the shell's controlling tty: SIGINT
    await ws.send_bytes(b"echo after=$((40 + 2))\r")
    await read_until(ws, b"after=42", timeout=5)
    await ws.close()


async def test_command_output_all_arrives_before_the_exit_message(client):
    ws = await connect(client, cmd="head -c 300000 /dev/zero | tr '\\0' x; exit 5")
    out, exit_msg = await read_to_exit(client, ws)
    assert out.count(b"x") == 300000
    assert exit_msg == {"type": "exit", "exit_code": 5}


async def test_a_killed_shell_reports_minus_the_signal(client):
    ws = await connect(client, cmd="kill -TERM $$")
    _, exit_msg = await read_to_exit(client, ws)
    assert exit_msg == {"type": "exit", "exit_code": -15}


async def test_client_close_kills_the_shell_and_its_group(client):
    ws = await connect(client, cmd="sleep 300 & echo pids=$$,$!; wait")
    out = await read_until(ws, b"\r\n")
    shell, child = (int(p) for p in out.split(b"pids=")[1].split(b"\r")[0].split(b","))
    assert alive(shell) and alive(child)
    await ws.close()
    async with asyncio.timeout(10):
        while alive(shell) or alive(child):
            await asyncio.sleep(0.05)
    assert await running(client) == 0


async def test_a_shell_ignoring_sighup_is_killed(client, monkeypatch):
    from guest import terminal

    monkeypatch.setattr(terminal, "HANGUP_GRACE", 0.2)
    ws = await connect(client, cmd="trap '' HUP; echo pid=$$; while :; do sleep 0.05; done")
    out = await read_until(ws, b"\r\n")
    shell = int(out.split(b"pid=")[1].split(b"\r")[0])
    await ws.close()
    async with asyncio.timeout(10):
        while alive(shell):
            await asyncio.sleep(0.05)


async def test_slow_reader_gets_everything_in_order(client):
    # The agent only reads the terminal as fast as the client takes output.
    ws = await connect(client, cmd="seq 1 20000; exit 0")
    await asyncio.sleep(1.0)  # let the kernel buffers fill; the shell blocks, nothing is lost
    out, exit_msg = await read_to_exit(client, ws)
    lines = out.decode().split("\r\n")
    assert lines[:3] == ["1", "2", "3"] and "20000" in lines and exit_msg["exit_code"] == 0


async def test_plain_get_and_bad_sizes_are_json_errors(client):
    resp = await client.get("/pty")
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "bad_request"
    for params in ({"cols": "abc"}, {"rows": "0"}, {"cols": "100000"}):
        resp = await client.get("/pty", params=params, headers={
            "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert resp.status == 400, params
        assert (await resp.json())["error"]["code"] == "bad_request"
    assert await running(client) == 0


async def test_cwd_and_term(client):
    ws = await connect(client, cmd='echo "[$PWD|$TERM]"')
    out, _ = await read_to_exit(client, ws)
    cwd = "/root" if os.path.isdir("/root") else os.environ.get("HOME", "/")
    assert f"[{cwd}|xterm-256color]".encode() in out


async def test_agent_shutdown_ends_open_terminals(client):
    ws = await connect(client, cmd="echo pid=$$; sleep 300")
    out = await read_until(ws, b"\r\n")
    shell = int(out.split(b"pid=")[1].split(b"\r")[0])

    async def drain() -> list:
        return [msg async for msg in ws]  # until the close

    reading = asyncio.create_task(drain())
    async with asyncio.timeout(10):
        await client.server.close()  # the agent stops: its terminals' shells are killed
        msgs = await reading
    assert not alive(shell)
    assert msgs and json.loads(msgs[-1].data) == {"type": "exit", "exit_code": -9}
