"""Garbage collection of old template builds.

Builds are never deleted automatically: a sandbox's disk layer uses its
template build's golden disk as a qcow2 backing file, so deleting a build in use
destroys that sandbox's disk. ``plan`` lists what can go: every build of a
template except its newest, and except builds that a live sandbox or a tenant
template (in any of the given registries) was made from. Several daemons may share one images
directory, so the operator passes every data directory that uses it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from gateway.store.registry import Registry

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class GcPlan:
    remove: list[Path]
    keep_in_use: list[Path]
    keep_newest: list[Path]


def builds(images_dir: Path) -> dict[str, list[Path]]:
    """Complete builds per template, oldest first (by manifest mtime)."""
    out: dict[str, list[Path]] = {}
    for template in sorted(p for p in images_dir.iterdir() if p.is_dir()):
        done = [b for b in template.iterdir() if b.is_dir() and not b.name.startswith(".")
                and (b / MANIFEST).is_file()]
        if done:
            out[template.name] = sorted(done, key=lambda b: (b / MANIFEST).stat().st_mtime)
    return out


def in_use(data_dirs: list[Path]) -> set[Path]:
    """Template build directories that live sandboxes were made from."""
    used: set[Path] = set()
    for data_dir in data_dirs:
        db = data_dir / "registry.sqlite"
        if not db.is_file():
            raise FileNotFoundError(f"no registry in {data_dir}")
        registry = Registry(db)
        try:
            used |= {Path(rec.golden).parent.resolve() for rec in registry.list()}
            # Tenant templates' disks are overlays over a built-in build
            # (gateway/templates/catalog.py).
            used |= {Path(t["base"]).parent.resolve() for t in registry.list_templates()
                     if t["base"]}
        finally:
            registry.close()
    return used


def plan(images_dir: Path, used: set[Path]) -> GcPlan:
    remove, keep_used, keep_new = [], [], []
    for template_builds in builds(images_dir).values():
        *older, newest = template_builds
        keep_new.append(newest)
        for build in older:
            (keep_used if build.resolve() in used else remove).append(build)
    return GcPlan(remove, keep_used, keep_new)


def apply(gc: GcPlan) -> int:
    """Delete the planned builds; returns bytes freed (apparent size)."""
    freed = 0
    for build in gc.remove:
        freed += sum(f.stat().st_blocks * 512 for f in build.rglob("*") if f.is_file())
        shutil.rmtree(build)
    return freed
