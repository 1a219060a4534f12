"""Routing from any host: requests for a sandbox another host owns go to that host.

Installed only when ``[cluster]`` is on (``middlewares(config)`` is empty otherwise, and
this module is then never imported). It sits right inside the error middlewares, before
preview-host routing, rate limits and API-key auth: a forwarded request is judged by the
owner, which authenticates the key, applies its limits and serves it as if the client had
come straight to it. Which sandbox a request is for: ``/v1/sandboxes/{id}/...`` (terminal
WebSockets included), a preview host ``{port}-{id}.{domain}``, or a session (its host or
``/v1/sessions/{name}/...``, by the fleet's record of the name: a PUT for a new name is
placed as a create is). The decision is ``gateway.cluster.routing.decide`` (no I/O);
the forwarding is ``gateway.preview.forward.Forwarder``. A client's ``GET /v1/sandboxes``
lists the whole fleet (``gateway.http.cluster_list``).

Until the node has joined (start-up) the middleware passes everything through. A fenced
node also refuses creates (``POST /v1/sandboxes``): it could not publish their records.
"""

from __future__ import annotations

from aiohttp import web

from gateway.cluster import routing
from gateway.cluster.config import ClusterConfig
from gateway.cluster.node import ClusterNode
from gateway.errors import (ApiError, ForwardLoop, HostFenced, OwnerUnavailable, SandboxMoved,
                            Unavailable)
from gateway.http import cluster_list
from gateway.http.middleware import Handler
from gateway.preview import hosts, sessions
from gateway.preview.forward import Forwarder

NODE_KEY = web.AppKey("cluster_node", ClusterNode)
FORWARDER_KEY = web.AppKey("cluster_forwarder", Forwarder)
_REFUSALS: dict[str, type[ApiError]] = {
    "host_fenced": HostFenced, "forward_loop": ForwardLoop,
    "owner_unavailable": OwnerUnavailable,
}


def middlewares(config: ClusterConfig) -> list[Handler]:
    return [cluster_middleware] if config.enabled else []


def sandbox_of(request: web.Request) -> tuple[str | None, bool]:
    """(the sandbox a request is for, whether it came on a preview/session host)."""
    found = request.config_dict[hosts.HOSTS_KEY].classify(request.host)
    if isinstance(found, hosts.PreviewHost):
        return found.sandbox_id, True
    if isinstance(found, hosts.SessionHost):
        try:
            session = request.config_dict[sessions.SESSIONS_KEY].by_name(found.name)
        except (ApiError, KeyError):
            return None, True  # not a session this host knows
        return session.sandbox_id or None, True
    return routing.sandbox_in_path(request.path), False


def session_of(request: web.Request) -> tuple[str | None, bool]:
    """(the session a request is for, whether it came on its session host)."""
    found = request.config_dict[hosts.HOSTS_KEY].classify(request.host)
    if isinstance(found, hosts.SessionHost):
        return found.name, True
    if found is not None:
        return None, True
    return routing.session_in_path(request.path), False


def _decide(request: web.Request, node: ClusterNode, forwarded_by: str | None
            ) -> tuple[routing.Decision | None, bool]:
    """(where the request is served: None = not for one sandbox or session, whether it came
    on a preview/session host). A session is resolved by its fleet record."""
    name, on_host = session_of(request)
    if name is not None:
        record = node.routes.session(name)
        sandbox_id = record.sandbox_id if record is not None else ""
        return routing.decide_session(
            name, record, node.routes.route(sandbox_id) if sandbox_id else None,
            node.routes.address, node.config.host, forwarded_by=forwarded_by,
            fenced=node.fenced, arriving=bool(sandbox_id) and node.arriving(sandbox_id),
            put=request.method == "PUT" and not on_host), on_host
    sandbox_id, on_host = sandbox_of(request)
    if sandbox_id is None:
        return None, on_host
    return routing.decide(sandbox_id, node.routes.route(sandbox_id), node.config.host,
                          forwarded_by=forwarded_by, fenced=node.fenced,
                          arriving=node.arriving(sandbox_id)), on_host


@web.middleware
async def cluster_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    node = request.app.get(NODE_KEY)
    if node is None:
        return await handler(request)
    forwarded_by = request.headers.get(routing.HOP_HEADER)
    decision, on_host = _decide(request, node, forwarded_by)
    if decision is None:
        if request.method == "POST" and request.path == "/v1/sandboxes" and not on_host:
            return await _create(request, handler, node)
        if not on_host and cluster_list.is_list(request):
            return await cluster_list.fleet_list(request, handler, node,
                                                 request.app[FORWARDER_KEY].session())
        return await handler(request)
    if _new_session(request, node, on_host):  # its sandbox is placed as a create is
        return await _create(request, handler, node)
    try:
        if isinstance(decision, routing.Forward):
            return await request.app[FORWARDER_KEY].forward(
                request, decision.host, decision.address,
                live=lambda host=decision.host: node.routes.host_live(host))
        if isinstance(decision, routing.Refuse):
            raise _REFUSALS[decision.code](  # all of them pass: a retry may be served
                decision.message, headers={"Retry-After": "1"})
    except ApiError as exc:
        if not on_host:
            raise
        return hosts.error_page(request, exc.status, exc.code, str(exc), exc.headers)
    client = routing.client_of(forwarded_by, request.remote,
                               request.headers.get("X-Forwarded-For", ""),
                               node.routes.addresses())
    served = request.clone(remote=client) if client else request
    try:
        return await handler(served)
    except SandboxMoved as moved:
        # Held through a drain's move (or its route not yet seen here): the new owner
        # serves it. Only requests that never reached the guest end here.
        return await _to_new_owner(served, node, moved, on_host)


def _new_session(request: web.Request, node: ClusterNode, on_host: bool) -> bool:
    """A ``PUT /v1/sessions/{name}`` for a name the fleet does not know."""
    if request.method != "PUT" or on_host:
        return False
    name = routing.session_in_path(request.path)
    return (name is not None and request.path == f"/v1/sessions/{name}"
            and node.routes.session(name) is None)


async def _to_new_owner(request: web.Request, node: ClusterNode, moved: SandboxMoved,
                        on_host: bool) -> web.StreamResponse:
    # Sent on even when another host forwarded it here: it was meant for the owner, and the
    # owner moved (each move sends it on at most once more).
    owner = node.routes.table.hosts.get(moved.host)
    if owner is None or owner.name == node.config.host:
        if on_host:  # the new owner has no live record: the client retries
            return hosts.error_page(request, moved.status, moved.code, str(moved),
                                    moved.headers)
        raise moved
    return await request.app[FORWARDER_KEY].forward(request, owner.name, owner.address)


async def _create(request: web.Request, handler: Handler, node: ClusterNode
                  ) -> web.StreamResponse:
    """A create: refused when fenced (its record could not be published); else made
    where placement says, forwarded once (the chosen host answers, full or not)."""
    if node.fenced is not None:
        raise HostFenced(f"host {node.config.host} is fenced ({node.fenced}): it "
                         "creates no sandboxes until it rejoins the fleet")
    if request.headers.get(routing.HOP_HEADER) is None or node.draining:
        decision = node.place_create()
        if isinstance(decision, routing.Forward):
            return await request.app[FORWARDER_KEY].forward(request, decision.host,
                                                            decision.address)
        if node.draining:  # placement never chooses a draining host, not even itself
            raise Unavailable(f"host {node.config.host} is being drained and no other host "
                              "can take a sandbox now: retry", headers={"Retry-After": "5"})
    return await handler(request)


def attach(app: web.Application, node: ClusterNode, forwarder: Forwarder) -> None:
    """Start routing through ``node`` (called once it has joined)."""
    app[FORWARDER_KEY] = forwarder
    app[NODE_KEY] = node


async def detach(app: web.Application) -> None:
    forwarder = app.get(FORWARDER_KEY)
    if forwarder is not None:
        await forwarder.aclose()
