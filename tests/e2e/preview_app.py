"""A small app the e2e preview/session tests run *inside* a guest (aiohttp from Debian).

usage: python3 preview_app.py HOST PORT
"""

import asyncio
import hashlib
import os
import sys

from aiohttp import WSMsgType, web

STATE = {"count": 0, "boot": os.urandom(8).hex(), "closes": []}
ECHOED = asyncio.Event()

PAGE = """<!doctype html><html><body><p id="out">waiting</p><img src="/wait" alt="">
<script>
const ws = new WebSocket("ws://" + location.host + "/ws", ["echo.v1"]);
ws.onopen = () => ws.send("hello from the browser");
ws.onmessage = (e) => { document.getElementById("out").textContent = "echoed: " + e.data; };
ws.onerror = () => { document.getElementById("out").textContent = "websocket error"; };
</script></body></html>"""


async def count(request):
    STATE["count"] += 1
    return web.json_response({"count": STATE["count"], "boot": STATE["boot"],
                              "pid": os.getpid()})


async def echo(request):
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await resp.prepare(request)
    async for chunk in request.content.iter_any():
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def sha(request):
    digest, size = hashlib.sha256(), 0
    async for chunk in request.content.iter_any():
        digest.update(chunk)
        size += len(chunk)
    return web.json_response({"sha256": digest.hexdigest(), "size": size})


async def chunks(request):
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(10):
        await resp.write(b"chunk %d\n" % i)
        await asyncio.sleep(0.01)
    await resp.write_eof()
    return resp


async def headers(request):
    return web.json_response(dict(request.headers))


async def ws(request):
    sock = web.WebSocketResponse(protocols=("echo.v1",), max_msg_size=0)
    await sock.prepare(request)
    while True:
        msg = await sock.receive()
        if msg.type == WSMsgType.TEXT and msg.data.startswith("close:"):
            await sock.close(code=int(msg.data[6:]), message=b"as asked")
            return sock
        if msg.type == WSMsgType.TEXT:
            await sock.send_str(msg.data)
            ECHOED.set()
        elif msg.type == WSMsgType.BINARY:
            await sock.send_bytes(msg.data)
        elif msg.type == WSMsgType.CLOSE:
            STATE["closes"].append(msg.data)
            return sock
        else:
            return sock


async def closes(request):
    return web.json_response({"closes": STATE["closes"]})


async def page(request):
    return web.Response(text=PAGE, content_type="text/html")


async def wait(request):
    # Holds the page's load event until the WebSocket echoed (so --dump-dom sees the result).
    try:
        await asyncio.wait_for(ECHOED.wait(), 20)
        await asyncio.sleep(0.5)
    except TimeoutError:
        pass
    return web.Response(body=b"GIF89a", content_type="image/gif")


app = web.Application()
app.router.add_get("/count", count)
app.router.add_post("/echo", echo)
app.router.add_post("/sha", sha)
app.router.add_get("/chunks", chunks)
app.router.add_get("/headers", headers)
app.router.add_get("/ws", ws)
app.router.add_get("/closes", closes)
app.router.add_get("/page", page)
app.router.add_get("/wait", wait)

if __name__ == "__main__":
    web.run_app(app, host=sys.argv[1], port=int(sys.argv[2]), print=None)
