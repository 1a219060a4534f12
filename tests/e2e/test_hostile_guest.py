"""A hostile guest against the real daemon (issue 10): code running as root in a real
microVM sends what a well-behaved guest never would, and the daemon stays bounded.

- a guest web app starts a 256 MiB WebSocket frame through the preview proxy: the client
  sees close 1009, the daemon's RSS barely moves, the app could not push the frame through;
- the guest kills its agent and answers the agent port itself, with an endless JSON body
  (``GET /commands``) and endless headers (``/exec``): the API answers typed errors within
  the bounds, the daemon's RSS barely moves, and another sandbox keeps answering.

RSS is sampled from ``/proc/<daemon pid>/status`` every 20 ms while the attack runs; the
bound (64 MiB) is far below what buffering the attack would cost, so each test fails on a
daemon without the limits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from guest.protocol import AGENT_PORT
from tests.e2e.test_preview import host_for, preview_token, start_app, start_background, \
    wait_listening

pytestmark = pytest.mark.e2e

RSS_BOUND = 64 << 20
WS_LIMIT = 16 << 20  # the daemon's default server.max_ws_message_bytes
FRAME = 256 << 20

HOSTILE_WS_APP = r'''
import base64, hashlib, os, socket, struct, sys, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
FRAME = int(sys.argv[2])

def serve(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(4096)
        if not data:
            return
        head += data
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
           if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    conn.sendall(b"\x82\x7f" + struct.pack("!Q", FRAME))
    sent, chunk = 0, b"\0" * 65536
    try:
        while sent < FRAME:
            conn.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    with open("/root/ws_sent.tmp", "w") as f:
        f.write(str(sent))
    os.rename("/root/ws_sent.tmp", "/root/ws_sent")  # whole, or not there yet
    conn.close()

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(16)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''

# Kills the real agent and takes its port: GET /commands gets an endless JSON body, /exec
# endless headers, anything else a plain 200 (so the daemon's probes see a live "agent").
FAKE_AGENT = r'''
import os, signal, socket, sys, threading, time
PORT = int(sys.argv[1])
if os.fork():
    sys.exit(0)
os.setsid()  # out of the agent's process group and session: it survives the agent
time.sleep(1)  # let the agent answer the request that started us
for pid in os.listdir("/proc"):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if b"guest.agent" in cmd and int(pid) != os.getpid():
        os.kill(int(pid), signal.SIGKILL)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
for _ in range(500):
    try:
        srv.bind(("0.0.0.0", PORT))
        break
    except OSError:
        time.sleep(0.01)
srv.listen(64)

def serve(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(4096)
        if not data:
            return
        head += data
    line = head.split(b"\r\n", 1)[0]
    try:
        if b" /commands " in line:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"[" + b"1," * 32767
            framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
            while True:
                conn.sendall(framed)
        elif b" /exec " in line:
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            i = 0
            while True:
                conn.sendall(b"X-Filler-%d: %s\r\n" % (i, b"a" * 200))
                i += 1
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
    except OSError:
        pass
    conn.close()

while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''


class RSSWatch:
    """Samples a process's VmRSS in a thread; ``growth`` is the peak over the start."""

    def __init__(self, pid: int) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)

    def _rss(self) -> int:
        for line in self.path.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RSSWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def put_file(api: httpx.Client, sid: str, path: str, text: str) -> None:
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=text.encode())
    assert r.status_code == 201, r.text


def read_file(api: httpx.Client, sid: str, path: str, timeout: float = 30) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = api.get(f"/v1/sandboxes/{sid}/files{path}")
        if r.status_code == 200:
            return r.text
        time.sleep(0.3)
    return None


async def ws_until_closed(url: str, headers: dict[str, str], send: bytes | None = None,
                          timeout: float = 120) -> aiohttp.WSMessage | None:
    """Connect (retrying while the app is not up yet), optionally send, return the first
    message that is not data."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                ws = await session.ws_connect(url, headers=headers, max_msg_size=0)
                break
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status != 502 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
        async with ws:
            try:
                if send is not None:
                    await ws.send_bytes(send)
                while True:
                    msg = await asyncio.wait_for(ws.receive(), deadline - time.monotonic())
                    if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                        return msg
            except (ConnectionError, aiohttp.ClientError):
                # The daemon sends its 1009 close and drops the socket at once: a sender
                # still writing its frame can get the reset before it reads the close.
                return None


def test_oversize_ws_frame_from_a_guest_app_is_refused_with_rss_bounded(daemon, api, sandbox):
    sid = sandbox["id"]
    token = preview_token(api, sid)
    put_file(api, sid, "/root/hostile_ws.py", HOSTILE_WS_APP)
    start_background(api, sid, f"python3 /root/hostile_ws.py 8001 {FRAME}")
    headers = {"Host": host_for(sid, 8001), "X-AgentBox-Token": token}
    with RSSWatch(daemon.proc.pid) as rss:
        msg = asyncio.run(ws_until_closed(daemon.url + "/", headers))
    assert msg is not None and msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009, msg
    sent = read_file(api, sid, "/root/ws_sent")
    assert sent is not None and int(sent) < FRAME // 2, sent  # dropped, not drained
    assert rss.growth < RSS_BOUND, f"daemon RSS grew {rss.growth >> 20} MiB"


def test_oversize_ws_frame_from_the_client_is_refused(daemon, api, sandbox, web):
    sid = sandbox["id"]
    token = preview_token(api, sid)
    start_app(api, sid)  # tests/e2e/preview_app.py: /ws echoes
    assert wait_listening(web, sid, 8000, token, "/count").status_code == 200
    headers = {"Host": host_for(sid, 8000), "X-AgentBox-Token": token}
    with RSSWatch(daemon.proc.pid) as rss:
        msg = asyncio.run(ws_until_closed(daemon.url + "/ws", headers,
                                          send=b"x" * (WS_LIMIT + 1)))
    # Refused: a close with 1009 (never the echo), or the reset that follows it.
    assert msg is None or (msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1009), msg
    assert rss.growth < RSS_BOUND, f"daemon RSS grew {rss.growth >> 20} MiB"
    for _ in range(50):  # the app was closed too, and told why
        r = web.get("/closes", headers={"Host": host_for(sid, 8000), "X-AgentBox-Token": token})
        if r.status_code == 200 and r.json()["closes"]:
            break
        time.sleep(0.2)
    assert r.json()["closes"] == [1009], r.text


def test_fake_agent_with_endless_replies_is_bounded_and_others_keep_answering(
        daemon, api, sandbox):
    sid = sandbox["id"]
    r = api.post("/v1/sandboxes", json={"template": "python"})
    assert r.status_code == 201, r.text
    other = r.json()["id"]
    try:
        put_file(api, sid, "/root/fake_agent.py", FAKE_AGENT)
        start_background(api, sid, f"python3 /root/fake_agent.py {AGENT_PORT}")
        time.sleep(4)  # the real agent is gone; the fake one answers from now on
        with RSSWatch(daemon.proc.pid) as rss:
            started = time.monotonic()
            r = api.get(f"/v1/sandboxes/{sid}/commands")  # an endless JSON body
            body_s = time.monotonic() - started
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "agent_reply_too_large"
            assert len(r.text) < 2000  # nothing of the guest's flood in the answer
            started = time.monotonic()
            r = api.post(f"/v1/sandboxes/{sid}/execute", json={"command": "true"})
            headers_s = time.monotonic() - started
            assert r.status_code == 502, r.text  # endless headers
            assert r.json()["error"]["code"] == "agent_protocol_error"
            r = api.post(f"/v1/sandboxes/{other}/execute", json={"command": "echo still-here"})
            assert r.status_code == 200 and r.json()["stdout"] == "still-here\n", r.text
        assert body_s < 60 and headers_s < 60, (body_s, headers_s)
        assert rss.growth < RSS_BOUND, f"daemon RSS grew {rss.growth >> 20} MiB"
    finally:
        api.delete(f"/v1/sandboxes/{other}")


@pytest.fixture
def web(daemon):
    with httpx.Client(base_url=daemon.url, timeout=120) as client:
        yield client
