"""The guest agent: answers the host over the endpoints in ``guest/protocol.py``.

Run inside every microVM by init as ``python3 -m guest.agent`` (cwd
/opt/agentbox). It is on the cold-boot path under slow emulation, so it imports
only the stdlib and aiohttp (Debian bookworm's 3.8; the host tests use a newer
one, so nothing here is newer than 3.8).

Errors become ``protocol.error_body`` JSON in one place, :func:`errors_to_json`.
"""

from __future__ import annotations

import time

_STARTED = time.monotonic()  # before the heavy imports: the start-up figure includes them

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

from aiohttp import web  # noqa: E402

from guest import files, restore  # noqa: E402
from guest.errors import AgentError, BadJson, ClientGone, InvalidPath, ResponseStarted  # noqa: E402
from guest.execution import ExecOwner, Executor  # noqa: E402
from guest.keepawake import count_vetoes, ensure_dir, veto_dir  # noqa: E402
from guest.protocol import (  # noqa: E402
    AGENT_PORT,
    PROTOCOL_VERSION,
    DirListing,
    ExecRequest,
    Health,
    InitRequest,
    ProtocolError,
    error_body,
    validate_path,
)

log = logging.getLogger("agentbox.guest")
T = TypeVar("T")
DISCONNECT_POLL = 0.25  # seconds between checks that an exec's client is still there
MAX_JSON_BYTES = 16 * 1024 * 1024  # /exec bodies carry code; /files bodies are streamed
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


class Agent:
    """The endpoints' handlers and what they share: the exec owner, base env, veto dir."""

    def __init__(
        self, keepawake_dir: str, setters: restore.SystemSetters, shell: str | None = None
    ) -> None:
        self.owner = ExecOwner()
        self.executor = Executor(self.owner, shell)
        self.keepawake_dir = keepawake_dir
        self.setters = setters

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        try:
            ensure_dir(self.keepawake_dir)
        except OSError as exc:
            log.warning("cannot create %s: %s", self.keepawake_dir, exc)
        yield
        await self.owner.aclose()

    async def on_shutdown(self, app: web.Application) -> None:
        # Before aiohttp waits for in-flight handlers: a running exec ends now, as killed.
        self.owner.kill_all()

    async def health(self, request: web.Request) -> web.Response:
        veto = count_vetoes(self.keepawake_dir)
        return _json(Health("ok", PROTOCOL_VERSION, running=self.owner.running, veto=veto))

    async def exec(self, request: web.Request) -> web.Response:
        req = ExecRequest.from_dict(await _read_json(request))
        result = await _unless_disconnected(request, self.executor.run(req))
        return _json(result)

    async def init(self, request: web.Request) -> web.Response:
        req = InitRequest.from_dict(await _read_json(request))
        restore.apply(req, self.setters, self.executor.env)
        return web.Response(status=204)

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        path = _query_path(request)
        target = await asyncio.to_thread(files.open_for_read, path)
        if isinstance(target, DirListing):
            return _json(target)
        f, size = target
        with f:
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = size
            await resp.prepare(request)
            try:
                async for chunk in files.read_chunks(f, size):
                    await resp.write(chunk)
            except ConnectionError:
                return resp  # the client left; there is nobody to tell
            except Exception as exc:
                raise ResponseStarted(f"GET {path}: {exc}") from exc
            await resp.write_eof()
        return resp

    async def put_file(self, request: web.Request) -> web.Response:
        path = _query_path(request)
        return _json(await files.write_atomic(path, _body(request, path)))

    async def stat_file(self, request: web.Request) -> web.Response:
        return _json(files.stat_path(_query_path(request)))

    async def delete_file(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(files.delete, _query_path(request))
        return web.Response(status=204)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj.to_dict() if hasattr(obj, "to_dict") else obj, status=status)


async def _read_json(request: web.Request) -> object:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise BadJson(f"request body is not valid JSON: {exc}") from exc


async def _body(request: web.Request, path: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.content.iter_chunked(files.CHUNK):
            yield chunk
    except Exception as exc:  # reading a request body fails only when the client left
        raise ClientGone(f"upload of {path} cut short: {exc}") from exc


def _query_path(request: web.Request) -> str:
    try:
        return validate_path(request.query.get("path"))
    except ProtocolError as exc:
        raise InvalidPath(str(exc)) from exc


async def _unless_disconnected(request: web.Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client goes away.

    aiohttp 3.8 cancels the handler when the client disconnects; newer ones let
    it run on, so we also watch the transport. Cancelling an exec kills its group.
    """
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL)
            transport = request.transport
            if not task.done() and (transport is None or transport.is_closing()):
                raise ClientGone("client closed the connection")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


@web.middleware
async def errors_to_json(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The one place errors become responses (never once a response has started)."""
    try:
        return await handler(request)
    except ResponseStarted:
        raise  # aiohttp drops the connection: the client sees a short body, not a lie
    except AgentError as exc:
        if exc.status >= 500:
            log.warning("%s %s: %s", request.method, request.path, exc)
        return _json(error_body(exc.code, str(exc)), exc.status)
    except ProtocolError as exc:
        return _json(error_body("bad_request", str(exc)), 400)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, "http_error")
        return _json(error_body(code, exc.reason), exc.status)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _json(error_body("internal", f"{type(exc).__name__}: {exc}"), 500)


def create_app(
    *,
    keepawake_dir: str | None = None,
    setters: restore.SystemSetters | None = None,
    shell: str | None = None,
) -> web.Application:
    """The agent's aiohttp app; tests inject ``setters`` so the host clock is never touched."""
    agent = Agent(keepawake_dir or veto_dir(), setters or restore.SystemSetters(), shell)
    app = web.Application(middlewares=[errors_to_json], client_max_size=MAX_JSON_BYTES)
    app.cleanup_ctx.append(agent.lifespan)
    app.on_shutdown.append(agent.on_shutdown)
    router = app.router
    router.add_get("/health", agent.health, allow_head=False)
    router.add_post("/exec", agent.exec)
    router.add_post("/init", agent.init)
    router.add_get("/files", agent.get_file, allow_head=False)
    router.add_put("/files", agent.put_file)
    router.add_delete("/files", agent.delete_file)
    router.add_get("/files/stat", agent.stat_file, allow_head=False)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="python3 -m guest.agent", description=__doc__)
    p.add_argument("--host", default=env.get("AGENTBOX_AGENT_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(env.get("AGENTBOX_AGENT_PORT", AGENT_PORT)))
    p.add_argument("--keepawake-dir", default=veto_dir())
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(create_app(keepawake_dir=args.keepawake_dir), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        ms = (time.monotonic() - _STARTED) * 1000
        log.info("listening on %s:%d (%.0f ms after start)", args.host, args.port, ms)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="agentbox-agent: %(levelname)s %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
