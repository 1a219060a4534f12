"""The terminal WebSocket: ``GET /v1/sandboxes/{id}/terminal?cols=&rows=[&cmd=]``.

Transport only: the sandbox is held through ``SandboxService.use_stream`` for as
long as the socket is open -- it is woken first if it sleeps, and an open
terminal counts as activity, so it never idles into a suspend under a user.
The upstream WebSocket to the guest agent's ``/pty`` (``gateway.sandbox.guest``)
is opened *before* the client's socket is accepted, so anything that fails up
to then (unknown sandbox, wake failure, agent refused) is an ordinary JSON
error response; after that, failures can only close the socket.

Frames are relayed as they are: binary = terminal bytes, text = JSON control
(``{"type":"resize"}`` from the client, ``{"type":"exit","exit_code"}`` from
the agent before it closes with 1000). Each direction is pumped in its own
task, one frame at a time: a send waits for its transport to drain, so a slow
reader slows the other end instead of filling our memory. Whichever side closes
first, the other is closed with the same code (see :func:`mirror_code`); the
client closing makes the agent hang the shell up.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import WSMsgType, web

from gateway.preview import browser_rules
from gateway.http.sandbox_routes import SERVICE_KEY
from gateway.errors import BadRequest, Forbidden
from gateway.http.middleware import current_key
from gateway.preview.hosts import HOSTS_KEY
from gateway.sandbox import guest
from guest.protocol import (
    DEFAULT_COLS,
    DEFAULT_ROWS,
    MAX_TERMINAL_SIZE,
    ProtocolError,
    validate_terminal_size,
)

log = logging.getLogger(__name__)

routes = web.RouteTableDef()
# Bound on one message either way (config server.max_ws_message_bytes); over it: close 1009.
MAX_WS_KEY = web.AppKey("terminal_max_ws_message_bytes", int)
DEFAULT_WS_LIMIT = 16 << 20

SUBPROTOCOL = "agentbox.terminal"
HEARTBEAT = 20.0  # seconds between pings to the client: a vanished client ends the terminal
GOING_AWAY = 1001
# Codes a peer can report but nobody may send: 1005 "no status" (and aiohttp's 0 for an
# empty close frame), 1006 "abnormal closure" (also None: the socket broke), 1015 "TLS".
_UNSENDABLE = {0: 1000, 1005: 1000, 1006: GOING_AWAY, 1015: 1011}

AnyWS = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


def mirror_code(code: int | None) -> int:
    """The close code to pass on to one side when the other closed with ``code``."""
    if code is None:
        return GOING_AWAY
    return _UNSENDABLE.get(int(code), int(code))


def _size(request: web.Request) -> tuple[int, int]:
    try:
        cols = int(request.query.get("cols", DEFAULT_COLS))
        rows = int(request.query.get("rows", DEFAULT_ROWS))
        return validate_terminal_size(cols, rows)
    except (ValueError, ProtocolError) as exc:  # ProtocolError is a ValueError
        raise BadRequest(f"'cols' and 'rows' must be integers from 1 to {MAX_TERMINAL_SIZE} "
                         f"({exc})") from exc


@routes.get("/v1/sandboxes/{id}/terminal")
async def terminal(request: web.Request) -> web.StreamResponse:
    cols, rows = _size(request)
    _refuse_guest_origin(request)
    limit = request.app.get(MAX_WS_KEY, DEFAULT_WS_LIMIT)
    # A browser offers "agentbox.terminal" with its key (gateway.http.middleware): answer
    # that one; the key's own subprotocol is never echoed.
    ws = web.WebSocketResponse(max_msg_size=limit, heartbeat=HEARTBEAT,
                               protocols=(SUBPROTOCOL,))
    if not ws.can_prepare(request).ok:
        raise BadRequest("the terminal is a WebSocket: send an Upgrade request",
                         code="websocket_required")
    service = request.app[SERVICE_KEY]
    async with service.use_stream(current_key(request).id, request.match_info["id"]) as machine:
        upstream = await guest.open_terminal(machine, cols, rows, request.query.get("cmd"),
                                             max_msg_size=limit)
        try:
            await ws.prepare(request)
            await relay(ws, upstream)
        except Exception:  # the response has started: it can only be closed, never mapped
            log.exception("terminal of %s failed", request.match_info["id"])
        finally:  # also when cancelled (the client left): the agent hangs the shell up
            if not upstream.closed:
                await upstream.close(code=GOING_AWAY)
            if not ws.closed:
                await ws.close(code=1011)
    return ws


def _refuse_guest_origin(request: web.Request) -> None:
    """A page served by a guest app (any preview or session host) never opens a terminal.
    Such a page cannot know a key (the dashboard offers its key as a subprotocol, which only
    its own script can), so this is defence in depth: it holds even if a key ever leaks
    into such a page. Other Origins are allowed (a UI's backend proxying the socket passes
    its browser's Origin on)."""
    hosts = request.config_dict.get(HOSTS_KEY)
    if hosts is not None and browser_rules.from_guest_page(
            request.headers.getall("Origin", []), lambda h: hosts.classify(h) is not None):
        raise Forbidden("a terminal cannot be opened from a preview or session page",
                        code="cross_origin_refused")


async def relay(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse) -> None:
    """Pump frames both ways until one side closes; close the other with its code."""
    down = asyncio.create_task(_pump(upstream, client), name="terminal-down")
    up = asyncio.create_task(_pump(client, upstream), name="terminal-up")
    try:
        await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Stop both pumps before closing: a close() racing a receive() in another task
        # would drop the connection without waiting for the peer's close frame. This runs
        # when cancelled too: aiohttp drops the socket of a peer that sent an oversize
        # frame, which cancels this handler, and the other side must still hear 1009.
        for task in (down, up):
            task.cancel()
        await asyncio.gather(down, up, return_exceptions=True)
        await asyncio.shield(_close_after(client, upstream, down, up))


async def _close_after(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse,
                       down: asyncio.Task, up: asyncio.Task) -> None:
    """Close the side that is still open with the code the first pump to end saw."""
    for task, src, dst in ((down, upstream, client), (up, client, upstream)):
        if task.cancelled():
            continue  # still running when stopped: the other one ended first
        code: int | None
        if task.exception() is not None:
            log.warning("terminal relay: %r", task.exception())
            code = src.close_code
        elif task.result() is _DST_FAILED:
            src, dst = dst, src  # that pump could not send: its destination is the side that left
            code = src.close_code
        else:
            result = task.result()
            code = result if isinstance(result, int) else None
        await dst.close(code=mirror_code(code))
        if not src.closed:
            await src.close(code=GOING_AWAY)
        return


_DST_FAILED = object()


async def _pump(src: AnyWS, dst: AnyWS) -> object:
    """Copy frames from ``src`` to ``dst``. Returns the close code ``src`` ended with, or
    ``_DST_FAILED`` if ``dst`` could not be written to."""
    async for msg in src:  # ends at a close frame (or a closed socket)
        try:
            if msg.type is WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            elif msg.type is WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type is WSMsgType.ERROR:
                # A frame over the limit (or another protocol error): aiohttp sent src the
                # code (1009) and dropped its socket, so src.close_code would say 1006.
                if isinstance(msg.data, aiohttp.WebSocketError):
                    return int(msg.data.code)
                break
        except (ConnectionError, aiohttp.ClientError):
            return _DST_FAILED
    return src.close_code
