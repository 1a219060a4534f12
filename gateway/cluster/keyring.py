"""API keys valid on every host: the local registries kept equal through etcd.

Each host's SQLite registry stays the one place auth reads (``lookup_key``: no request
ever waits on etcd). With ``[cluster]`` on, ``KeyRing`` keeps ``{prefix}/apikeys/{id}``
and the registry equal in both directions:

* **out**: a key minted, changed or revoked here (the registry's ``key_listeners``), and
  every local key at join (keys made before this host joined, its bootstrap admin key
  included, become fleet keys), is written to etcd by compare-and-set on the revision
  read. Only what the registry stores crosses: id, name, **hash**, admin, created,
  limits, revoked; never a secret.
* **in**: one watch of the directory (from the revision listed at start) applies every
  change to the registry (``store_key``), which calls no listener, so nothing echoes.

``plan`` (no I/O) decides what to write: a local key etcd lacks, or one that differs
from etcd's copy. Revocation is final on both sides (``merge``; the registry's
``store_key``): a revocation racing an edit on another host survives it. Two hosts
changing one key's limits at once: the last write wins and every host converges to it.
A periodic pass (``scan_every``) also catches edits made behind the daemon's back
(``agentbox-server keys`` writes the SQLite file directly).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, Compacted, ProtocolError
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.watch import Watcher
from gateway.cluster import tasks
from gateway.store.registry import ApiKey

log = logging.getLogger(__name__)
MAX_RECORD = 16 << 10


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    hash: str
    admin: bool
    created_at: float
    limits: dict[str, Any] = field(default_factory=dict, hash=False)
    revoked: bool = False

    @classmethod
    def of(cls, key: ApiKey, key_hash: str) -> KeyRecord:
        return cls(key.id, key.name, key_hash, key.admin, key.created_at, dict(key.limits),
                   key.revoked)

    def api_key(self) -> ApiKey:
        return ApiKey(self.id, self.name, self.admin, self.created_at, dict(self.limits),
                      self.revoked)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> KeyRecord:
        if len(raw) > MAX_RECORD:
            raise ProtocolError(f"key record of {len(raw)} bytes is over {MAX_RECORD}")
        try:
            data = json.loads(raw)
            record = cls(str(data["id"]), str(data["name"]), str(data["hash"]),
                         bool(data["admin"]), float(data["created_at"]),
                         dict(data.get("limits") or {}), bool(data.get("revoked")))
        except (ValueError, TypeError, KeyError) as exc:
            raise ProtocolError(f"bad key record: {exc!r}") from exc
        if len(record.hash) != 64:
            raise ProtocolError(f"key record {record.id}: not a SHA-256 hash")
        return record


def merge(local: KeyRecord, fleet: KeyRecord | None) -> KeyRecord:
    """What to write for a local key: ours, but revoked if either copy is."""
    if fleet is None:
        return local
    return replace(local, revoked=local.revoked or fleet.revoked)


def plan(local: dict[str, KeyRecord], fleet: dict[str, KeyRecord]) -> list[KeyRecord]:
    """The records to write so etcd holds every local key as it is here (no I/O)."""
    out = []
    for key_id, record in sorted(local.items()):
        want = merge(record, fleet.get(key_id))
        if want != fleet.get(key_id):
            out.append(want)
    return out


class KeyStore(Protocol):
    """What the ring needs of the registry (gateway.store.registry.Registry)."""

    def keys_with_hashes(self) -> list[tuple[ApiKey, str]]: ...

    def store_key(self, key: ApiKey, key_hash: str) -> None: ...


class KeyRing:
    def __init__(self, client: EtcdClient, keys: Keys, store: KeyStore, *,
                 scan_every: float = 5.0, backoff: float = 1.0) -> None:
        self.client, self.keys, self.store = client, keys, store
        self.scan_every, self.backoff = scan_every, backoff
        self.fleet: dict[str, KeyRecord] = {}  # etcd's copy, as watched
        self._revs: dict[str, int] = {}  # each key's mod_revision in etcd
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: Watcher | None = None
        self._writer: asyncio.Task[None] | None = None
        self._restarter: asyncio.Task[None] | None = None
        self.applied = 0

    def changed(self, key_id: str = "") -> None:
        """A registry key listener: something changed here; write it out soon. Safe
        from any thread (the registry is shared with threads; an Event is not)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def start(self) -> None:
        """List the directory, apply it here, watch from the next revision, and start the
        writer (which publishes this host's own keys). Raises ClusterError."""
        self._loop = asyncio.get_running_loop()
        directory = self.keys.api_keys
        result = await self.client.get_prefix(directory)
        self.apply(tuple(wire.Event(wire.EventType.PUT, kv) for kv in result.kvs))
        self._watcher = Watcher(self.client, directory, wire.prefix_end(directory),
                                result.revision + 1, self.apply, name="apikeys",
                                on_error=self._watch_failed)
        self._watcher.start()
        self._writer = asyncio.create_task(self._write_loop(), name="cluster-keyring")
        self._wake.set()

    def apply(self, events: tuple[wire.Event, ...]) -> None:
        """Watched changes into the registry (a delete is ignored: keys are revoked)."""
        for event in events:
            if event.type is wire.EventType.DELETE:
                continue
            try:
                record = KeyRecord.decode(event.kv.value)
            except ProtocolError as exc:
                log.warning("cluster: skipping key record %r: %s", event.kv.key, exc)
                continue
            self.fleet[record.id] = record
            self._revs[record.id] = event.kv.mod_revision
            self.store.store_key(record.api_key(), record.hash)
            self.applied += 1

    def _watch_failed(self, exc: BaseException) -> None:
        if isinstance(exc, Compacted) and self._restarter is None:  # rare: list again
            log.warning("cluster: key watch compacted; relisting")
            self._restarter = asyncio.create_task(self._restart(), name="keyring-relist")

    async def _restart(self, pause: float = 1.0) -> None:
        try:
            await self._stop()
            while True:
                try:
                    await self.start()
                    return
                except ClusterError as exc:
                    log.warning("cluster: relisting API keys failed (retrying): %s", exc)
                    await self._stop()
                    await asyncio.sleep(pause)
        finally:
            self._restarter = None

    def local(self) -> dict[str, KeyRecord]:
        return {k.id: KeyRecord.of(k, h) for k, h in self.store.keys_with_hashes()}

    async def _write_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.scan_every)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                for record in plan(self.local(), self.fleet):
                    await self._put(record)
            except ClusterError as exc:
                log.warning("cluster: publishing API keys failed, will retry: %s", exc)
                await asyncio.sleep(self.backoff)
                self._wake.set()

    async def _put(self, record: KeyRecord) -> None:
        """Compare-and-set on the revision we last saw; on a conflict re-read and merge."""
        key = self.keys.api_key(record.id)
        rev = self._revs.get(record.id, 0)
        guard = wire.compare(key, wire.Target.MOD, rev) if rev else \
            wire.compare(key, wire.Target.CREATE, 0)
        result = await self.client.txn([guard], [wire.op_put(key, record.encode())],
                                       [wire.op_get(key)])
        if result.succeeded:
            self.fleet[record.id] = record
            self._revs[record.id] = result.revision
            return
        kvs = result.responses[0].kvs if result.responses else ()
        if kvs:  # someone wrote it since: take theirs (the watch brings it too), retry
            self.apply((wire.Event(wire.EventType.PUT, kvs[0]),))
        self._wake.set()

    async def aclose(self) -> None:
        task, self._restarter = self._restarter, None
        await tasks.stop(task)
        await self._stop()

    async def _stop(self) -> None:
        task, self._writer = self._writer, None
        await tasks.stop(task)
        if self._watcher is not None:
            await self._watcher.aclose()
            self._watcher = None
