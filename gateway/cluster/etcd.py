"""A small asyncio etcd v3 client over etcd's own JSON gateway (``/v3/...``, aiohttp).

Why not a library: the maintained asyncio clients on PyPI (``aetcd``, ``etcd3aio``) need
``grpcio``, a large native dependency with its own event loop integration; the JSON-gateway
ones (``async-etcd3gw``, ``etcd3-py``) have had no release since 2023 and talk to a single
endpoint. etcd documents the gateway as a supported API, and what we need of it is a handful
of unary calls plus one streamed call, so the client is this module (HTTP) and
``gateway.cluster.wire`` (encoding, no I/O).

Every call has a deadline (``timeout``) and each attempt a shorter one (``attempt_timeout``)
so one member that hangs (partitioned, no leader) costs at most one attempt before the call
fails over to the next endpoint. The endpoint that last answered is tried first. Reads and
lease calls are retried on any failure; a put, delete or txn is retried only when it
certainly did not apply (no connection, or etcd said it has no leader). If it may have
applied, the call raises ``EtcdUncertain`` and the caller re-reads. Answers are bounded in
size. Errors are mapped into ``gateway.cluster.errors`` and raised from the original.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp

from gateway.cluster import wire
from gateway.cluster.errors import (ClusterError, EtcdRequestError, EtcdUncertain, EtcdUnavailable,
                                    LeaseNotFound, ProtocolError)

MAX_RESPONSE_BYTES = 8 << 20
# gRPC metadata through the gateway: a member without a leader refuses at once ("no leader")
# instead of hanging, and cancels our watches (so they move to a member that has one).
REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}
GRPC_NOT_FOUND, GRPC_UNAVAILABLE = 5, 14
# etcd's UNAVAILABLE answers that guarantee the request was not applied.
_NOT_APPLIED = ("no leader", "not capable", "too many requests")


class EtcdClient:
    """One etcd cluster, reached through any of ``endpoints`` (``http://host:port``)."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0,
                 attempt_timeout: float = 1.5, max_response_bytes: int = MAX_RESPONSE_BYTES
                 ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = tuple(e.rstrip("/") for e in endpoints)
        self.timeout = timeout
        self.attempt_timeout = min(attempt_timeout, timeout)
        self.max_response_bytes = max_response_bytes
        self._preferred = 0
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<EtcdClient {self.endpoints[self._preferred]} of {len(self.endpoints)}>"

    def session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EtcdUnavailable("client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True),
                headers=REQUIRE_LEADER)
        return self._session

    async def aclose(self) -> None:
        """Idempotent; open watch streams end with the session."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def order(self) -> list[int]:
        """Endpoint indices, the one that last answered first."""
        n = len(self.endpoints)
        return [(self._preferred + i) % n for i in range(n)]

    # --- KV --------------------------------------------------------------------------------

    async def range(self, key: bytes | str, range_end: bytes | None = None, *, limit: int = 0,
                    revision: int = 0, serializable: bool = False) -> wire.RangeResult:
        body = wire.range_body(key, range_end, limit=limit, revision=revision,
                               serializable=serializable)
        return wire.decode_range(await self.call("/v3/kv/range", body, idempotent=True))

    async def get(self, key: bytes | str) -> wire.KeyValue | None:
        result = await self.range(key)
        return result.kvs[0] if result.kvs else None

    async def get_prefix(self, prefix: bytes | str, *, revision: int = 0) -> wire.RangeResult:
        return await self.range(prefix, wire.prefix_end(prefix), revision=revision)

    async def put(self, key: bytes | str, value: bytes | str, lease: int = 0) -> int:
        """Returns the revision of the write."""
        answer = await self.call("/v3/kv/put", wire.put_body(key, value, lease))
        return wire.revision_of(answer)

    async def delete(self, key: bytes | str, range_end: bytes | None = None) -> int:
        """Returns how many keys were deleted."""
        answer = await self.call("/v3/kv/deleterange", wire.delete_body(key, range_end))
        return wire.as_int(answer.get("deleted"))

    async def txn(self, compares: list[dict[str, Any]], success: list[dict[str, Any]],
                  failure: list[dict[str, Any]] | None = None) -> wire.TxnResult:
        body = wire.txn_body(compares, success, failure)
        return wire.decode_txn(await self.call("/v3/kv/txn", body))

    # --- leases ----------------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be raised to its minimum)."""
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl)}, idempotent=True)
        if answer.get("error"):
            raise EtcdRequestError(str(answer["error"]))
        return wire.as_int(answer.get("ID")), wire.as_int(answer.get("TTL"))

    async def lease_keepalive(self, lease: int) -> wire.KeepAlive:
        """Renew once. A gone lease raises LeaseNotFound."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, idempotent=True)
        result = answer.get("result")
        if not isinstance(result, dict):
            raise ProtocolError("keepalive: no result")
        ttl = wire.as_int(result.get("TTL"))
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease:x} is gone", GRPC_NOT_FOUND)
        return wire.KeepAlive(ttl, wire.term_of(result))

    async def lease_revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)}, idempotent=True)

    # --- maintenance -----------------------------------------------------------------------

    async def status(self, endpoint: str) -> dict[str, Any]:
        """``/v3/maintenance/status`` of one member (no failover): its id and the leader's."""
        url = endpoint.rstrip("/") + "/v3/maintenance/status"
        try:
            async with self.session().post(
                    url, json={}, timeout=aiohttp.ClientTimeout(total=self.attempt_timeout)
            ) as resp:
                return _checked(resp.status, await self._read(resp))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EtcdUnavailable(f"{endpoint}: {exc!r}") from exc

    async def probe(self, index: int, timeout: float | None = None) -> bool:
        """Can endpoint ``index`` serve a linearizable read (it is up and has a leader)?"""
        body = wire.range_body("\0", limit=1)
        try:
            await self._attempt(index, "/v3/kv/range", body, timeout or self.attempt_timeout,
                                idempotent=True)
        except (_Retry, ClusterError):
            return False
        return True

    # --- the HTTP edge ---------------------------------------------------------------------

    async def call(self, path: str, body: dict[str, Any], *, idempotent: bool = False
                   ) -> dict[str, Any]:
        """POST ``body`` to ``path``, failing over across endpoints until ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        last: BaseException | None = None
        while True:
            for index in self.order():
                left = deadline - loop.time()
                if left <= 0:
                    raise EtcdUnavailable(f"{path}: no etcd endpoint answered: {last!r}"
                                          ) from last
                try:
                    answer = await self._attempt(index, path, body, min(left,
                                                 self.attempt_timeout), idempotent)
                except _Retry as retry:
                    last = retry.__cause__
                    continue
                self._preferred = index
                return answer
            await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))

    async def blocking_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A call that waits as long as it takes (an election campaign): no total deadline,
        connecting bounded, moved to the next endpoint whenever one fails. Only for calls
        that are safe to repeat; cancel the caller to stop it."""
        while True:
            for index in self.order():
                try:
                    answer = await self._attempt(index, path, body, None, idempotent=True)
                except _Retry:
                    continue
                self._preferred = index
                return answer
            await asyncio.sleep(0.1)

    async def _attempt(self, index: int, path: str, body: dict[str, Any],
                       timeout: float | None, idempotent: bool) -> dict[str, Any]:
        """``timeout`` None: wait for the answer as long as it takes."""
        url = self.endpoints[index] + path
        limits = aiohttp.ClientTimeout(total=timeout) if timeout is not None else \
            aiohttp.ClientTimeout(total=None, sock_connect=self.attempt_timeout)
        try:
            async with self.session().post(url, json=body, timeout=limits) as resp:
                raw = await self._read(resp)
                status = resp.status
        except aiohttp.ClientConnectorError as exc:  # never sent
            raise _Retry() from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            if idempotent:
                raise _Retry() from exc
            raise EtcdUncertain(f"{url}: no answer, outcome unknown ({exc!r})") from exc
        try:
            return _checked(status, raw)
        except EtcdRequestError as exc:
            if exc.grpc_code != GRPC_UNAVAILABLE:
                raise
            if idempotent or any(s in str(exc) for s in _NOT_APPLIED):
                raise _Retry() from exc
            raise EtcdUncertain(f"{url}: {exc}; outcome unknown") from exc

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        limit = self.max_response_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise ProtocolError(f"etcd answer of {resp.content_length} bytes is over {limit}")
        chunks, total = [], 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            total += len(chunk)
            if total > limit:
                raise ProtocolError(f"etcd answer is over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    # --- watch (one stream; gateway.cluster.watch reconnects) --------------------------------

    async def watch_stream(self, index: int, body: dict[str, Any],
                           connect_timeout: float | None = None
                           ) -> AsyncIterator[wire.WatchBatch]:
        """Messages of one ``/v3/watch`` stream on endpoint ``index`` until it ends. Raises
        EtcdUnavailable when the stream cannot be opened or breaks."""
        url = self.endpoints[index] + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout
                                        or self.attempt_timeout)
        try:
            async with self.session().post(url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    _checked(resp.status, await self._read(resp))
                async for line in _lines(resp, self.max_response_bytes):
                    yield wire.decode_watch(_json(line))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EtcdUnavailable(f"watch on {url}: {exc!r}") from exc


class _Retry(Exception):
    """This attempt failed without applying anything: try the next endpoint."""


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"etcd answer is not JSON: {raw[:80]!r}") from exc
    if not isinstance(value, dict):
        raise ProtocolError("etcd answer is not a JSON object")
    return value


def _checked(status: int, raw: bytes) -> dict[str, Any]:
    """The answer's JSON, or the error it carries as one of ours."""
    answer = _json(raw)
    if status == 200 and "code" not in answer:
        return answer
    grpc = wire.as_int(answer.get("code", 2))  # a gRPC status, not one of our API codes
    message = str(answer.get("message") or answer.get("error") or f"HTTP {status}")
    cls = LeaseNotFound if grpc == GRPC_NOT_FOUND and "lease" in message else EtcdRequestError
    raise cls(message, grpc, status)


async def _lines(resp: aiohttp.ClientResponse, limit: int) -> AsyncIterator[bytes]:
    """Newline-delimited messages of a streamed answer, each at most ``limit`` bytes."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if len(buffer) > limit:
            raise ProtocolError(f"watch message over {limit} bytes")
    if buffer.strip():
        yield buffer
