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
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

from aiohttp import web  # noqa: E402

from guest import files, ports, restore, terminal  # noqa: E402
from guest.errors import AgentError, BadJson, ClientGone, InvalidPath, ResponseStarted  # noqa: E402
from guest.execution import ExecOwner, Executor  # noqa: E402
from guest.interpreter import ExecutionCollector, Interpreter  # noqa: E402
from guest.keepawake import count_vetoes, ensure_dir, veto_dir  # noqa: E402
from guest.processes import ManagedProcess, ProcessTable  # noqa: E402
from guest.zygote import ZygoteManager  # noqa: E402
from guest.protocol import (  # noqa: E402
    query_number,
    AGENT_PORT,
    PROTOCOL_VERSION,
    CommandRequest,
    CreateContextRequest,
    DirListing,
    ExecRequest,
    Health,
    InitRequest,
    ProtocolError,
    RunCodeRequest,
    SignalRequest,
    error_body,
    validate_context_name,
    validate_path,
)

log = logging.getLogger("agentbox.guest")
T = TypeVar("T")
DISCONNECT_POLL = 0.25  # seconds between checks that an exec's client is still there
MAX_JSON_BYTES = 16 * 1024 * 1024  # /exec bodies carry code; /files bodies are streamed
MAX_WAIT = 3600.0  # seconds one GET /commands/{pid}/wait may block
# What the zygote imports: written by the image build from the template's ``preload``.
PRELOAD_FILE = "/opt/agentbox/zygote-preload"
NDJSON = "application/x-ndjson"
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


class Agent:
    """The endpoints' handlers and what they share: the exec owner, base env, veto dir."""

    def __init__(
        self,
        keepawake_dir: str,
        setters: restore.SystemSetters,
        shell: str | None = None,
        python: str | None = None,
        zygote_preload: tuple[str, ...] | None = (),
    ) -> None:
        self.owner = ExecOwner()
        self.executor = Executor(self.owner, shell)
        if zygote_preload is not None:  # None: Python execs always start a plain python3
            self.executor.zygote = ZygoteManager(self.executor.env, zygote_preload)
        self.interpreter = Interpreter(self.executor.env, python)
        self.processes = ProcessTable(self.executor.env, self.executor.shell)
        self.keepawake_dir = keepawake_dir
        self.setters = setters

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        try:
            ensure_dir(self.keepawake_dir)
        except OSError as exc:
            log.warning("cannot create %s: %s", self.keepawake_dir, exc)
        if self.executor.zygote is not None:
            self.executor.zygote.start_soon()  # warm before the golden snapshot is taken
        yield
        await self.owner.aclose()
        if self.executor.zygote is not None:
            await self.executor.zygote.aclose()
        await self.processes.aclose()
        await self.interpreter.aclose()

    async def on_shutdown(self, app: web.Application) -> None:
        # Before aiohttp waits for in-flight handlers: a running exec ends now, as killed.
        self.owner.kill_all()
        self.processes.kill_all()
        self.interpreter.kill_all()

    async def health(self, request: web.Request) -> web.Response:
        veto = count_vetoes(self.keepawake_dir)
        running = self.owner.running + self.processes.running + self.interpreter.running
        return _json(Health("ok", PROTOCOL_VERSION, running=running, veto=veto))

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

    # -- code interpreter (guest/interpreter.py) ------------------------------------

    async def create_context(self, request: web.Request) -> web.Response:
        req = CreateContextRequest.from_dict(await _read_json(request, empty={}))
        return _json(await self.interpreter.create(req), 201)

    async def list_contexts(self, request: web.Request) -> web.Response:
        return _json({"contexts": [c.to_dict() for c in self.interpreter.list()]})

    async def delete_context(self, request: web.Request) -> web.Response:
        await self.interpreter.delete(validate_context_name(request.match_info["name"]))
        return web.Response(status=204)

    async def run_code(self, request: web.Request) -> web.StreamResponse:
        req = RunCodeRequest.from_dict(await _read_json(request))
        if req.stream:
            stream = NdjsonStream(request)
            return await stream.run(self.interpreter.run(req, stream.emit))
        collector = ExecutionCollector()
        await _unless_disconnected(request, self.interpreter.run(req, collector.emit))
        return _json(collector.result())

    # -- commands (guest/processes.py) ----------------------------------------------

    async def start_command(self, request: web.Request) -> web.StreamResponse:
        req = CommandRequest.from_dict(await _read_json(request))
        mp = await self.processes.start(req)
        if req.background:
            return _json(mp.info(), 201)
        stream = NdjsonStream(request)
        try:
            return await stream.run(self._foreground(mp, stream))
        finally:
            self.processes.kill(mp.pid)  # a foreground command ends with its client

    async def _foreground(self, mp: ManagedProcess, stream: NdjsonStream) -> None:
        await stream.emit({"type": "start", "pid": mp.pid})
        async for event in mp.events(0, follow=True):
            await stream.emit(event)

    async def list_commands(self, request: web.Request) -> web.Response:
        return _json({"commands": [p.to_dict() for p in self.processes.list()]})

    async def get_command(self, request: web.Request) -> web.Response:
        return _json(self.processes.get(_pid(request)).info())

    async def command_stdin(self, request: web.Request) -> web.Response:
        pid = _pid(request)
        eof = _flag(request, "eof")
        await self.processes.write_stdin(pid, _body(request, f"stdin of {pid}"), eof)
        return web.Response(status=204)

    async def signal_command(self, request: web.Request) -> web.Response:
        req = SignalRequest.from_dict(await _read_json(request, empty={}))
        self.processes.signal(_pid(request), req)
        return web.Response(status=204)

    async def wait_command(self, request: web.Request) -> web.Response:
        pid = _pid(request)
        timeout = query_number(request.query, "timeout", 30.0, MAX_WAIT)
        return _json(await _unless_disconnected(request, self.processes.wait(pid, timeout)))

    async def command_output(self, request: web.Request) -> web.StreamResponse:
        mp = self.processes.get(_pid(request))
        offset = int(query_number(request.query, "offset", 0, float(2**62)))
        stream = NdjsonStream(request)

        async def pump() -> None:
            async for event in mp.events(offset, follow=_flag(request, "follow")):
                await stream.emit(event)

        return await stream.run(pump())


class NdjsonStream:
    """A streamed answer of JSON lines, started by the first event.

    Errors before the first event are ordinary JSON errors; after it they can
    only cut the stream short (``ResponseStarted``). A client that leaves ends
    the work (``_unless_disconnected``), quietly."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": NDJSON})

    async def emit(self, event: dict[str, Any]) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(json.dumps(event).encode() + b"\n")

    async def run(self, work: Awaitable[None]) -> web.StreamResponse:
        try:
            await _unless_disconnected(self.request, work)
            if not self.response.prepared:
                await self.response.prepare(self.request)
            await self.response.write_eof()
        except (ConnectionError, ClientGone):
            if not self.response.prepared:
                raise
        except Exception as exc:
            if self.response.prepared:
                raise ResponseStarted(f"{self.request.path}: {exc}") from exc
            raise
        return self.response


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj.to_dict() if hasattr(obj, "to_dict") else obj, status=status)


async def _read_json(request: web.Request, empty: object = None) -> object:
    if empty is not None and not await request.read():
        return empty  # an empty body where every field has a default
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


def _pid(request: web.Request) -> int:
    return int(request.match_info["pid"])  # the route admits digits only


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true", "yes")


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


# Requests whose success is an acknowledgement of data: answered only after the
# guest's filesystems are flushed to the virtual disk (which QEMU then flushes),
# so an acknowledged write survives any later crash of the VM, the VMM or the
# daemon, and a cold boot of the disk. Streamed responses cannot wait for it.
_NOT_DURABLE = {"/init", "/sync", "/health"}


@web.middleware
async def durable_acks(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    resp = await handler(request)
    if request.method in ("POST", "PUT", "DELETE", "PATCH") and resp.status < 400 \
            and not resp.prepared and request.path not in _NOT_DURABLE:
        await asyncio.to_thread(os.sync)
    return resp


async def sync(request: web.Request) -> web.Response:
    """Flush every filesystem (the host asks before it snapshots the VM)."""
    await asyncio.to_thread(os.sync)
    return web.Response(status=204)


def create_app(
    *,
    keepawake_dir: str | None = None,
    setters: restore.SystemSetters | None = None,
    shell: str | None = None,
    python: str | None = None,
    zygote_preload: tuple[str, ...] | None = (),
) -> web.Application:
    """The agent's aiohttp app; tests inject ``setters`` so the host clock is never touched.

    ``python`` runs interpreter contexts (default: the agent's own interpreter).
    ``zygote_preload``: what the exec zygote imports (None: no zygote)."""
    agent = Agent(keepawake_dir or veto_dir(), setters or restore.SystemSetters(), shell, python,
                  zygote_preload)
    app = web.Application(middlewares=[errors_to_json, durable_acks],
                          client_max_size=MAX_JSON_BYTES)
    app.cleanup_ctx.append(agent.lifespan)
    app.on_shutdown.append(agent.on_shutdown)
    router = app.router
    router.add_get("/health", agent.health, allow_head=False)
    router.add_post("/exec", agent.exec)
    router.add_post("/init", agent.init)
    router.add_post("/sync", sync)
    router.add_get("/files", agent.get_file, allow_head=False)
    router.add_put("/files", agent.put_file)
    router.add_delete("/files", agent.delete_file)
    router.add_get("/files/stat", agent.stat_file, allow_head=False)
    router.add_post("/contexts", agent.create_context)
    router.add_get("/contexts", agent.list_contexts, allow_head=False)
    router.add_delete("/contexts/{name}", agent.delete_context)
    router.add_post("/run_code", agent.run_code)
    router.add_post("/commands", agent.start_command)
    router.add_get("/commands", agent.list_commands, allow_head=False)
    router.add_get(r"/commands/{pid:\d+}", agent.get_command, allow_head=False)
    router.add_post(r"/commands/{pid:\d+}/stdin", agent.command_stdin)
    router.add_post(r"/commands/{pid:\d+}/signal", agent.signal_command)
    router.add_get(r"/commands/{pid:\d+}/wait", agent.wait_command, allow_head=False)
    router.add_get(r"/commands/{pid:\d+}/output", agent.command_output, allow_head=False)
    terminal.add_routes(app, agent.executor, agent.owner)  # GET /pty (counted by the owner)
    ports.add_routes(app)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="python3 -m guest.agent", description=__doc__)
    p.add_argument("--host", default=env.get("AGENTBOX_AGENT_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(env.get("AGENTBOX_AGENT_PORT", AGENT_PORT)))
    p.add_argument("--keepawake-dir", default=veto_dir())
    p.add_argument("--zygote-preload", default=env.get("AGENTBOX_ZYGOTE_PRELOAD"),
                   help=f"modules the exec zygote imports, comma-separated; 'off' for no "
                        f"zygote (default: {PRELOAD_FILE}, one a line)")
    return p.parse_args(argv)


def zygote_preload(value: str | None, path: str = PRELOAD_FILE) -> tuple[str, ...] | None:
    """The zygote's modules from ``--zygote-preload`` or the file the image build wrote."""
    if value is None:
        try:
            with open(path, encoding="utf-8") as f:
                value = ",".join(f.read().split())
        except OSError:
            value = ""
    if value.strip().lower() == "off":
        return None
    return tuple(name.strip() for name in value.split(",") if name.strip())


async def serve(args: argparse.Namespace) -> None:
    app = create_app(keepawake_dir=args.keepawake_dir,
                     zygote_preload=zygote_preload(args.zygote_preload))
    runner = web.AppRunner(app, access_log=None)
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
