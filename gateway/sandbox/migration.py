"""Moving a running sandbox to another host (a drain): the sandbox side of vmctl.migrate.

Source (``move_out``): the sandbox's controller runs the move as its operation (requests
held, ``SandboxCore`` MIGRATE), which asks the destination (``Peer``, spoken by
gateway/cluster over the hosts' authenticated API) to prepare, migrates the VM over the
streams the offer names, has the destination start it (the commit), then moves the etcd
record (``record_move``: compare-and-set, gen + 1). The held requests are then refused
with ``SandboxMoved`` and the routing middleware forwards them to the new owner.

Destination (``Arrivals``): ``prepare`` records the sandbox as CREATING (same id, tenant,
template, shape; a network slot and root of this host's), starts its VMM waiting
(``migrate.Incoming``) and answers the offer; ``commit`` waits for the stream, runs the
guest and makes it RUNNING here; ``abort`` (or an arrival never committed within
``ARRIVAL_TIMEOUT_S``) tears it down.

What is unknown stays safe: a commit whose answer is lost is followed by an abort; the
destination refuses an abort once its guest runs (then the move succeeded), and if the
abort is not answered either the source VM stays paused (``OutcomeUnknown``): the
sandbox never runs on two hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from gateway.errors import BadRequest, Conflict, SandboxNotFound
from gateway.sandbox.controller import SandboxController
from gateway.sandbox.states import State
from vmctl import migrate
from vmctl.driver import LiveStats
from vmctl.errors import MigrationError, OutcomeUnknown
from vmctl.machine import Machine

log = logging.getLogger(__name__)

MOVE_TIMEOUT_S = 600.0  # the whole copy of one sandbox (TCG: seconds; a big dirty guest: more)
ARRIVAL_TIMEOUT_S = 900.0  # a prepared arrival never committed is torn down after this
# What crosses with a sandbox: its identity, tenant, template and shape, and the settings
# its owner keeps. Its slot, root, VMM and history are the destination's own.
MOVED_FIELDS = ("id", "tenant", "template", "golden", "idle_timeout", "created_at", "metadata",
                "expires_at", "auto_delete_after", "egress", "vcpus", "memory_mib", "disk_mib")


class ArrivalFailed(Exception):
    """The destination answered that the sandbox did not start there (and is torn down)."""


class Peer(Protocol):
    """The destination host, as the source reaches it (gateway/cluster/drain.py)."""

    async def prepare(self, moved: dict[str, Any], disk_bytes: int) -> dict[str, Any]:
        """The offer (``migrate.Offer.to_dict``)."""

    async def commit(self, sandbox_id: str) -> None:
        """Returns once the guest runs there. Raises ``ArrivalFailed`` when the
        destination answered that it failed (and is torn down); anything else: no answer."""

    async def abort(self, sandbox_id: str) -> bool:
        """Tear the arrival down; False if it cannot be (its guest already runs)."""


def moved_fields(rec: Any) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in MOVED_FIELDS}


async def move_out(ctl: SandboxController, host: str, peer: Peer,
                   record_move: Callable[[], Awaitable[None]],
                   timeout: float = MOVE_TIMEOUT_S, live: bool | None = None) -> LiveStats:
    """Move a RUNNING sandbox to ``host``; raises with the sandbox running here as before,
    unless the error is ``OutcomeUnknown`` (its VM then stays paused here)."""
    machine = ctl.machine
    if not isinstance(machine, Machine):
        raise MigrationError("this sandbox's machine cannot migrate")
    done: list[LiveStats] = []

    async def commit() -> None:
        try:
            await peer.commit(ctl.id)
            return
        except ArrivalFailed as exc:  # the destination failed and is torn down: resume here
            raise MigrationError(str(exc)) from exc
        except BaseException as exc:
            lost = exc
        try:  # the answer was lost: did its guest start?
            aborted = await asyncio.shield(peer.abort(ctl.id))
        except BaseException as exc:
            raise OutcomeUnknown(f"no answer to the commit ({lost}) nor to the abort ({exc}): "
                                 "the VM stays paused here") from exc
        if aborted:
            raise MigrationError(f"the commit was not answered ({lost}); the destination "
                                 "is torn down")
        # Not abortable: its guest runs there. The move happened.

    async def move() -> None:
        offer = migrate.Offer.from_dict(await peer.prepare(moved_fields(ctl.record),
                                                           machine.disk_bytes()))
        try:
            done.append(await machine.migrate_out(migrate.dialer(offer), commit, timeout, live))
        except OutcomeUnknown:
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(peer.abort(ctl.id))
            raise
        try:
            await record_move()
        except Exception as exc:  # this host keeps redirecting to it (SandboxMoved)
            log.error("sandbox %s moved to %s but its record could not be moved: %s",
                      ctl.id, host, exc)

    await ctl.start_migrate(host, move)
    return done[0]


async def move_sandbox(service: Any, sandbox_id: str, host: str, peer: Peer,
                       record_move: Callable[[], Awaitable[None]],
                       live: bool | None = None) -> LiveStats:
    """``move_out`` for a sandbox of ``service``; afterwards its requests here are sent on
    to ``host`` (``SandboxService.note_moved``) and its controller forgotten."""
    ctl = service.known(sandbox_id)
    if ctl is None:
        raise SandboxNotFound(sandbox_id)
    stats = await move_out(ctl, host, peer, record_move, live=live)
    service.note_moved(sandbox_id, host)
    service.forget(sandbox_id)
    return stats


async def hand_over(service: Any, sandbox_id: str, host: str,
                    record_move: Callable[[], Awaitable[None]]) -> None:
    """Give a SUSPENDED sandbox whose snapshot is shipped to ``host`` (a drain): its
    controller holds new requests (``SandboxCore`` MIGRATE) while ``record_move`` moves
    the etcd record (compare-and-set; ``host`` adopts it from the object store); then the
    local copy goes (row DESTROYED "moved to host ...", namespace and files removed) and
    the held requests are refused with ``SandboxMoved``, which the routing middleware
    forwards to ``host``. If ``record_move`` raises, the sandbox stays SUSPENDED here and
    the held requests wake it here; the error is raised."""
    rec = service.registry.get(sandbox_id)
    if rec is None or rec.state is not State.SUSPENDED:
        raise Conflict(f"sandbox {sandbox_id} is not suspended here", code="conflict")
    ctl = service.controller(rec)
    await ctl.start_migrate(host, record_move)
    service.note_moved(sandbox_id, host)
    service.forget(sandbox_id)


class Arrivals:
    """The destination's side: sandboxes on their way here, by id."""

    def __init__(self, service: Any, bind: str, advertise: str) -> None:
        self.service = service
        self.bind = bind
        self.advertise = advertise
        self._pending: dict[str, tuple[SandboxController, migrate.Incoming, asyncio.Task]] = {}

    async def prepare(self, moved: dict[str, Any], disk_bytes: int) -> dict[str, Any]:
        fields = _checked(moved)
        if not 0 < disk_bytes <= 1 << 44:
            raise BadRequest("disk_bytes out of range")
        if fields["id"] in self._pending:
            raise Conflict(f"sandbox {fields['id']} is already arriving", code="conflict")
        rec = self.service.reserve_arrival(fields)
        ctl = self.service.controller(rec)
        machine = ctl.machine
        assert isinstance(machine, Machine)
        try:
            incoming = await migrate.Incoming.open(machine, disk_bytes, self.bind, self.advertise)
        except BaseException:
            await asyncio.shield(self._discard(ctl, "arrival failed to prepare"))
            raise
        expiry = asyncio.get_running_loop().create_task(self._expire(rec.id))
        self._pending[rec.id] = (ctl, incoming, expiry)
        return incoming.offer.to_dict()

    async def commit(self, sandbox_id: str) -> None:
        entry = self._pending.pop(sandbox_id, None)
        if entry is None:
            ctl = self.service.known(sandbox_id)
            if ctl is not None and ctl.state is State.RUNNING:
                return  # a repeated commit: it runs
            raise SandboxNotFound(sandbox_id)
        ctl, incoming, expiry = entry
        expiry.cancel()
        try:
            await incoming.commit()  # tears the VM down itself if it fails
        except BaseException as exc:
            await asyncio.shield(self._discard(ctl, f"arrival failed: {exc}"))
            if isinstance(exc, Exception):
                raise ArrivalFailed(f"the sandbox did not start here: {exc}") from exc
            raise
        ctl.arrived()
        log.info("sandbox %s arrived and runs here", sandbox_id)

    async def abort(self, sandbox_id: str) -> bool:
        entry = self._pending.pop(sandbox_id, None)
        if entry is None:
            ctl = self.service.known(sandbox_id)
            return not (ctl is not None and ctl.state is State.RUNNING)
        ctl, incoming, expiry = entry
        expiry.cancel()
        await incoming.abort()
        await self._discard(ctl, "arrival aborted by its source")
        return True

    async def aclose(self) -> None:
        for sandbox_id in list(self._pending):
            with contextlib.suppress(Exception):
                await self.abort(sandbox_id)

    async def _expire(self, sandbox_id: str) -> None:
        await asyncio.sleep(ARRIVAL_TIMEOUT_S)
        log.warning("sandbox %s: arrival not committed in %.0fs: torn down", sandbox_id,
                    ARRIVAL_TIMEOUT_S)
        entry = self._pending.pop(sandbox_id, None)
        if entry is not None:
            await entry[1].abort()
            await self._discard(entry[0], "arrival never committed")

    async def _discard(self, ctl: SandboxController, cause: str) -> None:
        with contextlib.suppress(Exception):
            await ctl.machine.destroy()
        with contextlib.suppress(Exception):
            await ctl.destroy(cause)
        self.service.forget(ctl.id)


def _checked(moved: Any) -> dict[str, Any]:
    """The moved sandbox's fields, bounded and typed (they come from another host)."""
    if not isinstance(moved, dict) or set(moved) != set(MOVED_FIELDS):
        raise BadRequest(f"a moved sandbox has exactly the fields {', '.join(MOVED_FIELDS)}")
    out = dict(moved)
    for name in ("id", "tenant", "template", "golden"):
        if not isinstance(out[name], str) or not 0 < len(out[name]) <= 4096:
            raise BadRequest(f"moved sandbox: bad {name}")
    if not out["id"].replace("-", "").replace("_", "").isalnum() or len(out["id"]) > 64:
        raise BadRequest("moved sandbox: bad id")
    if not Path(out["golden"]).is_absolute():
        raise BadRequest("moved sandbox: its golden must be an absolute path")
    for name in ("vcpus", "memory_mib", "disk_mib"):
        if not isinstance(out[name], int) or out[name] < 0:
            raise BadRequest(f"moved sandbox: bad {name}")
    for name in ("idle_timeout", "created_at", "auto_delete_after"):
        if not isinstance(out[name], (int, float)):
            raise BadRequest(f"moved sandbox: bad {name}")
    if out["expires_at"] is not None and not isinstance(out["expires_at"], (int, float)):
        raise BadRequest("moved sandbox: bad expires_at")
    if not isinstance(out["metadata"], dict) or len(repr(out["metadata"])) > 65536:
        raise BadRequest("moved sandbox: bad metadata")
    if out["egress"] is not None and not isinstance(out["egress"], dict):
        raise BadRequest("moved sandbox: bad egress")
    out.setdefault("created_at", time.time())
    return out
