"""HTTP transport: the one place the SDK touches httpx.

A :class:`Call` (built by ``agentbox._calls``, no I/O) says what to send; the
sync and async transports send it, map every failure into
``agentbox.exceptions`` (HTTP errors by the server's code, httpx's own errors
by kind, chained with ``from``), and hand back the response or a stream.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentbox import exceptions as exc_mod
from agentbox.exceptions import APIConnectionError, ConfigurationError, ProtocolError

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT = 120.0  # covers a create that has to wait for a busy host
USER_AGENT = "agentbox-python/0.1"

DEFAULT: Any = object()  # "use the transport's default timeout"


@dataclass(frozen=True)
class Call:
    """One HTTP request, as data. ``timeout``: seconds for the whole exchange's reads
    (None = no limit; DEFAULT = the client's)."""

    method: str
    path: str
    params: dict[str, str] | None = None
    json: Any = None
    content: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: Any = DEFAULT


@dataclass(frozen=True)
class ClientConfig:
    api_key: str
    base_url: str
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def resolve(cls, api_key: str | None = None, base_url: str | None = None,
                timeout: float | None = None) -> ClientConfig:
        """Arguments first, then ``AGENTBOX_API_KEY`` / ``AGENTBOX_URL``, then defaults.
        ``...`` counts as not given, so examples written ``AgentBox(api_key=...)`` run."""
        api_key = None if api_key is Ellipsis else api_key
        base_url = None if base_url is Ellipsis else base_url
        key = api_key or os.environ.get("AGENTBOX_API_KEY")
        if not key:
            raise ConfigurationError("no API key: pass api_key=... or set AGENTBOX_API_KEY")
        url = (base_url or os.environ.get("AGENTBOX_URL") or DEFAULT_URL).rstrip("/")
        if "://" not in url:
            url = "http://" + url
        return cls(api_key=key, base_url=url, timeout=timeout or DEFAULT_TIMEOUT)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "User-Agent": USER_AGENT}

    def httpx_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, connect=10.0)


def _kwargs(call: Call) -> dict[str, Any]:
    kw: dict[str, Any] = {"params": call.params, "headers": call.headers or None}
    if call.json is not None:
        kw["json"] = call.json
    if call.content is not None:
        kw["content"] = call.content
    if call.timeout is not DEFAULT:
        kw["timeout"] = httpx.Timeout(call.timeout, connect=10.0)
    return kw


def error_for(resp: httpx.Response) -> exc_mod.AgentBoxError:
    """The SDK exception for an error response whose body has been read."""
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    return exc_mod.from_response(resp.status_code, body, resp.headers)


@contextlib.contextmanager
def mapped_errors(what: str) -> Iterator[None]:
    """Turn httpx's exceptions raised inside the block into ours."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise exc_mod.TimeoutError(f"{what}: timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise APIConnectionError(f"{what}: {type(exc).__name__}: {exc}") from exc


def parse_json(resp: httpx.Response) -> Any:
    if resp.status_code == 204 or not resp.content:
        return None
    try:
        return resp.json()
    except ValueError as exc:
        raise ProtocolError(f"the server answered non-JSON: {resp.text[:200]!r}") from exc


def parse_line(line: str) -> dict[str, Any] | None:
    """One NDJSON line as a dict (None for a blank line)."""
    if not line.strip():
        return None
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"bad NDJSON line from the server: {line[:200]!r}") from exc
    if not isinstance(event, dict):
        raise ProtocolError(f"NDJSON line is not an object: {line[:200]!r}")
    return event


class SyncTransport:
    def __init__(self, config: ClientConfig, http: httpx.Client | None = None) -> None:
        self.config = config
        self._http = http or httpx.Client(base_url=config.base_url, headers=config.headers(),
                                          timeout=config.httpx_timeout())

    def send(self, call: Call) -> httpx.Response:
        with mapped_errors(f"{call.method} {call.path}"):
            resp = self._http.request(call.method, call.path, **_kwargs(call))
        if resp.status_code >= 400:
            raise error_for(resp)
        return resp

    def json(self, call: Call) -> Any:
        return parse_json(self.send(call))

    @contextlib.contextmanager
    def stream(self, call: Call) -> Iterator[httpx.Response]:
        """An open streamed response (errors are raised before it is handed out)."""
        with mapped_errors(f"{call.method} {call.path}"), \
                self._http.stream(call.method, call.path, **_kwargs(call)) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise error_for(resp)
            yield resp

    def events(self, call: Call) -> Iterator[dict[str, Any]]:
        """The NDJSON events of a streamed response (a generator; closing it closes the stream)."""
        with self.stream(call) as resp:
            for line in resp.iter_lines():
                event = parse_line(line)
                if event is not None:
                    yield event

    def close(self) -> None:
        self._http.close()


class AsyncTransport:
    def __init__(self, config: ClientConfig, http: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self._http = http or httpx.AsyncClient(base_url=config.base_url,
                                               headers=config.headers(),
                                               timeout=config.httpx_timeout())

    async def send(self, call: Call) -> httpx.Response:
        with mapped_errors(f"{call.method} {call.path}"):
            resp = await self._http.request(call.method, call.path, **_kwargs(call))
        if resp.status_code >= 400:
            raise error_for(resp)
        return resp

    async def json(self, call: Call) -> Any:
        return parse_json(await self.send(call))

    @contextlib.asynccontextmanager
    async def stream(self, call: Call) -> AsyncIterator[httpx.Response]:
        with mapped_errors(f"{call.method} {call.path}"):
            async with self._http.stream(call.method, call.path, **_kwargs(call)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise error_for(resp)
                yield resp

    async def events(self, call: Call) -> AsyncGenerator[dict[str, Any], None]:
        async with self.stream(call) as resp:
            async for line in resp.aiter_lines():
                event = parse_line(line)
                if event is not None:
                    yield event

    async def aclose(self) -> None:
        await self._http.aclose()
