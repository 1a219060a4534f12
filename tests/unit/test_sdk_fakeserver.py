"""A scripted fake AgentBox server for the SDK's unit tests (and tests of the fake itself).

It runs an aiohttp app on its own event loop in a thread, so the blocking sync
SDK and the async SDK can both talk to it from a test. Each test scripts the
answers (``srv.on(method, path_regex, handler)``) and inspects ``srv.requests``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KEY = "test-key"


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    raw_path: str = ""

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def sandbox_json(sid: str = "sb1", state: str = "running", **extra: Any) -> dict[str, Any]:
    return {"id": sid, "state": state, "template": "python", "metadata": {}, "idle_timeout": 0,
            "created_at": 1.0, "updated_at": 1.0, "last_activity": 1.0, "suspend_count": 0,
            "restore_count": 0, "last_suspend_ms": None, "last_restore_ms": None,
            "failure": None, **extra}


def reply(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(data, status=status, headers=headers)
    return handler


def error(status: int, code: str, message: str = "boom",
          headers: dict[str, str] | None = None) -> Handler:
    return reply({"error": {"code": code, "message": message}}, status, headers)


def empty(status: int = 204) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status)
    return handler


def raw(body: bytes, content_type: str = "application/octet-stream",
        status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, status=status, content_type=content_type)
    return handler


def ndjson(events: list[dict[str, Any]], delay: float = 0.0) -> Handler:
    """Stream ``events`` one line each (a stream 'cut short' is one without its last line)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for event in events:
            await resp.write(json.dumps(event).encode() + b"\n")
            if delay:
                await asyncio.sleep(delay)
        await resp.write_eof()
        return resp
    return handler


def sequence(*handlers: Handler) -> Handler:
    """Answer successive requests with successive handlers (the last one repeats)."""
    queue = list(handlers)

    async def handler(request: web.Request) -> web.StreamResponse:
        h = queue.pop(0) if len(queue) > 1 else queue[0]
        return await h(request)
    return handler


@dataclass
class FakeServer:
    requests: list[Seen] = field(default_factory=list)
    _routes: list[tuple[str, re.Pattern[str], Handler]] = field(default_factory=list)

    def on(self, method: str, path: str, handler: Handler) -> FakeServer:
        """Answer ``method`` on paths fully matching the regex ``path`` (latest wins)."""
        self._routes.insert(0, (method, re.compile(path), handler))
        return self

    def seen(self, method: str | None = None, path: str | None = None) -> list[Seen]:
        return [r for r in self.requests if (method is None or r.method == method)
                and (path is None or re.fullmatch(path, r.path))]

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(Seen(request.method, request.path, dict(request.query),
                                  dict(request.headers), body, request.raw_path))
        for method, pattern, handler in self._routes:
            if method == request.method and pattern.fullmatch(request.path):
                return await handler(request)
        return web.json_response({"error": {"code": "not_found", "message": "Not Found"}},
                                 status=404)

    def start(self) -> FakeServer:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def boot() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._dispatch)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(boot())
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="fake-agentbox", daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake server did not start"
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- tests of the fake itself --------------------------------------------------------------------

def test_fake_server_records_and_dispatches():
    with FakeServer() as srv:
        srv.on("GET", r"/a/\w+", reply({"ok": 1}))
        srv.on("POST", "/b", sequence(error(409, "conflict"), empty()))
        with httpx.Client(base_url=srv.url) as c:
            assert c.get("/a/x").json() == {"ok": 1}
            assert c.post("/b", content=b"1").status_code == 409
            assert c.post("/b").status_code == 204
            assert c.post("/b").status_code == 204
            assert c.get("/nothing").json()["error"]["message"] == "Not Found"
        assert [r.path for r in srv.seen("POST")] == ["/b"] * 3
        assert srv.seen("POST")[0].body == b"1"


def test_fake_ndjson_streams_lines():
    with FakeServer() as srv:
        srv.on("GET", "/s", ndjson([{"type": "a"}, {"type": "b"}]))
        with httpx.Client(base_url=srv.url) as c, c.stream("GET", "/s") as r:
            assert [json.loads(x)["type"] for x in r.iter_lines() if x] == ["a", "b"]
