"""Application factory and daemon start-up.

Start-up order: registry (and the admin key on first start) -> templates and
the VMM backend -> golden snapshots (built if missing) -> reconcile sandboxes
left by a previous daemon -> serve. Shut-down releases host-side resources but
leaves VMMs running; the next start re-adopts them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.http import (
    sandbox_routes,
    build_routes,
    interp_routes,
    key_routes,
    migration_routes,
    template_routes,
    metrics,
    openapi,
)
from gateway.cluster import node as cluster_node
from gateway.store import at_rest
from gateway.sandbox import warm_pool
from gateway.preview import hosts, terminal
from gateway.http import control_routes, dashboard, events_routes, port_routes
from gateway.config import Config
from gateway.http.middleware import (
    REGISTRY_KEY,
    api_error_middleware,
    auth_middleware,
    error_middleware,
)
from gateway.http.ratelimit import (
    LIMITER_KEY,
    RateLimiter,
    address_rate_middleware,
    key_rate_middleware,
)
from gateway.store.registry import Registry
from gateway.sandbox.recovery import reconcile
from gateway.sandbox.service import SandboxService, current_wake
from gateway.sandbox.states import State
from vmctl import backend as vm_backend
from vmctl import dnsfwd, network
from vmctl.golden import Golden, ensure_golden

log = logging.getLogger(__name__)

CONFIG_KEY = web.AppKey("config", Config)


def ensure_admin_key(registry: Registry, data_dir: Path) -> Path | None:
    """On first start, mint an admin key into DATA_DIR/admin.key (mode 0600)."""
    if registry.has_admin_key():
        return None
    _, secret = registry.create_key("admin", admin=True)
    return at_rest.write_secret(data_dir / "admin.key", secret + "\n")


async def load_goldens(config: Config) -> tuple[vm_backend.Backend | None, dict[str, Golden]]:
    from images.catalog import load_template

    images = {}
    for name in config.sandbox.templates:
        image = load_template(name, config.server.images_dir)
        if image is None and config.build.background_builtins:
            log.info("template %r is not built yet: building it in the background", name)
            continue
        if image is None:
            log.error("template %r is not built in %s: run `make images` "
                      "(or `agentbox-server images build %s`)", name, config.server.images_dir,
                      name)
            continue
        _warn_if_stale(image)
        images[name] = image
    if not images:
        return None, {}
    first = next(iter(images.values()))
    backend = (await vm_backend.select(config.vm, first.kernel)).for_daemon(
        config.server.data_dir)
    goldens = {}
    for i, (name, image) in enumerate(images.items()):
        try:
            goldens[name] = await ensure_golden(image, backend, progress=log.info, build_slot=i)
        except Exception:
            log.exception("golden snapshot for template %r failed; template disabled", name)
    return backend, goldens


def _warn_if_stale(image) -> None:  # type: ignore[no-untyped-def]
    """Say so when a template was built from other guest code than this checkout's (the
    daemon would serve an agent that does not match the host side)."""
    from images.hashing import files_digest, snapshot_files
    from images.inputs import GUEST_DIR
    from images.manifest import read_manifest

    built = (read_manifest(image.dir) or {}).get("guest_digest")
    if built and built != files_digest(snapshot_files(GUEST_DIR)):
        log.warning("template %r was built from different guest/ code than this checkout: "
                    "run `make images` (or `agentbox-server images build %s`)", image.name,
                    image.name)


def build_app(config: Config) -> web.Application:
    routing: list[Any] = []
    if config.cluster.enabled:  # forwarding to other hosts (docs/cluster.md); off: not imported
        from gateway.http import cluster_forward
        routing = cluster_forward.middlewares(config.cluster)
    app = web.Application(
        # Rate limits sit either side of auth (gateway.http.ratelimit): per address, then per key.
        middlewares=[error_middleware, api_error_middleware, *routing, hosts.preview_middleware,
                     address_rate_middleware, auth_middleware, key_rate_middleware],
        client_max_size=config.server.max_json_bytes)
    app[CONFIG_KEY] = config
    app[sandbox_routes.MAX_UPLOAD_KEY] = config.server.max_upload_bytes
    app[key_routes.TENANCY_KEY] = config.tenancy
    app[LIMITER_KEY] = RateLimiter(config.tenancy)
    app[terminal.MAX_WS_KEY] = config.server.max_ws_message_bytes
    app.add_routes(sandbox_routes.routes)
    app.add_routes(interp_routes.routes)
    app.add_routes(build_routes.routes)  # before api_templates: /v1/templates/builds
    app[build_routes.MAX_CONTEXT_KEY] = config.build.max_context_bytes
    app.add_routes(template_routes.routes)
    app.add_routes(control_routes.routes)
    app.add_routes(key_routes.routes)
    app.add_routes(migration_routes.routes)
    app.add_routes(metrics.routes)
    app.add_routes(terminal.routes)
    app.add_routes(port_routes.routes)
    app.add_routes(openapi.routes)
    events_routes.setup(app)  # GET /v1/events (fed by the registry in _lifecycle)
    dashboard.setup(app)  # /dashboard: static files, a client of the API above
    app.cleanup_ctx.append(_lifecycle)
    hosts.setup(app, config)  # preview/session hosts, /v1/sessions, /v1/info (after _lifecycle)
    app.on_response_prepare.append(_wake_header)
    return app


WAKE_HEADER = "X-AgentBox-Wake-Ms"
POOL_HEADER = "X-AgentBox-Pool"


async def _wake_header(request: web.Request, response: web.StreamResponse) -> None:
    """Responses that had to wake their sandbox say so, and how long the wake took."""
    wake = current_wake.get()
    if wake is not None and wake.woke:
        response.headers[WAKE_HEADER] = f"{wake.wake_ms:.1f}"
    if warm_pool.claimed.get():  # a create answered from the warm pool
        response.headers[POOL_HEADER] = "claimed"


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    at_rest.private_dir(config.server.data_dir)
    registry = Registry(config.server.data_dir / "registry.sqlite")
    app[REGISTRY_KEY] = registry
    registry.listeners.append(app[events_routes.FEED_KEY].publish)
    key_path = ensure_admin_key(registry, config.server.data_dir)
    if key_path:
        log.warning("created the admin API key: %s (mode 0600)", key_path)
    # The sandboxes' DNS (vmctl.dnsfwd): every namespace made from here on is served by it.
    resolver = dnsfwd.Resolver(dnsfwd.upstream_from(config.vm.network.dns_upstream))
    network.RESOLVER = resolver
    serving = _serve(app, config, registry)
    try:
        await anext(serving)
        yield
    finally:
        await serving.aclose()  # stops the service (its finally) if it started
        await resolver.aclose()
        if network.RESOLVER is resolver:
            network.RESOLVER = None
        registry.close()


async def _serve(app: web.Application, config: Config,
                 registry: Registry) -> AsyncIterator[None]:
    backend, goldens = await load_goldens(config)
    if backend is None:
        raise RuntimeError(f"no template is built in {config.server.images_dir}: run `make images`")
    service = SandboxService(config, registry, backend, goldens)
    app[sandbox_routes.SERVICE_KEY] = service
    await reconcile(service)
    service.start()
    build_routes.attach(app, config, service)  # Dockerfile builds; built-ins still missing
    node = None
    try:
        # [cluster] (docs/cluster.md): off by default, and then nothing is created.
        node = await cluster_node.start_if_enabled(
            config.cluster, lambda: [(r.state, r.vcpus) for r in registry.list()],
            _bases_of(config))
        if node is not None:
            _adopt_through(service, node)
            _route_through(app, config, registry, node)
            await _share_keys_and_quotas(service, node)
            await _share_session_names(app, registry, node)
            _drain_through(app, config, service, node)
        log.info("agentbox ready on http://%s, dashboard at /dashboard (vmm %s/%s; "
                 "templates: %s)", config.server.listen, backend.driver_name, backend.accel.value,
                 ", ".join(sorted(goldens)) or "none")
        yield
    finally:
        if node is not None:
            from gateway.http import cluster_forward

            await cluster_forward.detach(app)
            for heard in (node.publisher.heard, node.shipper and node.shipper.heard):
                if heard in registry.listeners:
                    registry.listeners.remove(heard)
            await node.aclose()
        await build_routes.detach(app, service)
        await service.aclose()


def _bases_of(config: Config) -> Callable[[], Collection[str]]:
    """The base images (goldens) this host holds, by identity (docs/cluster.md)."""
    from gateway.sandbox.shipped import local_bases

    return lambda: local_bases(config.server.images_dir).keys()


def _adopt_through(service: SandboxService, node: cluster_node.ClusterNode) -> None:
    """[cluster] on: records moved here are adopted (fetched from the object store and
    registered SUSPENDED; FAILED ones with their last disk or with nothing), local copies
    of records moved away are destroyed."""
    if node.adopter is None:
        return
    from functools import partial

    from gateway.cluster.adopter import Local
    from gateway.sandbox import adoption

    registry = service.registry
    adoption.sweep(service.sandboxes_dir)

    def state(sandbox_id: str) -> State | None:
        rec = registry.get(sandbox_id)
        return None if rec is None or rec.state is State.DESTROYED else rec.state

    node.adoptable = partial(adoption.adoptable, registry)
    node.adopter.local = Local(state=state, adoptable=node.adoptable,
                               adopt=partial(adoption.adopt, service),
                               evict=partial(adoption.evict, service),
                               bases=node.bases,
                               discard=partial(adoption.discard, service))


def _route_through(app: web.Application, config: Config, registry: Registry,
                   node: cluster_node.ClusterNode) -> None:
    """[cluster] on: publish this host's sandboxes and forward others' requests."""
    from functools import partial

    from gateway.http import cluster_forward
    from gateway.preview.forward import Forwarder

    registry.listeners.append(node.publisher.heard)

    def describe(sandbox_id: str) -> dict[str, Any]:
        rec = registry.get(sandbox_id)
        return {} if rec is None else {"tenant": rec.tenant, "template": rec.template,
                                       "vcpus": rec.vcpus, "memory_mib": rec.memory_mib,
                                       "disk_mib": rec.disk_mib}

    node.publisher.describe = describe
    prefix = config.cluster.key_prefix  # which sandboxes' records etcd has held (publisher)
    node.publisher.landed = lambda sandbox_id, mark: registry.mark_published(
        sandbox_id, prefix, mark.epoch, mark.revision, mark.term)
    node.publisher.was_published = partial(registry.was_published, key_prefix=prefix)
    node.publish_local(lambda: [(r.id, r.state) for r in registry.list()])
    if node.shipper is not None:  # [cluster] objstore_endpoint: ship suspended snapshots
        from gateway.cluster.shipper import from_registry

        node.shipper.describe_local = from_registry(registry)
        registry.listeners.append(node.shipper.heard)
    server = config.server
    cluster_forward.attach(app, node, Forwarder(
        config.cluster.host, server.proxy_connect_timeout, server.proxy_read_timeout,
        server.max_ws_message_bytes))


def _drain_through(app: web.Application, config: Config, service: SandboxService,
                   node: cluster_node.ClusterNode) -> None:
    """[cluster] on: take sandboxes other hosts move here, and move this host's away while
    it is marked draining (docs/cluster.md, "Drain")."""
    from gateway.cluster.placement import Request
    from gateway.sandbox.migration import Arrivals, hand_over, move_sandbox

    # The migration streams come to the advertised address (its port: the daemon's own
    # API; each migration listens on a port of its own, chosen by the kernel).
    address = config.cluster.advertise.rsplit(":", 1)[0].strip("[]")
    arrivals = Arrivals(service, bind=address, advertise=address)
    app[migration_routes.ARRIVALS_KEY] = arrivals
    node.parts.append(arrivals.aclose)
    key_file = config.server.data_dir / "admin.key"

    def admin_key() -> str:
        return key_file.read_text().strip()

    async def move(sandbox_id: str, host: str, peer: Any, record_move: Any) -> Any:
        return await move_sandbox(service, sandbox_id, host, peer, record_move)

    async def give(sandbox_id: str, host: str, record_move: Any) -> None:
        await hand_over(service, sandbox_id, host, record_move)

    def shape(sandbox_id: str) -> Request:
        """The sandbox's own shape (its row; 0 = its golden's), for placement."""
        rec = service.registry.get(sandbox_id)
        if rec is None:
            raise LookupError(f"no sandbox {sandbox_id} here")
        if rec.vcpus and rec.memory_mib:
            return Request(memory_mib=rec.memory_mib, vcpus=rec.vcpus)
        golden = service.golden_for(rec)
        return Request(memory_mib=rec.memory_mib or golden.mem_mib,
                       vcpus=rec.vcpus or golden.vcpus)

    node.start_drainer(lambda: [(r.id, r.state) for r in service.registry.list()], move,
                       admin_key, hand_over=give, shape=shape)


async def _share_keys_and_quotas(service: SandboxService, node: cluster_node.ClusterNode
                                 ) -> None:
    """[cluster] on: API keys replicated through etcd (every host's registry stays the
    cache auth reads) and each key's sandbox limits counted over the fleet."""
    from gateway.cluster.keyring import KeyRing
    from gateway.cluster.quota import FleetQuota
    from gateway.tenancy.quotas import usage_of

    registry, host = service.registry, node.config.host
    ring = KeyRing(node.client, node.keys, registry)
    registry.key_listeners.append(ring.changed)

    async def close_ring() -> None:
        registry.key_listeners.remove(ring.changed)
        await ring.aclose()
    node.parts.append(close_ring)
    await ring.start()
    quota = FleetQuota(node.client, node.keys, host,
                       lambda t: usage_of(r.state for r in registry.list(t)),
                       lambda: {r.tenant for r in registry.list()})
    registry.listeners.append(quota.heard)

    async def close_quota() -> None:
        registry.listeners.remove(quota.heard)
        await quota.aclose()
    node.parts.append(close_quota)
    quota.start()
    service.fleet_quota = quota.check


async def _share_session_names(app: web.Application, registry: Registry,
                               node: cluster_node.ClusterNode) -> None:
    """[cluster] on: session names held fleet-wide (reserved in etcd with each INSERT;
    the session service, made after this, takes them from the app), this host's existing
    sessions published (docs/cluster.md, "Sessions across the fleet")."""
    from gateway.cluster.session_names import SessionNames
    from gateway.preview.sessions import FLEET_NAMES_KEY

    names = SessionNames(node.client, node.keys, node.config.host,
                         lambda: node.routes.table.sessions.values())
    for stale in await names.publish(registry.list_sessions(None)):
        registry.delete_session(stale)  # another host took it over with its sandbox
    app[FLEET_NAMES_KEY] = names


def serve(config: Config) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(build_app(config), config)


def run(app: web.Application, config: Config) -> None:
    """Serve ``app`` on ``[server] listen`` until a signal (bench/gateway.py runs this too)."""
    import uvloop

    # The fast lane serves running sandboxes' previews without the middlewares, so it would
    # bypass the cluster's fence and forwarding: off in a fleet (docs/cluster.md).
    if not config.server.fast_lane or config.cluster.enabled:
        web.run_app(app, host=config.server.host, port=config.server.port,
                    loop=uvloop.new_event_loop(), print=None, **server_options(config))
        return
    # run_app with the front lane's site (gateway.preview.fastlane) in place of its TCPSite.
    from gateway.preview import fastlane

    fastlane.run_app(app, fastlane.bind(config.server.host, config.server.port),
                     uvloop.new_event_loop(), **server_options(config))


def server_options(config: Config) -> dict[str, Any]:
    """How the HTTP server treats its clients (``run_app``/``AppRunner`` keyword arguments)."""
    return {
        "access_log": None, "handler_cancellation": True,
        "auto_decompress": False,  # the proxy passes bodies as-is
        # aiohttp arms this timer when a connection opens and again after each response,
        # and closes the connection if it fires while the request's headers are still
        # incomplete: the header-read timeout (slowloris) and the idle keep-alive limit.
        # It is not reset by bytes arriving, so headers sent a byte at a time are cut off.
        "keepalive_timeout": config.server.header_read_timeout,
    }
