"""Sandbox lifetimes: ``ttl`` (destroyed N seconds after create) and ``auto_delete_after``
(destroyed after N seconds asleep).

Theory of operation
-------------------
Both are kept as facts in the registry, never as timers in memory: a TTL as its absolute
deadline (``expires_at``), an auto-delete as its period (``auto_delete_after``) counted from
the sandbox's last move from awake into SUSPENDED or FAILED (``asleep_since``, which the
registry writes in the same transaction as that transition). ``expired`` decides from those
facts alone (no I/O, tested in microseconds); ``expiry_loop`` asks it about every sandbox
once a second and destroys the expired ones through their controller
(``DestroyRequested`` in ``gateway.sandbox.core``), the same path as ``DELETE``. A daemon that was
down when a deadline passed destroys the sandbox at its first scan after start-up
(recovery runs first, so the VMM, if any, is known).

A PATCH of ``ttl`` sets a new deadline counted from now (``0`` removes it): extending a
sandbox is "keep it N more seconds". ``max_ttl`` (config) bounds what a request may ask for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config import SandboxConfig
from gateway.errors import BadRequest
from gateway.sandbox.disk_usage import measure_snapshots
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord

if TYPE_CHECKING:
    from gateway.sandbox.service import SandboxService

log = logging.getLogger(__name__)

SCAN_S = 1.0
ASLEEP = (State.SUSPENDED, State.FAILED)


@dataclass(frozen=True)
class Lifetimes:
    """What a create or PATCH asked for (None: not given; ``gateway.http.wire`` parses and bounds
    the request's numbers)."""

    ttl: float | None = None
    auto_delete_after: float | None = None


def _check_ttl(ttl: float, cfg: SandboxConfig) -> float:
    if cfg.max_ttl and not 0 < ttl <= cfg.max_ttl:
        raise BadRequest(f"'ttl' must be from 1 to {cfg.max_ttl:g} seconds on this server")
    return ttl


def at_create(asked: Lifetimes, cfg: SandboxConfig, now: float) -> dict[str, Any]:
    """Registry fields of a new sandbox: the request's values, else the host's defaults."""
    ttl = asked.ttl if asked.ttl is not None else (cfg.ttl or cfg.max_ttl)
    ttl = _check_ttl(ttl, cfg)
    auto = cfg.auto_delete_after if asked.auto_delete_after is None else asked.auto_delete_after
    return {"expires_at": now + ttl if ttl else None, "auto_delete_after": auto}


def at_update(asked: Lifetimes, cfg: SandboxConfig, now: float) -> dict[str, Any]:
    """Registry changes of a PATCH: a ttl counts from now (0 = no deadline)."""
    changes: dict[str, Any] = {}
    if asked.ttl is not None:
        ttl = _check_ttl(asked.ttl, cfg)
        changes["expires_at"] = now + ttl if ttl else None
    if asked.auto_delete_after is not None:
        changes["auto_delete_after"] = asked.auto_delete_after
    return changes


def delete_at(rec: SandboxRecord) -> float | None:
    """When an asleep sandbox is deleted (None: it is awake, or never)."""
    if rec.state not in ASLEEP or not rec.auto_delete_after or rec.asleep_since is None:
        return None
    return rec.asleep_since + rec.auto_delete_after


def expired(rec: SandboxRecord, now: float) -> str | None:
    """Why ``rec`` must be destroyed now (the cause recorded), or None."""
    if rec.state in (State.DESTROYED, State.CREATING):
        return None  # a create in flight finishes first; the next scan sees it
    if rec.expires_at is not None and now >= rec.expires_at:
        return f"ttl expired at {rec.expires_at:.3f}"
    deadline = delete_at(rec)
    if deadline is not None and now >= deadline:
        return f"auto_delete_after: {rec.state.value} for {rec.auto_delete_after:g}s"
    return None


def view(rec: SandboxRecord) -> dict[str, Any]:
    """The lifetime fields of a sandbox's JSON."""
    return {"expires_at": rec.expires_at, "auto_delete_after": rec.auto_delete_after,
            "delete_at": delete_at(rec)}


# -- the shell ----------------------------------------------------------------------------------

async def scan(service: SandboxService, now: float | None = None) -> list[str]:
    """Destroy every expired sandbox; returns their ids."""
    now = time.time() if now is None else now
    done = []
    for listed in service.registry.list():
        rec = service.registry.get(listed.id)  # fresh: an earlier destroy took time
        cause = expired(rec, now) if rec is not None else None
        if rec is None or cause is None:
            continue
        log.info("sandbox %s: %s, destroying it", rec.id, cause)
        try:
            await service.controller(rec).destroy(cause)
        except Exception:
            log.exception("destroying expired sandbox %s", rec.id)
            continue
        service.forget(rec.id)
        service.metrics.events["expired"] += 1
        done.append(rec.id)
    return done


async def expiry_loop(service: SandboxService) -> None:
    """Once a second: destroy expired sandboxes, measure new snapshots and note that the
    daemon is alive (for usage)."""
    measured: dict[str, tuple[int, float]] = {}
    while True:
        try:
            await scan(service)
            await measure_snapshots(service.registry, measured)
            if service.run_id is not None:
                service.registry.heartbeat(service.run_id)
        except Exception:
            log.exception("expiry scan")
        await asyncio.sleep(SCAN_S)
