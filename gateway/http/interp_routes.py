"""REST API for the code interpreter and commands: /v1/sandboxes/{id}/run_code,
/contexts and /commands. Transport only: parse, hold the sandbox, call its guest agent
(``gateway.sandbox.guest``), shape JSON or relay NDJSON.

Every handler holds ``SandboxService.use()`` for its whole duration, so a
streamed response (run output, a followed command) keeps the sandbox counted as
active. Streams are relayed chunk by chunk: each write waits for the client to
drain, so a slow client slows the agent rather than filling our memory. A
client that leaves cancels the handler (``handler_cancellation``), which closes
the upstream request: the agent then interrupts a streamed run, kills a
foreground command, and simply stops following a background one. A relayed
stream that ends without its final ``end``/``exit`` line was cut short; a
command's output can be reattached from the last ``next_offset`` seen.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from gateway.http import wire
from gateway.http.sandbox_routes import SERVICE_KEY, json_response, read_json
from gateway.http.middleware import current_key
from gateway.sandbox import guest
from guest.protocol import (
    query_number,
    CommandRequest,
    CreateContextRequest,
    RunCodeRequest,
    SignalRequest,
    validate_context_name,
)

routes = web.RouteTableDef()

NDJSON = "application/x-ndjson"
MAX_WAIT = 3600.0
_SB = "/v1/sandboxes/{id}"
_PID = _SB + r"/commands/{pid:\d+}"


def _use(request: web.Request) -> Any:
    return request.app[SERVICE_KEY].use(current_key(request).id, request.match_info["id"])


async def _json_or_empty(request: web.Request) -> Any:
    return {} if not await request.read() else await read_json(request)


def _pid(request: web.Request) -> int:
    return int(request.match_info["pid"])


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true", "yes")


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """Pass an NDJSON stream from the agent through to the client, with backpressure."""
    try:
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})
        await resp.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
            pass  # the agent's side broke: the client sees a stream without its last line
        await resp.write_eof()
        return resp
    finally:
        upstream.release()


# -- code interpreter ----------------------------------------------------------------------

@routes.post(_SB + "/run_code")
async def run_code(request: web.Request) -> web.StreamResponse:
    req = RunCodeRequest.from_dict(await read_json(request))
    async with _use(request) as machine:
        if req.stream:
            return await _relay(request, await guest.open_run_code(machine, req))
        execution = await guest.run_code(machine, req)
    return json_response(execution.to_dict())


@routes.post(_SB + "/contexts")
async def create_context(request: web.Request) -> web.Response:
    req = CreateContextRequest.from_dict(await _json_or_empty(request))
    async with _use(request) as machine:
        info = await guest.create_context(machine, req)
    return json_response(info.to_dict(), status=201)


@routes.get(_SB + "/contexts")
async def list_contexts(request: web.Request) -> web.Response:
    async with _use(request) as machine:
        contexts = await guest.list_contexts(machine)
    return json_response(wire.ContextList(contexts=list(contexts)))


@routes.delete(_SB + "/contexts/{name}")
async def delete_context(request: web.Request) -> web.Response:
    name = validate_context_name(request.match_info["name"])
    async with _use(request) as machine:
        await guest.delete_context(machine, name)
    return web.Response(status=204)


# -- commands ------------------------------------------------------------------------------

@routes.post(_SB + "/commands")
async def start_command(request: web.Request) -> web.StreamResponse:
    req = CommandRequest.from_dict(await read_json(request))
    async with _use(request) as machine:
        if not req.background:
            return await _relay(request, await guest.open_command(machine, req))
        info = await guest.start_command(machine, req)
    return json_response(info.to_dict(), status=201)


@routes.get(_SB + "/commands")
async def list_commands(request: web.Request) -> web.Response:
    async with _use(request) as machine:
        infos = await guest.list_commands(machine)
    return json_response(wire.ProcessList(commands=list(infos)))


@routes.get(_PID)
async def get_command(request: web.Request) -> web.Response:
    async with _use(request) as machine:
        info = await guest.get_command(machine, _pid(request))
    return json_response(info.to_dict())


@routes.post(_PID + "/stdin")
async def command_stdin(request: web.Request) -> web.Response:
    data = await request.read()  # bounded by the app's client_max_size (413 beyond)
    async with _use(request) as machine:
        await guest.send_stdin(machine, _pid(request), data, eof=_flag(request, "eof"))
    return web.Response(status=204)


@routes.post(_PID + "/signal")
async def signal_command(request: web.Request) -> web.Response:
    req = SignalRequest.from_dict(await _json_or_empty(request))
    async with _use(request) as machine:
        await guest.signal_command(machine, _pid(request), req)
    return web.Response(status=204)


@routes.get(_PID + "/wait")
async def wait_command(request: web.Request) -> web.Response:
    timeout = query_number(request.query, "timeout", 30.0, MAX_WAIT)
    async with _use(request) as machine:
        info = await guest.wait_command(machine, _pid(request), timeout)
    return json_response(info.to_dict())


@routes.get(_PID + "/output")
async def command_output(request: web.Request) -> web.StreamResponse:
    offset = int(query_number(request.query, "offset", 0, float(2**62)))
    follow = _flag(request, "follow")
    async with _use(request) as machine:
        upstream = await guest.open_output(machine, _pid(request), offset, follow)
        return await _relay(request, upstream)
