"""A small S3 client: SigV4-signed PUT/GET/HEAD/DELETE of whole objects over aiohttp.

Why not a library: aiobotocore pulls botocore (tens of MB, its own retry and config
layers) for four verbs; the light S3 clients on PyPI are sync or unmaintained. SigV4 is
one page of hashing (``sign``, tested against AWS's published example), and objects are
sent and received streamed, so a memory file never sits in our RAM.

Every object is one PUT: S3 takes up to 5 GiB in one request, more than any snapshot
file of a sandbox shape we offer, so there is no multipart. The body is signed with its
real SHA256 (``x-amz-content-sha256``); AWS checks it, but SeaweedFS does not (the test
that expected it to refuse a mismatched body failed), so integrity rests on the reader:
every download is checked against the digest recorded at upload (gateway.cluster.shipping).
Paths are style ``{endpoint}/{bucket}/{key}``. Errors are ``ObjectStoreError``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import aiohttp

from gateway.cluster.errors import ClusterError

_CHUNK = 1 << 20
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class ObjectStoreError(ClusterError):
    """The object store refused or did not answer; ``status`` 0 means no answer."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = ""
    region: str = "us-east-1"

    def __repr__(self) -> str:  # never log the secret
        return f"Credentials(access_key={self.access_key!r}, region={self.region!r})"


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def sign(method: str, url: str, headers: dict[str, str], payload_sha256: str,
         creds: Credentials, now: dt.datetime) -> dict[str, str]:
    """The headers of a SigV4-signed S3 request: ``headers`` plus host, x-amz-date,
    x-amz-content-sha256 and Authorization. Every given header is signed."""
    parts = urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    out = {**headers, "host": parts.netloc, "x-amz-date": amz_date,
           "x-amz-content-sha256": payload_sha256}
    canon = {k.lower().strip(): " ".join(str(v).split()) for k, v in out.items()}
    names = sorted(canon)
    query = "&".join(sorted(f"{k}={v}" for k, _, v in
                            (p.partition("=") for p in parts.query.split("&") if p)))
    # The URL's path is already percent-encoded (``ObjectStore._url``): S3 signs it as
    # sent, never encoded twice.
    request = "\n".join([method, parts.path or "/", query,
                         "".join(f"{n}:{canon[n]}\n" for n in names), ";".join(names),
                         payload_sha256])
    scope = f"{amz_date[:8]}/{creds.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(request.encode()).hexdigest()])
    key = _hmac(f"AWS4{creds.secret_key}".encode(), amz_date[:8])
    for part in (creds.region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                            f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return out


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, _CHUNK):
            yield chunk


class ObjectStore:
    """One bucket. Owns its aiohttp session: ``aclose`` it (or use ``async with``)."""

    def __init__(self, endpoint: str, bucket: str, creds: Credentials, *,
                 timeout: float = 30.0) -> None:
        self.endpoint, self.bucket, self.creds = endpoint.rstrip("/"), bucket, creds
        # Per request: connecting and each read are bounded, not the whole transfer
        # (a 2 GiB memory file takes what it takes; a stalled one fails).
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout,
                                              sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ObjectStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _url(self, key: str) -> str:
        return f"{self.endpoint}/{quote(self.bucket)}/{quote(key, safe='/-_.~')}"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _request(self, method: str, key: str, *, sha256: str = EMPTY_SHA256,
                       headers: dict[str, str] | None = None,
                       data: object = None) -> aiohttp.ClientResponse:
        url = self._url(key)
        signed = sign(method, url, headers or {}, sha256, self.creds,
                      dt.datetime.now(dt.UTC))
        try:
            resp = await self._http().request(method, url, headers=signed, data=data,
                                              skip_auto_headers=("Content-Type",))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ObjectStoreError(f"{method} {key}: {exc or 'timed out'}") from exc
        if resp.status >= 300 and not (method == "HEAD" and resp.status == 404):
            body = (await resp.content.read(2048)).decode(errors="replace")
            resp.release()
            raise ObjectStoreError(f"{method} {key}: HTTP {resp.status} {body[:300]}",
                                   resp.status)
        return resp

    async def put_bytes(self, key: str, data: bytes) -> None:
        resp = await self._request("PUT", key, sha256=hashlib.sha256(data).hexdigest(),
                                   data=data)
        resp.release()

    async def put_file(self, key: str, path: Path, sha256: str) -> None:
        """Stream ``path`` as ``key``; ``sha256`` is its digest (the store checks it)."""
        size = path.stat().st_size
        resp = await self._request("PUT", key, sha256=sha256,
                                   headers={"content-length": str(size)},
                                   data=_file_chunks(path))
        resp.release()

    async def get_bytes(self, key: str, limit: int) -> bytes:
        resp = await self._request("GET", key)
        try:
            data = await resp.content.read(limit + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ObjectStoreError(f"GET {key}: {exc or 'timed out'}") from exc
        finally:
            resp.release()
        if len(data) > limit:
            raise ObjectStoreError(f"GET {key}: over {limit} bytes")
        return data

    async def get_file(self, key: str, path: Path, limit: int) -> str:
        """Stream ``key`` into ``path`` (at most ``limit`` bytes); its SHA256."""
        resp = await self._request("GET", key)
        digest, total = hashlib.sha256(), 0
        try:
            with open(path, "wb") as f:
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    total += len(chunk)
                    if total > limit:
                        raise ObjectStoreError(f"GET {key}: over {limit} bytes")
                    digest.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
                await asyncio.to_thread(os.fsync, f.fileno())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ObjectStoreError(f"GET {key}: {exc or 'timed out'}") from exc
        finally:
            resp.release()
        return digest.hexdigest()

    async def head(self, key: str) -> int | None:
        """The object's size, or None if there is none."""
        resp = await self._request("HEAD", key)
        resp.release()
        return None if resp.status == 404 else int(resp.headers.get("Content-Length", 0))

    async def delete(self, key: str) -> None:
        resp = await self._request("DELETE", key)
        resp.release()
