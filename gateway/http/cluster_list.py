"""``GET /v1/sandboxes`` across the fleet (``[cluster]`` on; imported only then).

The host a list request reaches first answers it itself (through its own rate limits and
key auth: a refused key or a bad query ends there, and nothing is asked of other hosts),
then asks every other live host (a host record in the route cache) for the same path and
query, in parallel, with the client's own ``Authorization`` (each host authenticates and
limits the key as if the client had come to it) and the hop header, so they answer with
their local page and never ask further. Each is bounded by ``[cluster] timeout``; a host
that does not answer in time, cannot be reached or refuses (its key not replicated yet,
its limits) is named in the answer's ``partial``, and so is a host with no record (dead or
cut off) that the route cache's records name as the owner of some of the tenant's
sandboxes. The pages are merged by ``gateway.cluster.listing.merge``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.cluster import listing, routing
from gateway.cluster.errors import ProtocolError
from gateway.cluster.node import ClusterNode
from gateway.http import wire
from gateway.http.middleware import TENANT_KEY, Handler
from gateway.sandbox.listing import parse_query

log = logging.getLogger(__name__)
MAX_PAGE_BYTES = 64 << 20  # a full page (MAX_LIMIT sandboxes, 16 KiB of metadata each) fits
_DROPPED = frozenset({"Content-Length", "Content-Type", "Content-Encoding",
                      "Transfer-Encoding"})


def is_list(request: web.Request) -> bool:
    """A client's own list request (not one another host sent here)."""
    return (request.method == "GET" and request.path == "/v1/sandboxes"
            and routing.HOP_HEADER not in request.headers)


async def fleet_list(request: web.Request, handler: Handler, node: ClusterNode,
                     session: aiohttp.ClientSession) -> web.StreamResponse:
    local = await handler(request)
    if local.status != 200 or not isinstance(local, web.Response):
        return local
    live = node.routes.live_hosts()
    peers = {name: address for name, address in live.items() if name != node.config.host}
    dead = _dead_owners(request, node, live)
    if not peers and not dead:
        return local
    limit = parse_query(request.query).limit  # the query is valid: this host took it
    pages = [listing.page_of(node.config.host, orjson.loads(local.body))]  # type: ignore[arg-type]
    asked = await asyncio.gather(*(
        _ask(session, request, node.config.host, name, address, node.config.timeout)
        for name, address in sorted(peers.items())))
    pages += [page for page in asked if page is not None]
    missing = [name for name, page in zip(sorted(peers), asked, strict=True) if page is None] + dead
    merged = listing.merge(pages, limit, missing, _owner(node))
    out = web.Response(body=wire.dumps(wire.SandboxList(
        sandboxes=merged.sandboxes, next_cursor=merged.next_cursor,  # type: ignore[arg-type]
        partial=merged.partial or None)), content_type="application/json")
    for name, value in local.headers.items():  # e.g. this host's rate-limit headers
        if name not in _DROPPED:
            out.headers.add(name, value)
    return out


def _dead_owners(request: web.Request, node: ClusterNode, live: dict[str, str]
                 ) -> list[str]:
    """Hosts without a record (dead, cut off) that the fleet's records still name as
    the owner of some of the listed tenant's sandboxes: missing too, until the reaper
    moves those sandboxes to a live host (docs/cluster.md)."""
    key = request.get(TENANT_KEY)
    tenant = request.query.get("tenant") or (key.id if key is not None else None)
    if tenant is None:
        return []
    return sorted(node.routes.owners_of(tenant) - set(live) - {node.config.host})


def _owner(node: ClusterNode) -> Any:
    def owner(sandbox_id: str) -> str | None:
        route = node.routes.route(sandbox_id)
        return route.host if route is not None else None
    return owner


async def _ask(session: aiohttp.ClientSession, request: web.Request, self_host: str,
               host: str, address: str, timeout: float) -> listing.HostPage | None:
    """Host ``host``'s local page for the same query; None when it gave none in time."""
    headers = {routing.HOP_HEADER: self_host, "Accept": "application/json"}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    url = f"http://{address}{request.path_qs}"
    try:
        async with asyncio.timeout(timeout):
            async with session.get(url, headers=headers, allow_redirects=False) as resp:
                if resp.status != 200:
                    log.warning("fleet list: %s answered %d: %s", host, resp.status,
                                (await resp.content.read(512)).decode(errors="replace"))
                    return None
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > MAX_PAGE_BYTES:
                        raise ProtocolError(f"{host}: a page over {MAX_PAGE_BYTES} bytes")
                return listing.page_of(host, orjson.loads(body))
    except TimeoutError:
        log.warning("fleet list: %s did not answer within %.1f s", host, timeout)
    except (aiohttp.ClientError, OSError, ProtocolError, orjson.JSONDecodeError) as exc:
        log.warning("fleet list: %s: %s", host, exc)
    return None
