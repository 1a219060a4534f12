"""One request through the fast lane: admitted, sent upstream, answered.

An ``Exchange`` holds the sandbox's admission (a lease from ``SandboxController.try_request``)
from the moment the front protocol took the request until its response went out, the client
left, or the VM died (``aborted``); every ending releases the lease exactly once. It takes a
pooled upstream connection or connects one; a refused connect gives the request back to the
front protocol, which hands the connection to aiohttp (nothing went upstream yet: aiohttp does
the expose-port retry). A pooled connection the app had closed is retried once on a new one for
a bodiless idempotent request. The request goes upstream as aiohttp's client would send it
(``proxy_headers.upstream_headers``, Host first, its Content-Length rules).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiohttp.client_reqrep import ClientRequest
from multidict import CIMultiDict

from gateway.errors import ApiError
from gateway.preview.fastlane.memo import Memo
from gateway.preview.fastlane.request_head import Request
from gateway.preview.fastlane.response_head import head_for, serialize
from gateway.preview.fastlane.upstream import Unanswered
from gateway.preview.hosts import Target, error_page_for
from gateway.preview.proxy_headers import upstream_headers

if TYPE_CHECKING:
    from gateway.preview.fastlane.front import FrontProtocol
    from gateway.preview.fastlane.upstream import Upstream

log = logging.getLogger(__name__)

GET_METHODS = ClientRequest.GET_METHODS


class Exchange:
    """One request through the fast lane: admitted, sent upstream, answered."""

    def __init__(self, front: FrontProtocol, memo: Memo, req: Request, target: Target) -> None:
        self.front = front
        self.memo = memo
        self.req = req
        self.target = target
        self.lease: Any = None
        self.up: Upstream | None = None
        self.body_left = req.content_length or 0
        self.started = False  # a byte of the response went to the client
        self.done = False
        self.replayable = not self.body_left and req.method in ("GET", "HEAD", "OPTIONS")
        self.retried = False
        self.reused = False
        self.connecting: asyncio.Task | None = None

    # sending
    def start(self) -> None:
        lane = self.front.lane
        machine = self.lease.machine
        addr = machine.plan.slot.guest_addr
        driver = getattr(machine, "driver", None)
        key = (self.target.sandbox_id, getattr(driver, "pid", None),
               getattr(driver, "started_at", None), addr, self.target.port)
        self.key = key
        up = lane.pool.take(key)
        if up is not None:
            self._send(up, reused=True)
            return
        self.front.pause_for_upstream()
        self.connecting = lane.loop.create_task(self._connect(addr))

    async def _connect(self, addr: str) -> None:
        try:
            up = await self.front.lane.pool.connect(self.key, addr, self.target.port)
        except asyncio.CancelledError:
            return
        except OSError as exc:
            self.connecting = None
            if self.done:
                return
            log.debug("fast lane: connect to %s:%d failed (%r): aiohttp's path",
                      addr, self.target.port, exc)
            self._decline()
            return
        self.connecting = None
        if self.done:
            up.close()
            return
        self.front.resume_for_upstream()
        self._send(up, reused=False)

    def _decline(self) -> None:
        """Nothing went upstream: give the request (head and body) back and hand off."""
        front = self.front
        self.done = True
        self.lease.release()
        front.exchange = None
        front.buf[:0] = self.req.raw
        front.resume_for_upstream()
        front.hand_off()

    def _send(self, up: Upstream, reused: bool) -> None:
        self.up = up
        self.reused = reused
        up.begin(self)
        up.transport.write(self._request_head())
        if self.front.writing_paused:
            up.transport.pause_reading()
        self.pump_body()

    def _request_head(self) -> bytes:
        memo = self.memo
        if memo.up_block is None:
            memo.up_block = self._rewrite_headers()
        path_qs = self.target.path_qs
        if not path_qs.startswith("/"):
            path_qs = "/" + path_qs
        return f"{self.req.method} {path_qs} HTTP/1.1".encode("latin-1") + memo.up_block

    def _rewrite_headers(self) -> bytes:
        req, target = self.req, self.target
        out = upstream_headers(
            req.headers, client_ip=self.front.client_ip, scheme=self.front.scheme,
            host=req.host, version=req.version, drop=target.drop_headers,
            drop_cookie=target.drop_cookie, websocket=False,
            host_override=f"localhost:{target.port}" if self.front.lane.rewrite_host else None)
        if req.content_length is not None:
            out["Content-Length"] = str(req.content_length)
        elif req.method not in GET_METHODS:
            out["Content-Length"] = "0"  # what aiohttp's client adds
        # aiohttp's client puts Host first (ClientRequest.update_headers).
        headers: CIMultiDict[str] = CIMultiDict(Host=out.pop("Host"))
        headers.extend(out)
        return serialize("", headers)  # from the CRLF ending the request line

    def send_body(self, data: bytes) -> None:
        assert self.up is not None
        self.body_left -= len(data)
        self.up.transport.write(data)

    def pump_body(self) -> None:
        buf = self.front.buf
        if self.up is None or not self.body_left or not buf:
            return
        n = min(self.body_left, len(buf))
        chunk = bytes(buf[:n])
        del buf[:n]
        self.send_body(chunk)

    # flow control, response to the client
    def pause_upstream(self) -> None:
        if self.up is not None:
            self.up.pause_reading()

    def resume_upstream(self) -> None:
        if self.up is not None:
            self.up.resume_reading()

    def write(self, data: bytes) -> None:
        self.started = True
        front = self.front
        if front.transport is not None and not front.closed:
            front.transport.write(data)

    # endings
    def complete(self, keep_alive: bool) -> None:
        """The response went out in full."""
        if self.done:
            return
        self.done = True
        self.lease.release()
        self.front.finished(self, keep_alive and not self.body_left)

    def broke(self, error: ApiError | None) -> None:
        """The upstream failed: an error answer if nothing was sent yet, else close."""
        if self.done:
            return
        if not self.started and error is not None:
            if self.reused and self.replayable and not self.retried \
                    and isinstance(error, Unanswered):
                self._retry()
                return
            self.done = True
            self.lease.release()
            keep = self.req.keep_alive and not self.body_left
            self._answer_error(error, keep)
            self.front.finished(self, keep_alive=keep)
            return
        log.info("%s: upstream broke mid-response (%s); closing the client connection",
                 self.target.sandbox_id, error)
        self.done = True
        self.lease.release()
        self.front.finished(self, keep_alive=False)

    def _retry(self) -> None:
        """A pooled connection the app had closed, for a bodiless idempotent request:
        nothing was sent that matters; once more on a new connection."""
        self.retried = True
        self.up = None
        self.front.pause_for_upstream()
        addr = self.key[3]
        self.connecting = self.front.lane.loop.create_task(self._connect(addr))

    def _answer_error(self, error: ApiError, keep_alive: bool) -> None:
        headers = self.req.headers
        resp = error_page_for(headers.get("Accept", ""), False, error.status, error.code,
                              str(error), getattr(error, "headers", None))
        out = CIMultiDict(resp.headers)
        body = resp.body if isinstance(resp.body, bytes) else b""
        out["Content-Length"] = str(len(body))
        self.write(head_for(self.req, resp.status, resp.reason, out, length=len(body),
                            keep_alive=keep_alive)[0] + body)

    def aborted(self, error: ApiError) -> None:
        """The VM died (the controller's AbortRequests): stop, answer if we still can."""
        if self.done:
            return
        self.done = True
        self._close_upstream()
        if not self.started:
            self._answer_error(error, keep_alive=False)
        self.front.finished(self, keep_alive=False)

    def abandon(self) -> None:
        """The client went away: release the admission, drop the upstream connection."""
        if self.connecting is not None:
            self.connecting.cancel()
        if not self.done:
            self.done = True
            self._close_upstream()
            self.lease.release()

    def _close_upstream(self) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.ex = None
            up.close()
