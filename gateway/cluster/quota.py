"""A key's sandbox limits across the fleet: per-host usage in etcd, creates checked by txn.

Each host publishes, per tenant (API key id), how many of the tenant's sandboxes it has
and how many are awake: ``{prefix}/usage/{tenant}/{host}`` = ``{"sandboxes", "awake"}``,
rewritten after each of the tenant's local transitions (the registry's listeners) and
at start. It is not on the host's lease: a dead host's sandboxes still exist (until the
reaper decides), so they still count.

A create on host H (``check``) reads the tenant's directory (one linearizable range at
revision R), adds the other hosts' counts to H's own (read from H's registry, exact),
(or its own record's, when higher: creates in flight here reserved there),
applies the usual decision (``gateway.tenancy.quotas.check_create``) and then **reserves**
with one transaction: "no key in the tenant's directory changed after R; then H's count
is its own + 1". Two creates for one tenant on two hosts at once cannot both pass: the
second's compare fails, it reads again and decides again (up to ``attempts`` times, then
409 asking to retry). H's later usage write (the sandbox's CREATING record committed)
replaces the reservation with the real count.

The race window that remains: a reservation is replaced by H's next usage write for the
tenant, which normally is the new sandbox's own insert. A create that fails before its
insert (a bad template, a failed build) leaves the +1 until the next write (the next
transition of that tenant here, or the periodic pass, ``scan_every``) - it over-counts,
never under-counts. Wakes (``max_awake`` on resume) and disk (``max_disk_mib``) are still
checked per host.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster import tasks
from gateway.errors import QuotaExceeded, Unavailable
from gateway.store.feed import Transition
from gateway.tenancy import quotas
from gateway.tenancy.quotas import Limits, Usage

log = logging.getLogger(__name__)


def encode(usage: Usage) -> bytes:
    return json.dumps({"sandboxes": usage.sandboxes, "awake": usage.awake}).encode()


def counts(keys: Keys, tenant: str, host: str, kvs: Iterable[wire.KeyValue]
           ) -> tuple[Usage, Usage]:
    """(every other host's published usage for ``tenant`` summed, ``host``'s own record)
    (no I/O); a record that does not parse counts as nothing (logged)."""
    directory = keys.usage_of(tenant)
    other, mine = [0, 0], [0, 0]
    for kv in kvs:
        into = mine if keys.name_in(directory, kv.key) == host else other
        try:
            data = json.loads(kv.value)
            into[0] += max(0, int(data["sandboxes"]))
            into[1] += max(0, int(data["awake"]))
        except (ValueError, TypeError, KeyError):
            log.warning("cluster: skipping usage record %r", kv.key)
    return Usage(*other), Usage(*mine)


def here(local: Usage, mine: Usage) -> Usage:
    """This host's count: its registry's, or its record's when higher (creates in flight
    here have reserved there before their insert)."""
    return Usage(max(local.sandboxes, mine.sandboxes), max(local.awake, mine.awake),
                 local.disk_bytes)


def total(local: Usage, other: Usage) -> Usage:
    return Usage(local.sandboxes + other.sandboxes, local.awake + other.awake,
                 local.disk_bytes)


class FleetQuota:
    def __init__(self, client: EtcdClient, keys: Keys, host: str,
                 usage: Callable[[str], Usage], tenants: Callable[[], set[str]], *,
                 attempts: int = 5, scan_every: float = 5.0, backoff: float = 1.0) -> None:
        self.client, self.keys, self.host = client, keys, host
        self.usage, self.tenants = usage, tenants
        self.attempts, self.scan_every, self.backoff = attempts, scan_every, backoff
        self._dirty: set[str] = set()
        self._written: dict[str, Usage] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def heard(self, transition: Transition) -> None:
        """A registry listener: the tenant's usage here may have changed."""
        self._dirty.add(transition.tenant)
        self._wake.set()

    def start(self) -> None:
        self._dirty |= self.tenants()
        self._task = asyncio.create_task(self._run(), name=f"cluster-quota:{self.host}")
        self._wake.set()

    async def check(self, tenant: str, limits: Limits, local: Usage, disk_mib: int = 0
                    ) -> None:
        """Raise QuotaExceeded unless one more sandbox of ``tenant`` fits its limits
        counted over the fleet, and reserve it; Unavailable (503) when etcd does not
        answer (a limit that cannot be checked is not waived)."""
        if not (limits.max_sandboxes or limits.max_awake):
            return
        try:
            await self._reserve(tenant, limits, local, disk_mib)
        except ClusterError as exc:
            raise Unavailable(f"cannot count key {tenant}'s sandboxes across the fleet "
                              f"(etcd: {exc}): retry",
                              headers={"Retry-After": "5"}) from exc

    async def _reserve(self, tenant: str, limits: Limits, local: Usage, disk_mib: int
                       ) -> None:
        directory = self.keys.usage_of(tenant)
        end = wire.prefix_end(directory)
        own_key = self.keys.usage(tenant, self.host)
        for _ in range(self.attempts):
            result = await self.client.get_prefix(directory)
            other, mine = counts(self.keys, tenant, self.host, result.kvs)
            ours = here(local, mine)
            quotas.check_create(tenant, limits, total(ours, other), disk_mib)
            reserved = Usage(ours.sandboxes + 1, ours.awake + 1)
            unchanged = {**wire.compare(directory, wire.Target.MOD, result.revision + 1,
                                        "LESS"), "range_end": wire.b64(end)}
            txn = await self.client.txn([unchanged], [wire.op_put(own_key, encode(reserved))])
            if txn.succeeded:
                self._written[tenant] = reserved
                return
        raise QuotaExceeded(f"key {tenant}: too many concurrent creates across the fleet; "
                            "retry")

    async def _mine_in_etcd(self) -> set[str]:
        """Tenants with a usage record of this host (some may have none here any more:
        destroyed while the daemon was down); empty if etcd does not answer now."""
        try:
            result = await self.client.get_prefix(self.keys.usage_root)
        except ClusterError as exc:
            log.warning("cluster: listing usage records failed: %s", exc)
            return set()
        found = set()
        for kv in result.kvs:
            tenant, _, host = self.keys.name_in(self.keys.usage_root, kv.key).partition("/")
            if host == self.host:
                found.add(tenant)
        return found

    async def _run(self) -> None:
        self._dirty |= await self._mine_in_etcd()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.scan_every)
            except TimeoutError:
                self._dirty |= set(self._written) | self.tenants()
            self._wake.clear()
            for tenant in sorted(self._dirty):
                self._dirty.discard(tenant)
                try:
                    await self._write(tenant)
                except (ClusterError, ValueError) as exc:
                    log.warning("cluster: publishing %s's usage failed: %s", tenant, exc)
                    self._dirty.add(tenant)
            if self._dirty:
                await asyncio.sleep(self.backoff)
                self._wake.set()

    async def _write(self, tenant: str) -> None:
        usage = self.usage(tenant)
        usage = Usage(usage.sandboxes, usage.awake)
        if self._written.get(tenant) == usage:
            return
        key = self.keys.usage(tenant, self.host)
        if usage.sandboxes:
            await self.client.put(key, encode(usage))
        else:
            await self.client.delete(key)
        self._written[tenant] = usage

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await tasks.stop(task)
