"""Which host serves a sandbox, known locally: a route cache fed by one etcd watch.

Theory: the cache is a copy of ``{prefix}/hosts/`` and ``{prefix}/sandboxes/`` as of one
revision, moved forward by the watch of the whole ``{prefix}/`` directory from the revision
after it. ``RouteTable`` is that copy with no I/O (load a listing, apply events, answer a
lookup); ``RouteCache`` lists in pages at one revision, starts a ``Watcher`` after it, and on
``Compacted`` (it fell too far behind) lists again and restarts: the list-then-watch pattern
every etcd and Kubernetes client uses, with etcd's revision as the only clock.

A lookup says who owns a sandbox, in which generation, and whether that host is live (has a
record, so its lease holds). A record that does not parse is left out and logged, never
allowed to poison the table. Nothing forwards requests with this yet (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, Compacted, ProtocolError
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.records import HostRecord, SandboxRecord, SessionRecord
from gateway.cluster.watch import Watcher
from gateway.cluster import tasks

log = logging.getLogger(__name__)
PAGE = 500


@dataclass(frozen=True)
class Route:
    sandbox_id: str
    host: str
    gen: int
    address: str | None  # None: the owner has no record (dead, or not yet rejoined)
    record: SandboxRecord

    @property
    def live(self) -> bool:
        return self.address is not None


@dataclass
class RouteTable:
    keys: Keys
    revision: int = 0
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    sandboxes: dict[str, SandboxRecord] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)  # hosts marked by `agentbox-server drain`
    sessions: dict[str, SessionRecord] = field(default_factory=dict)  # fleet session names
    skipped: int = 0  # records that did not parse

    def load(self, revision: int, kvs: list[wire.KeyValue]) -> None:
        """Replace everything with a listing read at ``revision``."""
        self.hosts.clear()
        self.sandboxes.clear()
        self.draining.clear()
        self.sessions.clear()
        for kv in kvs:
            self._put(kv)
        self.revision = revision

    def apply(self, events: tuple[wire.Event, ...]) -> None:
        for event in events:
            if event.kv.mod_revision <= self.revision:
                continue  # already in the listing
            if event.type is wire.EventType.DELETE:
                self._delete(event.kv.key)
            else:
                self._put(event.kv)
        if events:
            self.revision = max(self.revision, max(e.kv.mod_revision for e in events))

    def route(self, sandbox_id: str) -> Route | None:
        record = self.sandboxes.get(sandbox_id)
        if record is None:
            return None
        host = self.hosts.get(record.host)
        return Route(sandbox_id, record.host, record.gen, host.address if host else None,
                     record)

    def _put(self, kv: wire.KeyValue) -> None:
        key = kv.key.decode(errors="replace")
        try:
            if key.startswith(self.keys.hosts):
                host = HostRecord.decode(kv.value)
                self.hosts[host.name] = host
            elif key.startswith(self.keys.sandboxes):
                sandbox = SandboxRecord.decode(kv.value)
                self.sandboxes[sandbox.id] = sandbox
            elif key.startswith(self.keys.draining):
                self.draining.add(key[len(self.keys.draining):])
            elif key.startswith(self.keys.sessions):
                session = SessionRecord.decode(kv.value)
                self.sessions[session.name] = session
        except ProtocolError as exc:
            self.skipped += 1
            log.warning("route cache: skipping %s: %s", key, exc)

    def _delete(self, raw_key: bytes) -> None:
        key = raw_key.decode(errors="replace")
        if key.startswith(self.keys.hosts):
            self.hosts.pop(key[len(self.keys.hosts):], None)
        elif key.startswith(self.keys.sandboxes):
            self.sandboxes.pop(key[len(self.keys.sandboxes):], None)
        elif key.startswith(self.keys.draining):
            self.draining.discard(key[len(self.keys.draining):])
        elif key.startswith(self.keys.sessions):
            self.sessions.pop(key[len(self.keys.sessions):], None)


class RouteCache:
    """Owns the listing and the watcher; ``aclose()`` stops both."""

    def __init__(self, client: EtcdClient, keys: Keys, *, name: str = "routes",
                 probe_after: float = 2.0) -> None:
        self.client, self.keys, self.name, self.probe_after = client, keys, name, probe_after
        self.table = RouteTable(keys)
        # Called after each change is applied with its events, and with None after a
        # listing (everything may have changed): the node's adopter and reaper.
        self.listeners: list[Callable[[tuple[wire.Event, ...] | None], None]] = []
        self.relists = 0
        self._watcher: Watcher | None = None
        self._relist_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def directory(self) -> str:
        return self.keys.prefix + "/"

    def route(self, sandbox_id: str) -> Route | None:
        return self.table.route(sandbox_id)

    def session(self, name: str) -> SessionRecord | None:
        """The fleet's record of session ``name`` (None: no host holds it)."""
        return self.table.sessions.get(name)

    def address(self, host: str) -> str | None:
        """Host ``host``'s advertised address (None: it has no record)."""
        record = self.table.hosts.get(host)
        return record.address if record else None

    def host_live(self, name: str) -> bool:
        """Whether host ``name`` has a record (is live to the fleet)."""
        return name in self.table.hosts

    def live_hosts(self) -> dict[str, str]:
        """Every live host's name and advertised address (this host's too)."""
        return {name: h.address for name, h in self.table.hosts.items()}

    def owners_of(self, tenant: str) -> set[str]:
        """The hosts the records of ``tenant``'s sandboxes name, live or not."""
        return {r.host for r in self.table.sandboxes.values() if r.tenant == tenant}

    def addresses(self) -> set[str]:
        """The IP (or name) part of every live host's advertised address."""
        return {h.address.rsplit(":", 1)[0].strip("[]") for h in self.table.hosts.values()}

    async def start(self) -> None:
        """List at one revision, then watch from the next. Raises ClusterError when etcd
        cannot be listed (the caller retries or gives up)."""
        revision, kvs = await self._list()
        self.table.load(revision, kvs)
        self._tell(None)
        self._watch_from(revision + 1)

    def _applied(self, events: tuple[wire.Event, ...]) -> None:
        self.table.apply(events)
        self._tell(events)

    def _tell(self, events: tuple[wire.Event, ...] | None) -> None:
        for listener in list(self.listeners):
            try:
                listener(events)
            except Exception:
                log.exception("route cache listener %r failed", listener)

    async def _list(self) -> tuple[int, list[wire.KeyValue]]:
        """Every key under the directory, in pages, all read at the first page's revision."""
        end = wire.prefix_end(self.directory)
        start: bytes = self.directory.encode()
        kvs: list[wire.KeyValue] = []
        revision = 0
        while True:
            page = await self.client.range(start, end, limit=PAGE, revision=revision)
            revision = revision or page.revision
            kvs.extend(page.kvs)
            if not page.more or not page.kvs:
                return revision, kvs
            start = page.kvs[-1].key + b"\0"

    def _watch_from(self, revision: int) -> None:
        self._watcher = Watcher(self.client, self.directory, wire.prefix_end(self.directory),
                                revision, self._applied, name=self.name,
                                on_error=self._watch_failed, probe_after=self.probe_after)
        self._watcher.start()

    def _watch_failed(self, exc: BaseException) -> None:
        if self._closed or not isinstance(exc, Compacted) or self._relist_task:
            return
        self._relist_task = asyncio.create_task(self._relist(), name=f"{self.name}-relist")

    async def _relist(self) -> None:
        """The watch fell behind compaction: list again (retrying) and watch from there."""
        try:
            if self._watcher is not None:
                await self._watcher.aclose()
            while not self._closed:
                try:
                    revision, kvs = await self._list()
                except ClusterError as exc:
                    log.warning("route cache relist failed (retrying): %s", exc)
                    await asyncio.sleep(0.5)
                    continue
                self.table.load(revision, kvs)
                self.relists += 1
                self._tell(None)
                self._watch_from(revision + 1)
                return
        finally:
            self._relist_task = None

    async def aclose(self) -> None:
        self._closed = True
        task = self._relist_task
        await tasks.stop(task)
        if self._watcher is not None:
            await self._watcher.aclose()
