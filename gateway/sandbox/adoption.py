"""Adopting a suspended sandbox shipped from another host: its files under this host's
sandboxes dir, rewritten to stand on this host's golden, and a SUSPENDED registry row.

The cluster (gateway.cluster.adopter) decides *when* (a record moved to this host) and
fetches; this module does the host's part:

1. the snapshot is fetched (every byte SHA256-checked against the shipped index) into a
   staging directory ``{sandboxes_dir}/.adopt-{id}``;
2. what names the old place is rewritten (``relocate``, no I/O, and ``_rewrite``): the
   manifest's absolute paths (QEMU's memory file and disk, ``{old root}/...``) become
   the new root's, a compact memory's golden becomes this host's golden memory, the
   qcow2 overlay's backing file becomes this host's golden disk (``qemu-img rebase -u``:
   the same bytes, the base identity says so), and the entries checked by size and
   mtime get the new files' (the fetch re-created them: their mtime is the fetch's;
   the bytes were just checked against the index's SHA256, the overlay's header was
   rewritten by us, so the check goes on guarding what it guards on the old host: that
   nothing wrote to them between the suspend, here the adoption, and the wake);
3. the directory is renamed to ``{sandboxes_dir}/{id}`` and loaded as a wake would load
   it (``vmctl.store.load``: every hashed file verified, so the first wake finds the
   hashes cached);
4. a network slot of this host's is taken and its namespace made, and the row is
   inserted SUSPENDED (tenant, template, shape, metadata, egress, idle timeout from the
   index's meta; the golden is this host's golden of that base). From here on it is a
   local suspended sandbox: a request wakes it.

The insert is the commit point: before it, whatever exists (staging, root, namespace) is
garbage that the next attempt removes first, so a crash or cancellation mid-adoption
leaves nothing registered and a retry starts clean. ``evict`` is the reverse: a local
copy of a sandbox the fleet gave to another host is destroyed (VMM, namespace, files;
its row goes DESTROYED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.sandbox.shipped import local_bases
from gateway.sandbox.states import State
from gateway.store.registry import SandboxRecord
from vmctl import disks, network, store
from vmctl.disks import DiskError
from vmctl.errors import SnapshotError
from vmctl.golden import Golden, load_golden_dir

log = logging.getLogger(__name__)
STAGING = ".adopt-"
EVICTED = "moved to host "  # the cause of an eviction's DESTROYED transition

# Fetch the shipped snapshot into the given directory (which must not exist); returns the
# index's base identity and ``meta`` (gateway.cluster.shipping.fetch checks every byte).
Fetch = Callable[[Path], Awaitable[tuple[str, dict[str, Any]]]]


class AdoptionError(Exception):
    """This host cannot adopt the sandbox (no golden of its base, no slot, bad snapshot)."""


@dataclass(frozen=True)
class Relocated:
    """The manifest's files rewritten for the new root, and what else must change."""

    files: dict[str, dict[str, Any]]
    overlay: str | None  # the qcow2 overlay (new path) whose backing file must be rebased
    compact: bool  # the memory is a diff from the golden's


def old_root_of(path: str, sandbox_id: str) -> Path | None:
    """The sandbox root an absolute manifest path lies in: up to its component that is
    the sandbox's id (roots are ``{sandboxes_dir}/{id}``); None for a path outside it."""
    parts = Path(path).parts
    if not Path(path).is_absolute() or sandbox_id not in parts:
        return None
    cut = len(parts) - parts[::-1].index(sandbox_id)
    return Path(*parts[:cut])


def relocate(files: dict[str, dict[str, Any]], sandbox_id: str, new_root: Path,
             golden: Golden, old_root: str = "") -> Relocated:
    """(No I/O.) The manifest's ``files`` as they must read under ``new_root``: absolute
    paths in the old root moved to the new one, a compact memory's golden replaced by
    ``golden``'s memory. Relative paths (inside the snapshot directory) stay."""
    out: dict[str, dict[str, Any]] = {}
    overlay = None
    compact = False

    def moved(path: str) -> str:
        root = Path(old_root) if old_root else old_root_of(path, sandbox_id)
        if root is None or not Path(path).is_absolute():
            return path
        if not Path(path).is_relative_to(root):
            raise AdoptionError(f"snapshot path {path} is outside its root {root}")
        return str(new_root / Path(path).relative_to(root))

    for role, entry in files.items():
        new = dict(entry)
        new["path"] = moved(str(entry["path"]))
        if "diff" in entry:
            diff = dict(entry["diff"])
            diff["path"] = moved(str(diff["path"]))
            diff["golden"] = str(golden.snapshot.memory)
            new["diff"] = diff
            compact = True
        if "golden" in entry:
            new["golden"] = str(golden.snapshot.memory)
        if role == "disk" and new["path"].endswith(".qcow2"):
            overlay = new["path"]
        out[role] = new
    return Relocated(out, overlay, compact)


def staging_dir(sandboxes_dir: Path, sandbox_id: str) -> Path:
    return sandboxes_dir / f"{STAGING}{sandbox_id}"


def sweep(sandboxes_dir: Path) -> list[Path]:
    """Remove what interrupted adoptions left (staging directories, partial fetches)."""
    gone = []
    for path in sandboxes_dir.glob(f"{STAGING}*") if sandboxes_dir.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


async def backing_file(overlay: Path) -> str:
    """The backing file a qcow2 overlay's header names."""
    return await disks.backing_file(overlay)


async def _rewrite(staging: Path, root: Path, sandbox_id: str, golden: Golden,
                   old_root: str) -> Relocated:
    """Rewrite the fetched snapshot in ``staging`` to live at ``root`` on ``golden``."""
    snap_dir = staging / "snapshot"
    manifest = store.Manifest.from_json((snap_dir / store.MANIFEST).read_bytes())
    plan = relocate(manifest.files, sandbox_id, root, golden, old_root)

    def here(path: str) -> Path:  # a (new) manifest path, where the file is now
        p = Path(path)
        return staging / p.relative_to(root) if p.is_absolute() else snap_dir / p

    if plan.overlay is not None:
        disk = golden.snapshot.disk.resolve()
        await disks.rebase_overlay(here(plan.overlay), disk)
    files = {}
    for role, entry in plan.files.items():
        entry = dict(entry)
        # A compact memory's own file does not exist (the diff stands for it until a wake
        # rebuilds it, which records the rebuilt file's size and mtime itself).
        for sub in (None if "diff" in entry else entry, entry.get("diff")):
            if sub is None or "mtime_ns" not in sub:
                continue
            st = here(str(sub["path"])).stat()
            sub.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
        files[role] = entry
    fresh = store.Manifest(manifest.driver, manifest.accel, files, manifest.created_at,
                           manifest.meta)
    tmp = snap_dir / (store.MANIFEST + ".tmp")
    tmp.write_bytes(fresh.to_json())
    os.replace(tmp, snap_dir / store.MANIFEST)
    return plan


def _golden_of(images_dir: Path, base: str) -> Golden:
    found = local_bases(images_dir).get(base)
    if found is None:
        raise AdoptionError(f"this host holds no golden with base {base[:16]} (copy the "
                            "images dir from the host that built it: docs/cluster.md)")
    return load_golden_dir(found)


def record_for(sandbox_id: str, meta: dict[str, Any], golden: Golden, slot: int, root: Path,
               host: str, now: float, failed: str | None = None) -> SandboxRecord:
    """(No I/O.) The registry row of an adopted sandbox, from the shipped index's meta
    (or, for one that shipped nothing, its etcd record's); ``failed``: it is registered
    FAILED with that reason (its memory is lost), else SUSPENDED."""
    template = meta.get("template")
    tenant = meta.get("tenant")
    if not isinstance(template, str) or not isinstance(tenant, str) or not tenant:
        raise AdoptionError("the shipped index names no tenant or template")
    if golden.template != template and failed is None:
        raise AdoptionError(f"the golden of its base is of template {golden.template!r}, "
                            f"the sandbox is of {template!r}")

    def number(name: str, default: float) -> Any:
        value = meta.get(name, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        return value if ok else default

    shipped_metadata, shipped_egress = meta.get("metadata"), meta.get("egress")
    metadata: dict[str, Any] = shipped_metadata if isinstance(shipped_metadata, dict) else {}
    egress = shipped_egress if isinstance(shipped_egress, dict) else None
    return SandboxRecord(
        id=sandbox_id, tenant=tenant, template=template,
        state=State.SUSPENDED if failed is None else State.FAILED, slot=slot,
        failure=failed,
        root=str(root), golden=str(golden.dir), idle_timeout=float(number("idle_timeout", 0)),
        host=host, created_at=now, updated_at=now, last_activity=now, metadata=metadata,
        egress=egress, asleep_since=now, vcpus=int(number("vcpus", golden.vcpus)),
        memory_mib=int(number("memory_mib", golden.mem_mib)),
        disk_mib=int(number("disk_mib", golden.disk_mib)))


async def adopt(service: Any, sandbox_id: str, fetch: Fetch | None, *, base: str = "",
                from_host: str = "", failed: str | None = None,
                meta: dict[str, Any] | None = None) -> SandboxRecord:
    """Make the shipped sandbox ``sandbox_id`` a local SUSPENDED one of ``service`` (a
    ``SandboxService``). Idempotent: a sandbox already in the registry is returned as
    it is. Raises AdoptionError (or the fetch's error); nothing is left registered or
    on disk when it does, and the shipped snapshot is untouched.

    ``failed`` (its memory is lost: its host died while it ran): registered FAILED with
    that reason, with only the snapshot's disk kept (rebased onto this host's golden, where
    the sandbox's own disk lives), so its next request cold-boots that disk; with no
    ``fetch`` (nothing was shipped), with no disk at all, from ``meta`` (tenant, template,
    shape: the etcd record's), so its requests are answered sandbox_lost and DELETE works."""
    existing = service.registry.get(sandbox_id)
    if existing is not None and existing.state is not State.DESTROYED:
        return existing
    sandboxes = service.sandboxes_dir
    sandboxes.mkdir(parents=True, exist_ok=True)
    staging, root = staging_dir(sandboxes, sandbox_id), sandboxes / sandbox_id
    disk_only = staging.with_name(staging.name + ".disk")
    images = service.config.server.images_dir
    if base and fetch is not None:  # refused before anything is downloaded
        await asyncio.to_thread(_golden_of, images, base)
    leftovers = (staging, staging.with_name(staging.name + ".fetching"), disk_only, root)
    await asyncio.to_thread(_remove, *leftovers)
    slot: int | None = None
    try:
        if fetch is None:
            if failed is None:
                raise AdoptionError("nothing to adopt: no snapshot and not failed")
            meta = dict(meta or {})
            golden = await asyncio.to_thread(_golden_for_lost, images, base,
                                             str(meta.get("template", "")))
            await asyncio.to_thread(root.mkdir)
        else:
            shipped_base, meta = await fetch(staging)
            golden = await asyncio.to_thread(_golden_of, images, shipped_base)
            plan = await _rewrite(staging, root, sandbox_id, golden, str(meta.get("root", "")))
            if failed is None:
                os.replace(staging, root)
                await asyncio.to_thread(store.load, root / "snapshot", not plan.compact)
            else:
                disk = service.backend.layout.disk(root)
                await asyncio.to_thread(_keep_disk, staging, root, plan, disk, disk_only)
        slot = service.claim_slot()
        rec = record_for(sandbox_id, meta, golden, slot, root, service.registry.host,
                         time.time(), failed)
        from gateway.sandbox.recovery import network_ready

        await network_ready(service, rec)
        what = "adopted" if failed is None else "adopted FAILED"
        service.registry.insert_sandbox(rec, event="adopt",
                                        cause=f"{what} from {from_host or 'another host'}",
                                        replace_destroyed=True)
    except BaseException as exc:
        await asyncio.shield(_undo(service, sandbox_id, slot, *leftovers))
        if isinstance(exc, (SnapshotError, DiskError, OSError, ValueError, KeyError)):
            raise AdoptionError(f"adopting {sandbox_id}: {exc}") from exc
        raise
    finally:
        if slot is not None:
            service.release_slot(slot)
    log.warning("sandbox %s adopted%s from %s (slot %d, golden %s)", sandbox_id,
                "" if failed is None else (" FAILED with its last disk" if fetch else
                                           " FAILED with nothing"),
                from_host or "another host", rec.slot, golden.dir)
    return rec


def _keep_disk(staging: Path, root: Path, plan: Relocated, disk: Path, keep: Path) -> None:
    """Of the fetched, rewritten snapshot in ``staging`` keep only the disk, at ``disk``
    (the sandbox's own disk under ``root``); its memory and device state go."""
    entry = plan.files.get("disk")
    if entry is None:
        raise AdoptionError("the snapshot names no disk")
    path = Path(str(entry["path"]))
    src = staging / path.relative_to(root) if path.is_absolute() else staging / "snapshot" / path
    keep.mkdir()
    os.replace(src, keep / disk.relative_to(root))
    shutil.rmtree(staging)
    os.replace(keep, root)


def _golden_for_lost(images_dir: Path, base: str, template: str) -> Golden:
    """The golden a sandbox registered with nothing names (it is never booted: its row
    needs one): its base's if held, else one of its template, else any."""
    found = local_bases(images_dir)
    if base in found:
        return load_golden_dir(found[base])
    goldens = []
    for path in found.values():
        with contextlib.suppress(Exception):
            goldens.append(load_golden_dir(path))
    if not goldens:
        raise AdoptionError("this host holds no golden at all")
    return next((g for g in goldens if g.template == template), goldens[0])


async def _undo(service: Any, sandbox_id: str, slot: int | None, *paths: Path) -> None:
    """Remove everything a failed adoption made (it has no registry row)."""
    if service.registry.get(sandbox_id) is not None and \
            service.registry.get(sandbox_id).state is not State.DESTROYED:
        return  # inserted: it is a local sandbox now, not ours to undo
    if slot is not None:
        with contextlib.suppress(Exception):
            await network.destroy(network.slot_for(slot, sandbox_id,
                                                   service.backend.config.network))
    await asyncio.to_thread(_remove, *paths)


def _remove(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def adoptable(registry: Any, sandbox_id: str) -> bool:
    """May a record naming this host be adopted here: no local row, or a DESTROYED one
    left by an eviction (it was moved away, and now back). A sandbox destroyed here
    (its record not yet deleted) is not brought back."""
    rec = registry.get(sandbox_id)
    if rec is None:
        return True
    if rec.state is not State.DESTROYED:
        return False
    rows = registry.transitions(sandbox_id)
    return bool(rows) and str(rows[-1].get("cause", "")).startswith(EVICTED)


async def evict(service: Any, sandbox_id: str, holder: str) -> bool:
    """Destroy the local copy of a sandbox the fleet gave to ``holder`` (it was moved
    while this host was cut off or down): its VMM, namespace and files; the row goes
    DESTROYED. The publisher never writes a record another host holds, so the record
    stays ``holder``'s. False if there is no local copy."""
    rec = service.registry.get(sandbox_id)
    if rec is None or rec.state is State.DESTROYED:
        return False
    ctl = service.controller(rec)
    await ctl.destroy(f"{EVICTED}{holder} while this host was away")
    service.forget(sandbox_id)
    log.warning("sandbox %s: local copy destroyed, host %s holds it now", sandbox_id, holder)
    return True


DELETED_AFTER_MOVE = ("its record was deleted by the host it moved to while this host was "
                      "away (deleted there by its owner)")


async def discard(service: Any, sandbox_id: str) -> bool:
    """Destroy the local copy of a sandbox this host had published whose record is gone:
    moved away while this host was down or cut off, then deleted on its new host
    (gateway.cluster.publisher). The eviction's path (VMM, namespace, files; the row goes
    DESTROYED), with a cause that never makes it adoptable again. False if no local copy."""
    rec = service.registry.get(sandbox_id)
    if rec is None or rec.state is State.DESTROYED:
        return False
    ctl = service.controller(rec)
    await ctl.destroy(DELETED_AFTER_MOVE)
    service.forget(sandbox_id)
    log.warning("sandbox %s: local copy destroyed: %s", sandbox_id, DELETED_AFTER_MOVE)
    return True
