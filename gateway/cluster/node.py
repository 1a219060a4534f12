"""This daemon as a member of the fleet: the one owner of everything cluster-related.

The app starts a ``ClusterNode`` only when ``[cluster] enabled = true`` (gateway.http.app);
without it nothing here runs and one host is exactly as before. Started, the node joins (its
host record on a lease), republishes its load when it changes, keeps a route cache of the
fleet, publishes its sandboxes' records (``Publisher``), and when fenced stops acting as
an owner (the routing middleware refuses its sandboxes with ``host_fenced``) and tries to
rejoin with a new lease: once it has, it publishes every local sandbox again.

Start-up fails if etcd cannot be reached or the host name is held: a fleet member that
silently runs alone is worse than one that does not start. A restart soon after a crash
finds its own previous record still on the old lease; it waits one TTL for that to expire.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cluster.config import ClusterConfig
from gateway.cluster.errors import ClusterError, Fenced
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.membership import HostNameTaken, Membership, MemberState
from gateway.cluster import wire
from gateway.cluster.records import MAX_BASES, HostRecord, SandboxRecord
from gateway.cluster.routes import RouteCache
from gateway.cluster import tasks
from gateway.sandbox.states import State
from gateway.tenancy.quotas import usage_of

if TYPE_CHECKING:
    from gateway.cluster.adopter import Adopter
    from gateway.cluster.objstore import ObjectStore
    from gateway.cluster.reaper import ReaperLoop
    from gateway.cluster.ownership import Ownership
    from gateway.cluster.routing import Forward, ServeHere
    from gateway.cluster.shipper import Shipper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    total_mib: int
    free_mib: int
    total_vcpus: int
    free_vcpus: int
    awake: int


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in MiB from /proc/meminfo's text; 0 when missing."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable") and rest.split():
            values[name] = int(rest.split()[0]) // 1024
    return values.get("MemTotal", 0), values.get("MemAvailable", 0)


def load_of(meminfo: str, cpus: int, sandboxes: list[tuple[State, int]]) -> Load:
    """The load a host publishes (no I/O): RAM from meminfo, vCPUs left after the awake
    sandboxes' (``sandboxes``: each one's state and vCPUs), and how many are awake."""
    total, free = parse_meminfo(meminfo)
    usage = usage_of(state for state, _ in sandboxes)
    awake_vcpus = sum(v for state, v in sandboxes if usage_of([state]).awake)
    return Load(total, free, cpus, max(0, cpus - awake_vcpus), usage.awake)


class ClusterNode:
    def __init__(self, config: ClusterConfig, load: Callable[[], Load], *,
                 publish_every: float = 5.0, rng: random.Random | None = None,
                 bases: Callable[[], Collection[str]] = tuple,
                 reap_every: float = 3.0) -> None:
        if not config.enabled:
            raise ValueError("ClusterNode needs [cluster] enabled = true")
        self.config, self.load, self.publish_every = config, load, publish_every
        self.keys = config.keys
        self.client = EtcdClient(config.endpoints, timeout=config.timeout)
        self.membership: Membership | None = None
        self.routes = RouteCache(self.client, self.keys)
        self.fenced: str | None = None
        # Imported here: with [cluster] off the daemon imports no more of the cluster than
        # before routing existed (tests/unit/test_cluster_forward.py checks).
        from gateway.cluster.ownership import Ownership
        from gateway.cluster.publisher import Publisher

        from gateway.cluster.placement import Request

        self.publisher = Publisher(Ownership(self.client, self.keys), config.host,
                                   self._lease, timeout=config.timeout)
        self.local: Callable[[], list[tuple[str, State]]] = list
        self.shipper: Shipper | None = None
        self.adopter: Adopter | None = None
        self._objstore: ObjectStore | None = None
        # The base images this host holds (gateway.sandbox.shipped.local_bases), published
        # in its record so the reaper moves a snapshot only to a host that can restore it.
        self.bases = bases
        # May a record naming this host that it has no row for be adopted (the app wires
        # gateway.sandbox.adoption.adoptable); such records are not deleted at a sync.
        self.adoptable: Callable[[str], bool] = lambda sandbox_id: False
        if config.objstore_endpoint:
            self.shipper, self._objstore = _shipper(config, Ownership(self.client, self.keys),
                                                    self._lease)
        from gateway.cluster.adopter import Adopter

        # Without an object store nothing is shipped, but the reaper still gives this host
        # dead hosts' sandboxes FAILED: the adopter registers them (with nothing), so their
        # owners see why and can delete them.
        self.adopter = Adopter(config.host, self._objstore,
                               Ownership(self.client, self.keys), self._lease)
        # A local copy whose published record its new owner deleted goes the eviction's way.
        self.publisher.discard = self.adopter.discard
        self.publisher.relist = lambda: self.local()
        from gateway.cluster.election import Election
        from gateway.cluster.reaper import ReaperLoop

        self.reaper: ReaperLoop = ReaperLoop(
            Election(self.client, self.keys, "reaper"), Ownership(self.client, self.keys),
            self.routes.table, config.host, self._lease, grace=config.reap_after,
            every=reap_every, k=config.placement_choices)
        self.routes.listeners.append(self._routes_changed)
        self._reaping: asyncio.Task[None] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._rejoiner: asyncio.Task[None] | None = None
        # Placement of creates (routing.place): seeded in tests. What a create is assumed
        # to need: the middleware does not read the body (it streams it to the chosen host).
        self.rng = rng or random.Random()
        self.create_request = Request(memory_mib=256, vcpus=1)
        # Closed with the node, before the client (the key ring, the fleet quota).
        self.parts: list[Callable[[], Awaitable[None]]] = []
        self.drainer: Any = None  # gateway.cluster.drain.Drainer, once started

    def arriving(self, sandbox_id: str) -> bool:
        """Is ``sandbox_id`` being adopted here right now (moved here, not yet registered)?"""
        return self.adopter is not None and self.adopter.adopting(sandbox_id)

    def place_create(self) -> ServeHere | Forward:
        from gateway.cluster.routing import place

        from gateway.cluster.drain import eligible

        table = self.routes.table  # a draining host is never chosen (nor is this one if it is)
        hosts = eligible(table.hosts.values(), table.draining)
        return place(hosts, self.config.host, self.create_request,
                     k=self.config.placement_choices, rng=self.rng)

    @property
    def draining(self) -> bool:
        """This host is marked draining (``agentbox-server drain``)."""
        return self.config.host in self.routes.table.draining

    def start_drainer(self, local: Callable[[], list[tuple[str, State]]], move: Any,
                      admin_key: Callable[[], str], *, hand_over: Any = None,
                      shape: Callable[[str], Any] | None = None) -> None:
        """Drain this host whenever it is marked (gateway/cluster/drain.py); stopped with
        the node. ``hand_over``: gateway.sandbox.migration.hand_over (suspended sandboxes,
        with an object store); ``shape``: a sandbox's placement Request. Every sandbox it
        moves is in the adopter's ``busy`` set meanwhile (not evicted under the move)."""
        from gateway.cluster.drain import Drainer

        table = self.routes.table
        adopter = self.adopter

        def after(sandbox_id: str) -> None:  # a move ended: the adopter looks at it again
            record = table.sandboxes.get(sandbox_id)
            if adopter is not None and record is not None:
                adopter.consider(record)

        drainer = Drainer(self.config.host, self.client, self.keys,
                          lambda: list(table.hosts.values()), lambda: table.draining, local,
                          move, admin_key, rng=self.rng, records=lambda: table.sandboxes,
                          hand_over=hand_over if adopter is not None else None,
                          settled=self.publisher.settled,
                          busy=adopter.busy if adopter is not None else None, after=after,
                          k=self.config.placement_choices, shape=shape)
        self.drainer = drainer
        task = asyncio.get_running_loop().create_task(drainer.run(),
                                                      name=f"drain:{self.config.host}")

        async def stop() -> None:
            await tasks.stop(task)
        self.parts.append(stop)

    def _lease(self) -> int:
        return self.membership.lease if self.membership is not None else 0

    def __repr__(self) -> str:
        return f"<ClusterNode {self.config.host} {self.membership!r}>"

    def record(self) -> HostRecord:
        load = self.load()
        return HostRecord(self.config.host, self.config.advertise, load.total_mib,
                          load.free_mib, load.total_vcpus, load.free_vcpus, load.awake,
                          # only a host that can adopt (has the object store) offers bases
                          tuple(sorted(self.bases()))[:MAX_BASES] if self.adopter else ())

    async def start(self) -> None:
        """Join, list the fleet, start publishing. Raises ClusterError (cleaned up)."""
        try:
            await self._join()
            await self.routes.start()
        except BaseException:
            await self.aclose()
            raise
        self._publisher = asyncio.create_task(self._publish_loop(),
                                              name=f"cluster-publish:{self.config.host}")
        self.publisher.start()
        self._reaping = asyncio.create_task(self.reaper.run(),
                                            name=f"cluster-reaper:{self.config.host}")
        log.info("cluster: %s joined via %s (lease ttl %d s)", self.config.host,
                 ", ".join(self.config.endpoints), self.config.lease_ttl)

    async def _join(self) -> None:
        for attempt in range(2):
            self.membership = Membership(self.client, self.keys, self.record(),
                                         self.config.lease_ttl, self._on_fenced)
            try:
                await self.membership.join()
                return
            except HostNameTaken:
                if attempt:
                    raise
                log.warning("cluster: host name %s is held (our own record from before a "
                            "restart?); waiting one lease TTL", self.config.host)
                await asyncio.sleep(self.config.lease_ttl + 1)

    def publish_local(self, local: Callable[[], list[tuple[str, State]]]) -> None:
        """Publish every sandbox ``local()`` lists, now and after each rejoin."""
        self.local = local
        self._sync()

    def _sync(self) -> None:
        """Note every local sandbox, and DESTROYED for records naming this host that it
        no longer has (destroyed while the daemon was down), as the route cache lists."""
        local = self.local()
        have = {sandbox_id for sandbox_id, _ in local}
        gone = [(sandbox_id, State.DESTROYED) for sandbox_id, record
                in list(self.routes.table.sandboxes.items())
                if record.host == self.config.host and sandbox_id not in have
                and not self._kept(record)]
        for sandbox_id, record in list(self.routes.table.sandboxes.items()):
            if record.host == self.config.host and sandbox_id in have:
                self.publisher.held(sandbox_id)
        self.publisher.sync([*local, *gone])
        if self.adopter is not None:
            self.adopter.scan(self.routes.table.sandboxes.values())

    def _kept(self, record: SandboxRecord) -> bool:
        """A record naming this host that it has no sandbox for, kept: one to adopt (moved
        here), or FAILED with a reason (the reaper's or an adoption's words)."""
        if record.state is State.FAILED and record.reason:
            return True
        return record.state is State.SUSPENDED and bool(record.snapshot) \
            and self.adopter is not None and self.adoptable(record.id)

    def _routes_changed(self, events: tuple[wire.Event, ...] | None) -> None:
        """The route cache moved: records moved here are adopted, local copies of records
        moved away are evicted (the adopter), and a host record's delete wakes the reaper."""
        table = self.routes.table
        if events is None:
            for record in list(table.sandboxes.values()):
                if record.host == self.config.host:
                    self.publisher.held(record.id)
            if self.adopter is not None:
                self.adopter.scan(table.sandboxes.values())
            self.reaper.poke()
            return
        for event in events:
            key = event.kv.key.decode(errors="replace")
            if key.startswith(self.keys.hosts) and event.type is wire.EventType.DELETE:
                self.reaper.poke()
            elif key.startswith(self.keys.sandboxes) and self.adopter is not None:
                record = table.sandboxes.get(key[len(self.keys.sandboxes):])
                if record is not None and record.host == self.config.host:
                    self.publisher.held(record.id)  # e.g. moved here by a drain
                if record is not None:
                    self.adopter.consider(record)

    def _on_fenced(self, reason: str) -> None:
        self.fenced = reason
        log.error("cluster: %s is fenced (%s): it serves none of its sandboxes until it "
                  "rejoins", self.config.host, reason)
        if self._rejoiner is None:
            self._rejoiner = asyncio.create_task(self._rejoin(),
                                                 name=f"cluster-rejoin:{self.config.host}")

    async def _rejoin(self, pause: float = 1.0) -> None:
        """Fenced: a new lease and host record (retrying), then republish load and records.
        What a reaper moved away meanwhile stays moved: the publisher never overwrites a
        record another host holds."""
        try:
            old = self.membership
            if old is not None:
                await old.aclose()
            while True:
                try:
                    await self._join()
                    break
                except ClusterError as exc:
                    log.warning("cluster: %s cannot rejoin yet: %s", self.config.host, exc)
                    await asyncio.sleep(pause)
            task = self._publisher
            if task is None or task.done():
                self._publisher = asyncio.create_task(
                    self._publish_loop(), name=f"cluster-publish:{self.config.host}")
            self._sync()
            self.fenced = None
            log.warning("cluster: %s rejoined the fleet (lease %x)", self.config.host,
                        self._lease())
        finally:
            self._rejoiner = None

    async def _publish_loop(self) -> None:
        membership = self.membership
        assert membership is not None
        while membership.state is MemberState.SERVING:
            await asyncio.sleep(self.publish_every)
            try:
                record = self.record()
                if record != membership.record:
                    await membership.publish(record)
            except Fenced:
                return
            except ClusterError as exc:
                log.warning("cluster: publishing %s's load failed: %s", self.config.host, exc)
            except Exception:
                log.exception("cluster: measuring %s's load failed", self.config.host)

    async def aclose(self) -> None:
        """Idempotent: stop publishing, stop the route cache, leave (revoking the lease, so
        the record goes at once), close the client."""
        for task in (self._rejoiner, self._publisher, self._reaping):
            await tasks.stop(task)
        self._rejoiner = self._publisher = self._reaping = None
        if self.adopter is not None:
            await self.adopter.aclose()
        for close in reversed(self.parts):
            await close()
        self.parts.clear()
        await self.publisher.aclose()
        if self.shipper is not None:
            await self.shipper.aclose()
        if self._objstore is not None:
            await self._objstore.aclose()
        await self.routes.aclose()
        if self.membership is not None:
            await self.membership.aclose()
        await self.client.aclose()


def daemon_load(list_sandboxes: Callable[[], list[tuple[State, int]]],
                meminfo: Path = Path("/proc/meminfo")) -> Callable[[], Load]:
    """The daemon's load source: /proc/meminfo, the CPU count, and its sandboxes."""
    def measure() -> Load:
        return load_of(meminfo.read_text(), os.cpu_count() or 1, list_sandboxes())
    return measure


async def start_if_enabled(config: ClusterConfig,
                           list_sandboxes: Callable[[], list[tuple[State, int]]],
                           bases: Callable[[], Collection[str]] = tuple
                           ) -> ClusterNode | None:
    """The app's one call: None when ``[cluster]`` is off (nothing is created)."""
    if not config.enabled:
        return None
    node = ClusterNode(config, daemon_load(list_sandboxes), bases=bases)
    await node.start()
    return node


def _shipper(config: ClusterConfig, ownership: Ownership,
             lease: Callable[[], int]) -> tuple[Shipper, ObjectStore]:
    """[cluster] objstore_endpoint set: the uploader of suspended sandboxes' snapshots
    (its ``describe_local`` is set by the app, which knows the registry)."""
    from gateway.cluster.objstore import Credentials, ObjectStore
    from gateway.cluster.shipper import Shipper

    store = ObjectStore(config.objstore_endpoint, config.objstore_bucket, Credentials(
        config.objstore_access_key, config.objstore_secret_key, config.objstore_region),
        timeout=max(config.timeout, 10.0))

    async def nothing(sandbox_id: str) -> None:
        return None

    return Shipper(store, ownership, config.host, lease, nothing, key_prefix=config.key_prefix,
                   concurrency=config.upload_concurrency), store
