"""Draining a host: every sandbox moved to another host, no request lost.

``agentbox-server drain HOST`` writes ``{prefix}/draining/{HOST}`` (``mark``). Every
route cache sees it: placement passes the host over (``eligible``), and the host itself,
seeing its own name, runs passes of ``Drainer``. ``plan`` (no I/O) decides each pass:

- RUNNING: **migrate** to a host chosen by placement among the other live, undrained
  hosts for the sandbox's own shape; the move is
  ``gateway.sandbox.migration.move_sandbox`` with the destination reached over its
  authenticated internal API (``HttpPeer``: this host's admin key, valid on every host as
  keys are fleet-wide) and the record moved by compare-and-set (gen + 1) once the guest
  runs there;
- SUSPENDED with its snapshot shipped (the record names it, with its base): **hand over**
  to a live, undrained host holding its base, chosen as the reaper chooses
  (``reaper.choose_holder``): ``gateway.sandbox.migration.hand_over`` holds its requests
  while the record moves by compare-and-set (gen + 1, SUSPENDED); that host's adopter
  fetches and registers it, the local copy goes, the held requests are forwarded;
- anything else is **left** for a later pass, with the reason (a suspend whose upload has
  not finished, a sandbox waking or pausing, no host with room or its base).

Every sandbox being moved is in ``busy`` (the adopter's: its eviction leaves it alone).
``agentbox-server drain --undo HOST`` removes the mark.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.cluster import placement
from gateway.cluster.errors import ClusterError, EtcdUnavailable, NoCapacity, OwnershipConflict
from gateway.cluster.etcd import EtcdClient
from gateway.cluster.keys import Keys
from gateway.cluster.ownership import Ownership
from gateway.cluster.placement import Request
from gateway.cluster.reaper import after_placing, choose_holder, request_of
from gateway.cluster.records import HostRecord, SandboxRecord
from gateway.sandbox.migration import ArrivalFailed
from gateway.sandbox.states import State

log = logging.getLogger(__name__)

PASS_EVERY_S = 2.0
READ_BACK_S = 10.0  # a hand-over whose record move's answer was lost: etcd read back this long
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
# (sandbox id, destination host, the record's move): gateway.sandbox.migration.hand_over
HandOverer = Callable[[str, str, Callable[[], Awaitable[None]]], Awaitable[Any]]

DEFAULT_SHAPE = Request(memory_mib=256, vcpus=1)  # a sandbox whose shape cannot be read


@dataclass(frozen=True)
class Migrate:
    """Move the running sandbox to ``to_host`` by live migration."""

    sandbox_id: str
    to_host: str


@dataclass(frozen=True)
class HandOver:
    """Give the suspended sandbox (``snapshot`` shipped) to ``to_host``, which adopts it."""

    sandbox_id: str
    to_host: str
    snapshot: str


@dataclass(frozen=True)
class Left:
    """Not moved by this pass; ``reason`` says why (a later pass looks again)."""

    sandbox_id: str
    reason: str


Action = Migrate | HandOver | Left


def plan(me: str, local: Iterable[tuple[str, State]], records: Mapping[str, SandboxRecord],
         hosts: Iterable[HostRecord], draining: set[str], *,
         shape: Callable[[str], Request] = lambda sandbox_id: DEFAULT_SHAPE, k: int = 2,
         rng: random.Random | None = None) -> list[Action]:
    """(No I/O.) What one pass of ``me``'s drain does with each local sandbox (``local``:
    its id and state here; ``records``: the route cache's records). Each destination is
    counted as taken for the rest of the pass."""
    candidates = eligible(hosts, draining, exclude=me)
    actions: list[Action] = []
    for sandbox_id, state in local:
        if state is State.DESTROYED:
            continue
        record = records.get(sandbox_id)
        try:
            if state is State.RUNNING:
                request = shape(sandbox_id)
                if not candidates:
                    raise NoCapacity("no other live host that is not draining")
                to = placement.choose(candidates, request, k=k, rng=rng)
                action: Action = Migrate(sandbox_id, to.name)
            elif state is State.SUSPENDED:
                why = _not_shipped(me, record)
                if why or record is None:
                    actions.append(Left(sandbox_id, why))
                    continue
                request = request_of(record)
                to = choose_holder(candidates, record, k=k, rng=rng)
                action = HandOver(sandbox_id, to.name, record.snapshot)
            else:
                actions.append(Left(sandbox_id, f"{state.value}: moved once it runs or is "
                                                "suspended and shipped"))
                continue
        except NoCapacity as exc:
            actions.append(Left(sandbox_id, str(exc)))
            continue
        candidates = [after_placing(h, request) if h.name == to.name else h for h in candidates]
        actions.append(action)
    return actions


def _not_shipped(me: str, record: SandboxRecord | None) -> str:
    """Why a local SUSPENDED sandbox cannot be handed over yet ("" = it can)."""
    if record is None or record.host != me or record.state is not State.SUSPENDED:
        return "suspended: its record does not say so yet"
    if not record.snapshot:
        return "suspended: its snapshot is not uploaded yet"
    if not record.base:
        return "suspended: its record names no base"
    return ""


def why_left(record: SandboxRecord) -> str:
    """(No I/O.) Why a record still names a draining host (what ``--wait`` prints)."""
    if record.state is State.RUNNING:
        return "running: its live migration has not finished"
    if record.state is State.SUSPENDED:
        return _not_shipped(record.host, record) or \
            "suspended and shipped: no live, undrained host holding its base took it yet"
    return f"{record.state.value}: moved once it runs, or is suspended and shipped"


@dataclass
class PassResult:
    moved: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)  # not moved this pass, and why


class Drainer:
    """One host's drain: passes while its name is marked (``run``), or one (``drain_once``)."""

    def __init__(self, host: str, client: EtcdClient, keys: Keys,
                 hosts: Callable[[], Iterable[HostRecord]], draining: Callable[[], set[str]],
                 local: Callable[[], list[tuple[str, State]]], move: Mover,
                 admin_key: Callable[[], str], rng: random.Random | None = None, *,
                 records: Callable[[], Mapping[str, SandboxRecord]] = dict,
                 hand_over: HandOverer | None = None,
                 shape: Callable[[str], Request] | None = None,
                 settled: Callable[[str], bool] = lambda sandbox_id: True,
                 busy: set[str] | None = None,
                 after: Callable[[str], None] = lambda sandbox_id: None,
                 k: int = 2) -> None:
        self.host, self.client, self.keys = host, client, keys
        self.ownership = Ownership(client, keys)
        self.hosts, self.draining, self.local, self.move = hosts, draining, local, move
        self.admin_key = admin_key
        self.rng = rng or random.Random()
        self.records, self.hand_over = records, hand_over
        self.shape = shape or (lambda sandbox_id: DEFAULT_SHAPE)  # a running one's Request
        # settled: no local change of the sandbox waits to be published (its record is
        # current); busy: the adopter's set; after: a move ended (the adopter looks again).
        self.settled, self.after, self.k = settled, after, k
        self.busy: set[str] = busy if busy is not None else set()
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
        actions = plan(self.host, self.local(), self.records(), self.hosts(), self.draining(),
                       shape=self._shape, k=self.k, rng=self.rng)
        for action in actions:
            sandbox_id = action.sandbox_id
            if isinstance(action, Left):
                result.left[sandbox_id] = action.reason
                continue
            dest = next((h for h in self.hosts() if h.name == action.to_host), None)
            self.busy.add(sandbox_id)
            try:
                if dest is None:
                    raise ClusterError(f"host {action.to_host} left the fleet")
                if isinstance(action, Migrate):
                    await self.move(sandbox_id, dest.name,
                                    HttpPeer(dest.address, self.admin_key(), self.host),
                                    self._record_move(sandbox_id, dest.name))
                else:
                    if self.hand_over is None:
                        raise ClusterError("this host cannot hand suspended sandboxes over")
                    await self.hand_over(sandbox_id, dest.name,
                                         self._handover_record(action))
                result.moved.append(sandbox_id)
                log.info("drain of %s: sandbox %s moved to %s", self.host, sandbox_id,
                         dest.name)
            except Exception as exc:  # it stays here as it was; the next pass retries
                result.failed[sandbox_id] = str(exc) or repr(exc)
                log.warning("drain of %s: sandbox %s not moved: %s", self.host, sandbox_id, exc)
            finally:
                self.busy.discard(sandbox_id)
                self.after(sandbox_id)
        return result

    def _shape(self, sandbox_id: str) -> Request:
        try:
            return self.shape(sandbox_id)
        except Exception as exc:
            log.warning("drain of %s: shape of %s unknown (%s); assuming %s", self.host,
                        sandbox_id, exc, DEFAULT_SHAPE)
            return DEFAULT_SHAPE

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

    def _handover_record(self, action: HandOver) -> Callable[[], Awaitable[None]]:
        """The record's move for a hand-over, run while the sandbox's requests are held:
        only the record this host's suspend wrote (nothing of ours waits to be published,
        SUSPENDED here, naming the snapshot the pass saw) moves, once."""
        async def move_record() -> None:
            if not self.settled(action.sandbox_id):
                raise ClusterError("a change of it waits to be published; next pass")
            current = await self.ownership.get(action.sandbox_id)
            record = current.record if current is not None else None
            if current is None or record is None or (record.host, record.state, record.snapshot) \
                    != (self.host, State.SUSPENDED, action.snapshot):
                raise ClusterError(f"its record changed since the pass read it: {record}")
            try:
                await self.ownership.move(current, action.to_host, State.SUSPENDED)
            except EtcdUnavailable as exc:  # its outcome unknown: still held, read it back
                await self._landed(action, record.gen + 1, exc)
        return move_record

    async def _landed(self, action: HandOver, gen: int, lost: Exception) -> None:
        """Return if the hand-over's move landed (the record names the destination at
        ``gen``); raise if it did not, or if etcd still does not say within
        ``READ_BACK_S`` (the sandbox then stays here: docs/cluster.md, "Not built yet")."""
        deadline = asyncio.get_running_loop().time() + READ_BACK_S
        while True:
            try:
                now = await self.ownership.get(action.sandbox_id)
            except ClusterError:
                now = None
            else:
                if now is not None and (now.record.host, now.record.gen) == \
                        (action.to_host, gen):
                    return
                raise ClusterError(f"the record's move did not land ({lost})")
            if asyncio.get_running_loop().time() > deadline:
                raise ClusterError(f"the record's move is unknown ({lost}); etcd did not "
                                   f"answer for {READ_BACK_S:g} s")
            await asyncio.sleep(1.0)
