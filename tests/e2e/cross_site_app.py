"""A guest app for tests/e2e/test_cross_tenant.py, run *inside* a guest (aiohttp from Debian).
In the victim's sandbox it is the target: it records every request and WebSocket that
reaches it. In the attacker's sandbox it serves the hostile page, which tries to use the
victim's preview cookie from another preview host, and reports what the page saw.

usage: python3 cross_site_app.py PORT
"""

import asyncio
import json
import sys

from aiohttp import web

SEEN = {"hits": [], "websockets": [], "result": None}
DONE = asyncio.Event()

# {victim}: "http://8000-<id>.preview.example.com:PORT". Each probe reports once.
PAGE = """<!doctype html><html><body><p id="out">waiting</p><img src="/wait" alt="">
<script>
const victim = %(victim)s, results = {};
function report(key, value) {
  if (key in results) return;
  results[key] = value;
  document.getElementById("out").textContent = JSON.stringify(results);
  if (Object.keys(results).length === 4)
    fetch("/done?r=" + encodeURIComponent(JSON.stringify(results)));
}
// Same-site GET with the victim's cookie: allowed, and proves the cookie is sent at all.
fetch(victim + "/hit?via=get", {mode: "no-cors", credentials: "include"})
  .then(() => report("get", "sent"), () => report("get", "failed"));
// Same-site POST with the victim's cookie (a "simple" request: no preflight).
fetch(victim + "/hit?via=post", {method: "POST", mode: "no-cors", credentials: "include",
                                 body: "x"})
  .then(() => report("post", "sent"), () => report("post", "failed"));
const ws = new WebSocket(victim.replace("http:", "ws:") + "/ws");
ws.onopen = () => { ws.send("stolen"); report("ws", "open"); };
ws.onerror = () => report("ws", "refused");
ws.onclose = () => report("ws", "refused");
// Control: the page can open a WebSocket to its own host.
const own = new WebSocket("ws://" + location.host + "/ws");
own.onopen = () => report("own_ws", "open");
own.onerror = () => report("own_ws", "failed");
setTimeout(() => { for (const k of ["get", "post", "ws", "own_ws"]) report(k, "timeout"); },
           20000);
</script></body></html>"""


async def hit(request):
    SEEN["hits"].append({"method": request.method, "via": request.query.get("via"),
                         "origin": request.headers.get("Origin")})
    return web.Response(text="hit")


async def ws(request):
    SEEN["websockets"].append({"origin": request.headers.get("Origin")})
    sock = web.WebSocketResponse()
    await sock.prepare(request)
    async for msg in sock:
        SEEN["websockets"][-1].setdefault("messages", []).append(msg.data)
    return sock


async def attack(request):
    victim = json.dumps(request.query["victim"])
    return web.Response(text=PAGE % {"victim": victim}, content_type="text/html")


async def hop(request):
    # Sends the browser on to the next page once it holds this host's cookie.
    raise web.HTTPFound(request.query["next"])


async def done(request):
    SEEN["result"] = json.loads(request.query["r"])
    DONE.set()
    return web.Response(text="ok")


async def wait(request):
    # Holds the page's load event until the page reported (so --dump-dom sees the result).
    try:
        await asyncio.wait_for(DONE.wait(), 25)
    except TimeoutError:
        pass
    return web.Response(body=b"GIF89a", content_type="image/gif")


async def seen(request):
    return web.json_response(SEEN)


app = web.Application()
app.router.add_route("*", "/hit", hit)
app.router.add_get("/ws", ws)
app.router.add_get("/attack", attack)
app.router.add_get("/hop", hop)
app.router.add_get("/done", done)
app.router.add_get("/wait", wait)
app.router.add_get("/seen", seen)

if __name__ == "__main__":
    web.run_app(app, host="0.0.0.0", port=int(sys.argv[1]), print=None)
