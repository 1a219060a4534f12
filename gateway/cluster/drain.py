"""Draining a host: every running sandbox moved to another host by live migration.

``agentbox-server drain HOST`` writes ``{prefix}/draining/{HOST}`` (``mark``). Every
route cache sees it: placement passes the host over (``eligible``), and the host itself,
seeing its own name, runs passes of ``Drainer``: for each running sandbox, a destination
chosen by placement among the other live, undrained hosts, then the move
(``gateway.sandbox.migration.move_sandbox``) with the destination reached over its
authenticated internal API (``HttpPeer``: this host's admin key, valid on every host as
keys are fleet-wide) and the record moved by compare-and-set (gen + 1) once the guest runs
there. ``agentbox-server drain --undo HOST`` removes the mark.

Suspended sandboxes are not moved by a drain yet: their records would go to a host with
their base, which adopts them from the shared object store (that adoption is another
piece, not here): a pass lists them as ``left``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.cluster import placement
from gateway.cluster.errors import ClusterError, NoCapacity, OwnershipConflict
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.ownership import Ownership
from gateway.cluster.records import HostRecord
from gateway.sandbox.migration import ArrivalFailed
from gateway.sandbox.states import State

log = logging.getLogger(__name__)

PASS_EVERY_S = 2.0
PEER_TIMEOUT_S = 120.0  # prepare and commit wait on a VMM start / the whole stream's load


async def mark(client: EtcdClient, keys: Keys, host: str, draining: bool = True) -> None:
    """Mark (or unmark) ``host`` as draining."""
    if draining:
        await client.put(keys.drain(host).encode(), b"{}")
    else:
        await client.delete(keys.drain(host).encode())


def eligible(hosts: Iterable[HostRecord], draining: set[str],
             exclude: str = "") -> list[HostRecord]:
    """The live hosts placement may choose: not draining, not ``exclude``."""
    return [h for h in hosts if h.name not in draining and h.name != exclude]


class HttpPeer:
    """The destination host's internal migration API (gateway/http/migration_routes.py)."""

    def __init__(self, address: str, admin_key: str, self_host: str,
                 timeout: float = PEER_TIMEOUT_S) -> None:
        self.base = f"http://{address}/v1/internal/migrations"
        self.headers = {"Authorization": f"Bearer {admin_key}",
                        "X-AgentBox-Forwarded": self_host}  # never placed or forwarded again
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            async with session.post(self.base + path, json=body, headers=self.headers) as resp:
                data = await resp.json(content_type=None) if resp.content_length != 0 else None
                return resp.status, data

    async def prepare(self, moved: dict[str, Any], disk_bytes: int) -> dict[str, Any]:
        status, data = await self._post("", {"moved": moved, "disk_bytes": disk_bytes})
        if status != 201 or not isinstance(data, dict):
            raise ArrivalFailed(f"the destination refused the sandbox ({status}): {data}")
        return data

    async def commit(self, sandbox_id: str) -> None:
        status, data = await self._post(f"/{sandbox_id}/commit", {})
        if status == 200:
            return
        if status == 502:  # it answered: the guest did not start there, and it is torn down
            raise ArrivalFailed(f"{data}")
        raise ClusterError(f"commit answered {status}: {data}")  # unknown: the caller aborts

    async def abort(self, sandbox_id: str) -> bool:
        status, data = await self._post(f"/{sandbox_id}/abort", {})
        if status != 200 or not isinstance(data, dict):
            raise ClusterError(f"abort answered {status}: {data}")
        return bool(data.get("aborted"))


# (sandbox id, destination host, its peer, the record's move) -> the move's figures
Mover = Callable[[str, str, Any, Callable[[], Awaitable[None]]], Awaitable[Any]]


@dataclass
class PassResult:
    moved: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)  # not running: not moved by a drain (yet)


class Drainer:
    """One host's drain: passes while its name is marked (``run``), or one (``drain_once``)."""

    def __init__(self, host: str, client: EtcdClient, keys: Keys,
                 hosts: Callable[[], Iterable[HostRecord]], draining: Callable[[], set[str]],
                 local: Callable[[], list[tuple[str, State]]], move: Mover,
                 admin_key: Callable[[], str], rng: random.Random | None = None) -> None:
        self.host, self.client, self.keys = host, client, keys
        self.ownership = Ownership(client, keys)
        self.hosts, self.draining, self.local, self.move = hosts, draining, local, move
        self.admin_key = admin_key
        self.rng = rng or random.Random()
        self.passes = 0
        self.last: PassResult | None = None

    async def run(self) -> None:
        """Until cancelled: a pass every ``PASS_EVERY_S`` while this host is marked."""
        while True:
            if self.host in self.draining():
                try:
                    self.last = await self.drain_once()
                except Exception as exc:
                    log.warning("drain of %s: pass failed: %s", self.host, exc)
            await asyncio.sleep(PASS_EVERY_S)

    async def drain_once(self) -> PassResult:
        result = PassResult()
        self.passes += 1
        for sandbox_id, state in self.local():
            if state is not State.RUNNING:
                if state not in (State.DESTROYED,):
                    result.left.append(sandbox_id)
                continue
            try:
                dest = self._choose()
                await self.move(sandbox_id, dest.name,
                                HttpPeer(dest.address, self.admin_key(), self.host),
                                self._record_move(sandbox_id, dest.name))
                result.moved.append(sandbox_id)
                log.info("drain of %s: sandbox %s moved to %s", self.host, sandbox_id,
                         dest.name)
            except Exception as exc:  # the sandbox runs here still; the next pass retries
                result.failed[sandbox_id] = str(exc) or repr(exc)
                log.warning("drain of %s: sandbox %s not moved: %s", self.host, sandbox_id, exc)
        return result

    def _choose(self) -> HostRecord:
        candidates = eligible(self.hosts(), self.draining(), exclude=self.host)
        if not candidates:
            raise NoCapacity("no other live host that is not draining", {})
        return placement.choose(candidates, placement.Request(memory_mib=256, vcpus=1),
                                k=2, rng=self.rng)

    def _record_move(self, sandbox_id: str, dest: str) -> Callable[[], Awaitable[None]]:
        async def move_record() -> None:
            for _ in range(5):
                current = await self.ownership.get(sandbox_id)
                if current is None:
                    raise ClusterError(f"{sandbox_id} has no record to move")
                if current.record.host == dest:
                    return
                try:
                    await self.ownership.move(current, dest, State.RUNNING)
                    return
                except OwnershipConflict:
                    continue  # the owner's own publisher wrote meanwhile: read again
            raise ClusterError(f"{sandbox_id}: its record kept changing; not moved")
        return move_record
