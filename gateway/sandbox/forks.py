"""Snapshot a running sandbox into a template, and fork a sandbox into n.

Both rest on ``Machine.capture``: the source is held like a request (a suspended one is
woken first, an idle one is not suspended meanwhile), paused while its device state,
memory and disk are copied into a new golden directory, and resumed. The capture runs
as a task the service owns, so a client that disconnects never leaves the source
paused or a half-written template. The directory is written under a temporary name
and renamed, and the catalog row is added right after the rename with no await in
between; a crash leaves either no template or a complete one (stray directories are
removed at start-up, ``TemplateCatalog.collect``).

A fork is a capture registered as an anonymous template (source ``fork``) that its n
sandboxes are created from; it is pinned while they are being created, then released,
so its files go when the last fork does. Forks are all-or-nothing: if one of them
cannot be created, the others are destroyed and the error is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from gateway.tenancy import quotas
from gateway.http import wire
from gateway.errors import BadRequest, Conflict, QuotaExceeded, Unavailable
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord
from gateway.sandbox.service import SandboxService
from gateway.templates.catalog import MAX_CHAIN, Source, validate_name
from vmctl.golden import load_golden_dir

log = logging.getLogger(__name__)

MAX_FORKS = 8  # sandboxes one fork request may make
_locks: dict[str, asyncio.Lock] = {}


async def snapshot(svc: SandboxService, tenant: str, sandbox_id: str,
                   name: Any) -> wire.Template:
    """Save the sandbox as ``tenant``'s template ``name``; returns its view."""
    name = validate_name(name)
    svc.templates.check_new(tenant, name)
    _check_disk(svc, tenant)
    template_id, path, rec, paused_ms = await _capture(svc, tenant, sandbox_id)
    view = svc.templates.add(tenant, name, path, Source.SNAPSHOT, parent=Path(rec.golden),
                             template_id=template_id, meta={"from_sandbox": rec.id})
    log.info("sandbox %s saved as template %s of %s (paused %.0f ms)", rec.id, name, tenant,
             paused_ms)
    return dataclasses.replace(view, paused_ms=round(paused_ms, 1))


async def fork(svc: SandboxService, tenant: str, sandbox_id: str,
               count: Any) -> list[SandboxRecord]:
    """``count`` new sandboxes in the source's state (files, processes, memory)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
        raise BadRequest(f"'count' must be an integer from 1 to {MAX_FORKS}")
    _check_room(svc, tenant, count)
    template_id, path, rec, _ = await _capture(svc, tenant, sandbox_id)
    svc.templates.add(tenant, f"~fork-{template_id}", path, Source.FORK,
                      parent=Path(rec.golden), template_id=template_id,
                      meta={"from_sandbox": rec.id})
    try:
        with svc.templates.pinned(str(path)):
            return await _create_forks(svc, tenant, rec, load_golden_dir(path), count)
    finally:
        svc.templates.release(template_id)
        svc.templates.collect()


async def _create_forks(svc: SandboxService, tenant: str, source: SandboxRecord, golden: Any,
                        count: int) -> list[SandboxRecord]:
    recs: list[SandboxRecord] = []
    try:
        # A fork is a copy of the sandbox: its egress policy (a fork must not reach what
        # its source may not) and its lifetimes (the same deadline) come along.
        inherited = {"egress": source.egress, "expires_at": source.expires_at,
                     "auto_delete_after": source.auto_delete_after}
        for _ in range(count):  # synchronous: slots and quota are taken one by one
            recs.append(svc.reserve(tenant, source.template, golden, dict(source.metadata),
                                     source.idle_timeout, extra=inherited))
        ctls = [svc.controller(r) for r in recs]
        results = await asyncio.gather(*(c.create() for c in ctls), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed or any(c.state is not State.RUNNING for c in ctls):
            raise failed[0] if failed else Unavailable("a fork did not start", code="unavailable")
        return [c.record for c in ctls]
    except BaseException:
        await asyncio.shield(_destroy_all(svc, recs))
        raise


async def _destroy_all(svc: SandboxService, recs: list[SandboxRecord]) -> None:
    for rec in recs:
        try:
            await svc.controller(rec).destroy("fork failed")
        except Exception:
            log.exception("destroying fork %s", rec.id)
        svc.forget(rec.id)


async def _capture(svc: SandboxService, tenant: str,
                   sandbox_id: str) -> tuple[str, Path, SandboxRecord, float]:
    rec = svc.get(tenant, sandbox_id)
    if svc.templates.chain_depth(rec.golden) >= MAX_CHAIN:
        raise Conflict(f"sandbox {sandbox_id} comes from a chain of {MAX_CHAIN} templates made "
                       "from one another; snapshot one nearer a built-in", code="conflict")
    task = svc.spawn(_capture_owned(svc, tenant, rec), f"capture-{rec.id}")
    return await asyncio.shield(task)


async def _capture_owned(svc: SandboxService, tenant: str,
                         rec: SandboxRecord) -> tuple[str, Path, SandboxRecord, float]:
    lock = _locks.setdefault(rec.id, asyncio.Lock())  # one capture of a sandbox at a time
    template_id, final = svc.templates.new_dir()
    tmp = final.with_name(f".{final.name}.tmp")
    async with lock, svc.use(tenant, rec.id) as machine:
        golden = svc.golden_for(rec)
        meta = {"template": golden.template, "kernel": str(golden.kernel),
                "initrd": str(golden.initrd) if golden.initrd else None,
                "cmdline": golden.cmdline, "mem_mib": golden.mem_mib,
                # its shape: clones restore with these vCPUs and RAM, on a disk this big
                "vcpus": golden.vcpus, "disk_mib": max(rec.disk_mib, golden.disk_mib)}
        try:
            tmp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            paused_ms = await machine.capture(tmp, meta)
            os.replace(tmp, final)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise
    return template_id, final, rec, paused_ms


def _check_disk(svc: SandboxService, tenant: str) -> None:
    limits = svc.limits(tenant)
    if limits.max_disk_mib:
        usage = svc.tenant_usage(tenant, measure_disk=True)
        if usage.disk_bytes >= limits.max_disk_mib << 20:
            raise QuotaExceeded(f"key {tenant}'s sandboxes and templates use "
                                f"{usage.disk_bytes >> 20} MiB of disk, its limit "
                                f"(max_disk_mib={limits.max_disk_mib}): delete one first")


def _check_room(svc: SandboxService, tenant: str, count: int) -> None:
    """Refuse a fork the key's quota or the host cannot take whole (before any work)."""
    limits = svc.limits(tenant)
    usage = svc.tenant_usage(tenant, measure_disk=bool(limits.max_disk_mib))
    quotas.check_fork(tenant, limits, usage, count)
    free = svc.config.sandbox.max_sandboxes - len(svc.registry.used_slots())
    if count > free:
        raise Unavailable(f"this host has room for {max(free, 0)} more sandboxes",
                          code="sandbox_limit", headers={"Retry-After": "30"})
