"""Sandbox ownership records, changed only by compare-and-set transactions.

Theory: ``{prefix}/sandboxes/{id}`` says which host owns a sandbox and in which generation.
Every change is one etcd transaction guarded by what the writer last read:

- *create*: the key must not exist (create_revision == 0);
- *update* (the owner changes state or snapshot, same generation) and *move* (anyone moves
  it to another host, generation + 1): the key's mod_revision must equal the one read;
- an owner's writes (create, update, delete) also require ``{prefix}/hosts/{owner}`` to be
  attached to the owner's lease, so a host whose lease expired cannot write at all, even
  with a fresh mod_revision.

So two writers can never both win: the loser's compare fails and it gets what etcd holds
now (``OwnershipConflict.current``), including an owner that was moved away while it was
partitioned: its next write fails on the mod_revision, and the record it reads back has a
higher generation and another host. The transaction builders below do no I/O and are
unit-tested; ``Ownership`` sends them. A write whose answer was lost (``EtcdUncertain``) is
resolved by reading the record back.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

from gateway.cluster import wire
from gateway.cluster.errors import EtcdUncertain, OwnershipConflict
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.records import SandboxRecord
from gateway.sandbox.states import State


@dataclass(frozen=True)
class Versioned:
    """A record as read from (or written to) etcd, with the revision that last changed it."""

    record: SandboxRecord
    mod_revision: int


@dataclass(frozen=True)
class Plan:
    """One guarded write: the transaction, the record it installs (None: a delete), the
    generation the writer read (0: none) and the owner lease it relies on (0: none)."""

    key: str
    compares: list[dict[str, Any]]
    success: list[dict[str, Any]]
    failure: list[dict[str, Any]]
    new: SandboxRecord | None
    read_gen: int = 0
    owner: str = ""
    host_lease: int = 0
    read_mod: int = 0  # set when extra guards ride along: unchanged record = a guard failed


def _guarded(keys: Keys, key: str, first: dict[str, Any], op: dict[str, Any],
             new: SandboxRecord | None, read_gen: int, owner: str, host_lease: int) -> Plan:
    """``first`` on the sandbox key, plus the owner's host key on ``host_lease``. On failure
    read both back, so the loser learns which guard failed."""
    host_key = keys.host(owner)
    return Plan(key, [first, wire.compare(host_key, wire.Target.LEASE, host_lease)], [op],
                [wire.op_get(key), wire.op_get(host_key)], new, read_gen, owner, host_lease)


def plan_create(keys: Keys, record: SandboxRecord, host_lease: int) -> Plan:
    key = keys.sandbox(record.id)
    return _guarded(keys, key, wire.compare(key, wire.Target.CREATE, 0),
                    wire.op_put(key, record.encode()), record, 0, record.host, host_lease)


def plan_update(keys: Keys, current: Versioned, new: SandboxRecord, host_lease: int) -> Plan:
    """The owner rewrites its own record: same host, same generation."""
    if (new.id, new.host, new.gen) != (current.record.id, current.record.host,
                                       current.record.gen):
        raise ValueError("an update keeps id, host and gen; use a move to change owner")
    key = keys.sandbox(new.id)
    return _guarded(keys, key, wire.compare(key, wire.Target.MOD, current.mod_revision),
                    wire.op_put(key, new.encode()), new, current.record.gen, new.host,
                    host_lease)


def plan_move(keys: Keys, current: Versioned, to_host: str, state: State,
              guards: tuple[dict[str, Any], ...] = (), **changes: Any) -> Plan:
    """Hand the sandbox to ``to_host`` in the next generation (reaper, drain): guarded by
    the mod revision, not the old owner's lease (it may be dead), plus ``guards`` (the
    mover's ``LeaderKey.guard()``, so a deposed reaper cannot move anything). ``changes``:
    other fields of the new record (a FAILED one's ``reason``)."""
    new = dataclasses.replace(current.record.moved_to(to_host, state), **changes)
    key = keys.sandbox(new.id)
    return Plan(key, [wire.compare(key, wire.Target.MOD, current.mod_revision), *guards],
                [wire.op_put(key, new.encode())], [wire.op_get(key)], new, current.record.gen,
                read_mod=current.mod_revision if guards else 0)


def plan_delete(keys: Keys, current: Versioned, host_lease: int) -> Plan:
    key = keys.sandbox(current.record.id)
    return _guarded(keys, key, wire.compare(key, wire.Target.MOD, current.mod_revision),
                    wire.op_delete(key), None, current.record.gen, current.record.host,
                    host_lease)


def decode_versioned(kv: wire.KeyValue | None) -> Versioned | None:
    return None if kv is None else Versioned(SandboxRecord.decode(kv.value), kv.mod_revision)


def _first_kv(result: wire.TxnResult, index: int) -> wire.KeyValue | None:
    if len(result.responses) <= index or not isinstance(result.responses[index],
                                                         wire.RangeResult):
        return None
    kvs = result.responses[index].kvs
    return kvs[0] if kvs else None


def outcome(plan: Plan, result: wire.TxnResult) -> Versioned | None:
    """What a sent plan did: the new record, or OwnershipConflict with what etcd holds."""
    if result.succeeded:
        return None if plan.new is None else Versioned(plan.new, result.revision)
    current = decode_versioned(_first_kv(result, 0))
    lease_gone = False
    if plan.owner:
        host_kv = _first_kv(result, 1)
        lease_gone = host_kv is None or host_kv.lease != plan.host_lease
    raise OwnershipConflict(_why(plan, current, lease_gone), current)


def _why(plan: Plan, current: Versioned | None, lease_gone: bool = False) -> str:
    """Why a guarded write lost: the caller compares ``current`` with what it expected."""
    if current is None:
        held = "no record"
    else:
        held = f"gen {current.record.gen} on {current.record.host} at mod " \
               f"{current.mod_revision}"
    if current is not None and plan.read_gen and current.record.gen > plan.read_gen:
        return f"{plan.key}: stale generation {plan.read_gen}: etcd holds {held}"
    if current is not None and plan.read_mod and current.mod_revision == plan.read_mod:
        return f"{plan.key}: the mover's guard failed (no longer leader?): etcd holds {held}"
    if lease_gone:
        return f"{plan.key}: {plan.owner}'s lease {plan.host_lease:x} is gone: etcd holds {held}"
    if current is not None and not plan.read_gen:
        return f"{plan.key}: already exists: etcd holds {held}"
    return f"{plan.key}: changed since read: etcd holds {held}"


def _landed_earlier(plan: Plan, result: wire.TxnResult, expected_rev: int) -> bool:
    """A resent plan lost its compare: was that to an earlier copy of itself?"""
    current = decode_versioned(_first_kv(result, 0))
    if plan.new is None:
        return current is None
    return current is not None and current.record == plan.new \
        and current.mod_revision > expected_rev


@dataclass(frozen=True)
class Look:
    """A sandbox's record and the fleet epoch, read together at one ``revision``."""

    revision: int
    current: Versioned | None
    epoch: str | None  # None: etcd holds no epoch (wiped, or never written)
    term: int = 0  # etcd's raft term (a restored or new cluster starts a new raft log)


class Ownership:
    """The asyncio shell: sends plans, resolves lost answers by reading back."""

    def __init__(self, client: EtcdClient, keys: Keys) -> None:
        self.client, self.keys = client, keys

    async def get(self, sandbox_id: str) -> Versioned | None:
        return decode_versioned(await self.client.get(self.keys.sandbox(sandbox_id)))

    async def look(self, sandbox_id: str) -> Look:
        """The record and the fleet epoch in one read (no compares: always succeeds)."""
        result = await self.client.txn([], [wire.op_get(self.keys.sandbox(sandbox_id)),
                                            wire.op_get(self.keys.epoch)], [])
        epoch = _first_kv(result, 1)
        return Look(result.revision, decode_versioned(_first_kv(result, 0)),
                    None if epoch is None else epoch.value.decode(errors="replace"),
                    result.raft_term)

    async def epoch(self, replace: str | None = None) -> tuple[str, int, int]:
        """The fleet epoch, and the revision and raft term it was read at: written (a new
        random token) when etcd holds none, or when it still holds ``replace`` (etcd went
        back in time: every mark made under the old one stops counting). Compare-and-set,
        so hosts that race agree on one token."""
        key = self.keys.epoch
        for _ in range(3):
            token = secrets.token_hex(16)
            guard = wire.compare(key, wire.Target.CREATE, 0) if replace is None else \
                wire.compare(key, wire.Target.VALUE, replace.encode())
            result = await self.client.txn([guard], [wire.op_put(key, token)],
                                           [wire.op_get(key)])
            if result.succeeded:
                return token, result.revision, result.raft_term
            kv = _first_kv(result, 0)
            if kv is not None:
                return kv.value.decode(errors="replace"), result.revision, result.raft_term
            replace = None  # none at all (wiped meanwhile): write a first one
        raise EtcdUncertain(f"{key}: the fleet epoch keeps changing")

    async def list(self) -> tuple[int, dict[str, Versioned]]:
        """Every record and the revision they were read at (a watch starts after it)."""
        result = await self.client.get_prefix(self.keys.sandboxes)
        out = {}
        for kv in result.kvs:
            versioned = decode_versioned(kv)
            assert versioned is not None
            out[versioned.record.id] = versioned
        return result.revision, out

    async def create(self, record: SandboxRecord, host_lease: int) -> Versioned:
        return await self._send(plan_create(self.keys, record, host_lease), expected_rev=0)

    async def update(self, current: Versioned, host_lease: int, **changes: Any) -> Versioned:
        new = dataclasses.replace(current.record, **changes)
        plan = plan_update(self.keys, current, new, host_lease)
        return await self._send(plan, current.mod_revision)

    async def move(self, current: Versioned, to_host: str, state: State,
                   guards: tuple[dict[str, Any], ...] = (), **changes: Any) -> Versioned:
        plan = plan_move(self.keys, current, to_host, state, guards, **changes)
        return await self._send(plan, current.mod_revision)

    async def delete(self, current: Versioned, host_lease: int) -> None:
        await self._send(plan_delete(self.keys, current, host_lease), current.mod_revision)

    async def _send(self, plan: Plan, expected_rev: int, attempts: int = 3) -> Any:
        """Send ``plan``; when its answer is lost and the record is still as read, send it
        again. That is safe because every plan is a compare-and-set on the revision read:
        an earlier copy that lands late makes the later ones fail, never apply twice, and
        the read-back then finds our record."""
        for attempt in range(attempts):
            try:
                result = await self.client.txn(plan.compares, plan.success, plan.failure)
            except EtcdUncertain:
                try:
                    return await self._resolve(plan, expected_rev)
                except EtcdUncertain:
                    continue
            if not result.succeeded and attempt > 0:
                if _landed_earlier(plan, result, expected_rev):
                    return decode_versioned(_first_kv(result, 0))
            return outcome(plan, result)
        raise EtcdUncertain(f"{plan.key}: write outcome unknown after {attempts} tries")

    async def _resolve(self, plan: Plan, expected_rev: int) -> Versioned | None:
        """The answer was lost: read back. Ours landed if the key now holds our record (or,
        for a delete, is gone); someone else's change means ours cannot have."""
        kv = await self.client.get(plan.key)
        current = decode_versioned(kv)
        if plan.new is None and current is None:
            return None
        if current is not None and plan.new is not None and current.record == plan.new \
                and current.mod_revision > expected_rev:
            return current
        if (current.mod_revision if current else 0) == expected_rev:
            raise EtcdUncertain(f"{plan.key}: write outcome still unknown")
        raise OwnershipConflict(_why(plan, current), current)
