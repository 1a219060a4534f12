"""Session names held fleet-wide: ``{prefix}/sessions/{name}`` = SessionRecord.

A session name is global (its host ``{name}.{session_domain}`` is), so with ``[cluster]`` on
a host reserves a name in etcd in the same step as its local INSERT (gateway.preview.sessions
calls ``reserve`` just before it): one transaction "the key is absent, then put our record",
which exactly one of two hosts racing for a name wins. The loser reads the winner's record
in the same transaction: another tenant's is a 409 ``session_name_taken``; the same
tenant's on another host means the session is being made there, and the PUT is forwarded
to that host (which answers it idempotently, as one host does). etcd not answering is a
503 ``unavailable`` with Retry-After: a name is never reserved locally alone.

``bind`` names the session's sandbox in the record once it is made (routing then follows
the sandbox to its owner), ``release`` deletes the record when the session is deleted
(guarded by the revision read, and only a record of this host and tenant), ``publish``
writes at start-up the records of sessions made before this host joined (only where the
key is absent; a name another host holds is logged, never overwritten; a row whose record
another host took over with its sandbox is returned, to be dropped). ``take_over`` moves
the session to this host when its sandbox did (gateway.cluster.session_takeover).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from gateway.cluster import wire
from gateway.cluster.errors import ClusterError, EtcdUncertain, ProtocolError
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.records import SessionRecord
from gateway.cluster.session_takeover import decide_takeover, row_of, sweep, taken
from gateway.errors import OwnerUnavailable, Unavailable

log = logging.getLogger(__name__)


def _unavailable(name: str, exc: Exception) -> Unavailable:
    return Unavailable(f"cannot reserve or release session name {name!r} in the fleet "
                       f"(etcd: {exc}): retry", headers={"Retry-After": "2"})


class SessionNames:
    def __init__(self, client: EtcdClient, keys: Keys, host: str,
                 cached: Callable[[], Iterable[SessionRecord]] = tuple) -> None:
        self.client, self.keys, self.host = client, keys, host
        self.cached = cached  # the route cache's session records (the periodic pass)

    def sweep(self, rows: Mapping[str, tuple[str, str | None]],
              tenant_of: Callable[[str], str | None]) -> tuple[list[str], list[str]]:
        """(names to take over, names whose row here is stale): session_takeover.sweep
        over the cached records."""
        return sweep(list(self.cached()), rows, tenant_of, self.host)

    async def reserve(self, name: str, tenant: str) -> tuple[str, str] | None:
        """Hold ``name`` for ``tenant`` on this host. None: held here (now or before);
        else (tenant, host) of the record that holds it. Unavailable when etcd does not
        say."""
        key = self.keys.session(name)
        mine = SessionRecord(name, tenant, self.host)
        try:
            try:
                txn = await self.client.txn(
                    [wire.compare(key, wire.Target.CREATE, 0)],
                    [wire.op_put(key, mine.encode())], [wire.op_get(key)])
            except EtcdUncertain:  # read back what landed
                kv = await self.client.get(key)
                held = SessionRecord.decode(kv.value) if kv else None
            else:
                if txn.succeeded:
                    return None
                kvs = txn.responses[0].kvs if txn.responses else ()
                held = SessionRecord.decode(kvs[0].value) if kvs else None
        except (ClusterError, ValueError) as exc:
            raise _unavailable(name, exc) from exc
        if held is None:  # deleted between the compare and the read: look again
            return await self.reserve(name, tenant)
        if held.tenant == tenant and held.host == self.host:
            return None
        return held.tenant, held.host

    async def bind(self, name: str, sandbox_id: str, **fields: Any) -> None:
        """Name the session's sandbox in its record, with what a host it moves to needs
        (``fields``: port, start, start_state, start_pid; best effort: until it lands,
        routing goes to the record's host, which is where the sandbox was made)."""
        await self._change(name, sandbox_id, fields=fields)

    async def take_over(self, name: str, tenant: str | None,
                        tenant_of: Callable[[str], str | None], *,
                        wait: bool = True) -> dict[str, Any] | None:
        """The session's registry row, to insert here, once this host holds its record,
        if its sandbox moved here (gateway.cluster.session_takeover decides; ``tenant_of``:
        the tenant of a sandbox registered here, else None). None: nothing to take
        (session_not_found). Raises OwnerUnavailable (503, Retry-After) while its sandbox
        is still arriving here (``wait``; else None) or etcd does not answer."""
        key = self.keys.session(name)
        for _ in range(3):
            try:
                kv = await self.client.get(key)
                record = SessionRecord.decode(kv.value) if kv else None
                verdict = decide_takeover(record, tenant,
                                          tenant_of(record.sandbox_id)
                                          if record and record.sandbox_id else None, self.host)
                if verdict == "absent" or (verdict == "wait" and not wait):
                    return None
                assert record is not None and kv is not None
                if verdict == "wait":
                    raise OwnerUnavailable(
                        f"session {name!r}: its sandbox {record.sandbox_id} is moving to this "
                        f"host from {record.host}: retry", headers={"Retry-After": "2"})
                mine = taken(record, self.host)
                txn = await self.client.txn(
                    [wire.compare(key, wire.Target.MOD, kv.mod_revision)],
                    [wire.op_put(key, mine.encode())])
            except (ClusterError, ValueError) as exc:
                raise OwnerUnavailable(f"session {name!r}: cannot take it over from the "
                                       f"fleet (etcd: {exc}): retry",
                                       headers={"Retry-After": "2"}) from exc
            if txn.succeeded:
                log.info("session %s: taken over from %s with its sandbox %s", name,
                         record.host, record.sandbox_id)
                return row_of(mine, time.time())
        raise OwnerUnavailable(f"session {name!r}: its record kept changing: retry",
                               headers={"Retry-After": "1"})

    async def release(self, name: str, tenant: str) -> None:
        """Delete this host's record of ``name`` (Unavailable when etcd does not say)."""
        try:
            await self._change(name, None, tenant=tenant, strict=True)
        except (ClusterError, ValueError) as exc:
            raise _unavailable(name, exc) from exc

    async def _change(self, name: str, sandbox_id: str | None, *, tenant: str | None = None,
                      strict: bool = False, fields: dict[str, Any] | None = None) -> None:
        key = self.keys.session(name)
        for _ in range(3):
            try:
                kv = await self.client.get(key)
                if kv is None:
                    return
                held = SessionRecord.decode(kv.value)
                if held.host != self.host or (tenant is not None and held.tenant != tenant):
                    log.warning("session %s: record held by %s/%s, not changed", name,
                                held.host, held.tenant)
                    return
                op = (wire.op_delete(key) if sandbox_id is None else
                      wire.op_put(key, replace(held, sandbox_id=sandbox_id,
                                               **(fields or {})).encode()))
                txn = await self.client.txn(
                    [wire.compare(key, wire.Target.MOD, kv.mod_revision)], [op])
                if txn.succeeded:
                    return
            except (ClusterError, ValueError) as exc:
                if strict:
                    raise
                log.warning("session %s: record not updated: %s", name, exc)
                return
        if strict:
            raise ProtocolError(f"session {name}: its record kept changing")

    async def publish(self, sessions: Iterable[dict[str, Any]]) -> list[str]:
        """Records for this host's sessions (registry rows) where none exists. Returns the
        names of the rows that are stale: the record is this tenant's, for the same
        sandbox, held by another host (it took the session over with its sandbox while
        this host was away): the caller drops those rows (never the sandbox: the
        adopter's eviction handles this host's copy of it)."""
        stale: list[str] = []
        for row in sessions:
            name, tenant, sandbox_id = row["name"], row["tenant"], row["sandbox_id"] or ""
            key = self.keys.session(name)
            try:
                record = SessionRecord(name, tenant, self.host, sandbox_id,
                                       **_fields(row))
            except ValueError as exc:
                log.error("session %s: not published: %s", name, exc)
                continue
            txn = await self.client.txn([wire.compare(key, wire.Target.CREATE, 0)],
                                        [wire.op_put(key, record.encode())], [wire.op_get(key)])
            if txn.succeeded:
                continue
            kvs = txn.responses[0].kvs if txn.responses else ()
            try:
                held = SessionRecord.decode(kvs[0].value) if kvs else None
            except ProtocolError:
                held = None
            if (held is not None and held.host != self.host and held.tenant == tenant
                    and sandbox_id and held.sandbox_id == sandbox_id):
                log.info("session %s: taken over by %s with its sandbox: dropping the "
                         "row here", name, held.host)
                stale.append(name)
            elif held is None or (held.host, held.tenant) != (self.host, tenant):
                log.error("session %s here (tenant %s) is held in the fleet by %s: two "
                          "hosts named sessions alike before joining; requests for it go "
                          "to the fleet's holder", name, tenant, held and held.host)
            elif sandbox_id and held.sandbox_id != sandbox_id:
                await self.bind(name, sandbox_id, **_fields(row))
        return stale


def _fields(row: dict[str, Any]) -> dict[str, Any]:
    """What a session's record carries of its registry row (for a takeover)."""
    return {"port": row["port"], "start": row["start"], "start_state": row["start_state"],
            "start_pid": row["start_pid"]}
