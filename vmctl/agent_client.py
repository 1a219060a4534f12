"""Host-side client of the guest agent (see ``guest.protocol``).

One ``AgentClient`` per running VM. Its connection pool must not outlive the
VMM it talks to (connections are dead after a restore), so ``aclose`` is
called whenever the VM is paused for a snapshot or destroyed, and a new client
is made on wake.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from guest.protocol import (
    AGENT_PORT,
    MAX_OUTPUT_BYTES,
    DirListing,
    ExecRequest,
    ExecResult,
    FileInfo,
    Health,
    InitRequest,
)
from vmctl.errors import (
    GuestReplyError,
    GuestReplyTimeout,
    GuestReplyTooLarge,
    VMGoneError,
    VmctlError,
    VMTimeoutError,
)

# Everything read from the guest is bounded (the guest is untrusted). Replies are read into
# memory only up to a cap: most are small; /exec and /run_code carry up to MAX_OUTPUT_BYTES
# of each stream, which JSON escaping can grow sixfold (\u00XX per byte).
MAX_REPLY_BYTES = 8 << 20
MAX_OUTPUT_REPLY_BYTES = 2 * 6 * MAX_OUTPUT_BYTES + (1 << 20)
MAX_LISTING_BYTES = 64 << 20  # a directory listing (one FileInfo per entry)
MAX_ERROR_BODY = 64 << 10  # an error reply's body
MAX_ERROR_TEXT = 1000  # characters of the guest's error message we pass on (API, logs)
# Once the agent has started answering (headers read), the rest of a JSON reply must arrive
# within this many seconds (a reply that trickles forever fails instead of holding a slot).
REPLY_BODY_TIMEOUT = 60.0
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")


class AgentError(VmctlError):
    """The agent answered with an error (carries its status and code)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class AgentUnreachable(VmctlError):
    code = "agent_unreachable"
    status = 502


def _check_alive(alive: Callable[[], bool]) -> None:
    if not alive():
        raise VMGoneError("the VMM exited before the guest agent answered")


class AgentClient:
    def __init__(self, address: str, port: int = AGENT_PORT) -> None:
        self.base = f"http://{address}:{port}"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())

    async def aclose(self) -> None:
        await self._session.close()

    async def wait_ready(self, timeout: float,
                         alive: Callable[[], bool] = lambda: True) -> Health:
        """Poll /health until the agent answers (ready = the agent answered, not 'VMM started').
        ``alive``: checked between attempts, so a VMM that died fails the wait at once."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            _check_alive(alive)
            try:
                return await self.health(timeout=1.0)
            except (TimeoutError, AgentUnreachable) as exc:
                last = exc
                await asyncio.sleep(0.01)
        raise VMTimeoutError(f"guest agent not ready after {timeout:.0f}s ({last})")

    async def init_when_ready(self, make_req: Callable[[], InitRequest], timeout: float,
                              alive: Callable[[], bool] = lambda: True) -> None:
        """Send /init as soon as the agent answers: after a restore, /init is the readiness
        probe too (one round trip instead of two; under TCG each costs tens of ms)."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            _check_alive(alive)
            try:
                return await self.init(make_req())
            except (TimeoutError, AgentUnreachable) as exc:
                last = exc
                await asyncio.sleep(0.005)
        raise VMTimeoutError(f"guest agent not ready after {timeout:.0f}s ({last})")

    async def health(self, timeout: float = 5.0) -> Health:
        return Health.from_dict(await self._json("GET", "/health", timeout=timeout))

    async def execute(self, req: ExecRequest) -> ExecResult:
        # The agent enforces req.timeout; give the HTTP exchange a margin on top.
        data = await self._json("POST", "/exec", json=req.to_dict(), timeout=req.timeout + 15,
                                max_bytes=MAX_OUTPUT_REPLY_BYTES)
        return ExecResult.from_dict(data)

    async def sync(self, timeout: float) -> None:
        """Flush the guest's filesystems to its disk."""
        await self._json("POST", "/sync", timeout=timeout)

    async def init(self, req: InitRequest) -> None:
        await self._json("POST", "/init", json=req.to_dict(), timeout=10)

    async def stat(self, path: str) -> FileInfo:
        return FileInfo.from_dict(await self._json("GET", "/files/stat", params={"path": path}))

    async def remove(self, path: str) -> None:
        await self._json("DELETE", "/files", params={"path": path})

    async def write_file(self, path: str, body: AsyncIterator[bytes] | aiohttp.StreamReader,
                         size: int | None = None) -> FileInfo:
        headers = {"Content-Length": str(size)} if size is not None else {}
        data = await self._json("PUT", "/files", params={"path": path}, data=body,
                                headers=headers, timeout=None)
        return FileInfo.from_dict(data)

    async def open_file(self, path: str) -> aiohttp.ClientResponse:
        """Start a download; the caller streams ``resp.content`` and must release ``resp``.
        A directory answers with a JSON DirListing instead of bytes."""
        resp = await self._request("GET", "/files", params={"path": path}, timeout=None)
        if resp.status >= 400:
            await self._raise_for(resp)
        return resp

    @staticmethod
    async def listing(resp: aiohttp.ClientResponse) -> DirListing:
        return DirListing.from_dict(await read_json(resp, MAX_LISTING_BYTES))

    # -- plumbing ----------------------------------------------------------------

    async def _request(self, method: str, path: str, timeout: float | None = 30.0,
                       **kw: Any) -> aiohttp.ClientResponse:
        try:
            return await self._session.request(
                method, self.base + path,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=2.0), **kw)
        except aiohttp.ClientConnectionError as exc:
            raise AgentUnreachable(f"guest agent unreachable: {exc}") from exc
        except aiohttp.ClientResponseError as exc:  # headers over the parser's limits
            raise GuestReplyError(f"guest agent sent a malformed reply: "
                                  f"{bounded(exc.message)}") from exc
        except TimeoutError as exc:
            raise GuestReplyTimeout(f"guest agent did not answer {path} in time") from exc

    async def _json(self, method: str, path: str, timeout: float | None = 30.0,
                    max_bytes: int = MAX_REPLY_BYTES, **kw: Any) -> Any:
        resp = await self._request(method, path, timeout=timeout, **kw)
        async with resp:
            if resp.status >= 400:
                await self._raise_for(resp)
            if resp.status == 204:
                return None
            try:
                return await read_json(resp, max_bytes)
            except TimeoutError as exc:  # the session's total timeout (or ours, in read_json)
                if isinstance(exc, GuestReplyTimeout):
                    raise
                raise GuestReplyTimeout(f"guest agent did not finish answering {path} "
                                        "in time") from exc

    @staticmethod
    async def _raise_for(resp: aiohttp.ClientResponse) -> None:
        try:
            err = (await read_json(resp, MAX_ERROR_BODY))["error"]
            code, message = str(err["code"]), bounded(str(err["message"]))
            if not _CODE.fullmatch(code):
                code = "agent_error"
        except Exception:
            code, message = "agent_error", f"guest agent answered {resp.status}"
        resp.release()
        raise AgentError(resp.status, code, message)


def bounded(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """Text from the guest cut to ``limit`` characters before it reaches an API answer,
    a log line or the registry."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more)"


async def read_body(resp: aiohttp.ClientResponse, limit: int,
                    timeout: float | None = None) -> bytes:
    """A reply's body, at most ``limit`` bytes, within ``timeout`` seconds: never more
    memory than the cap, never forever. ``GuestReplyTooLarge`` / ``GuestReplyTimeout``."""
    if resp.content_length is not None and resp.content_length > limit:
        raise GuestReplyTooLarge(f"guest agent reply of {resp.content_length} bytes is over "
                                 f"the limit of {limit}")
    timeout = REPLY_BODY_TIMEOUT if timeout is None else timeout
    buf = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in resp.content.iter_any():
                buf += chunk
                if len(buf) > limit:
                    raise GuestReplyTooLarge(f"guest agent reply is over the limit of "
                                             f"{limit} bytes")
    except TimeoutError as exc:
        raise GuestReplyTimeout(f"guest agent reply not complete after {timeout:g}s "
                                f"({len(buf)} bytes)") from exc
    except aiohttp.ClientPayloadError as exc:
        raise AgentUnreachable(f"guest agent connection broke: {exc}") from exc
    return bytes(buf)


async def read_json(resp: aiohttp.ClientResponse, limit: int) -> Any:
    body = await read_body(resp, limit)
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise GuestReplyError(f"guest agent reply is not JSON: {bounded(str(exc), 200)}") \
            from exc
