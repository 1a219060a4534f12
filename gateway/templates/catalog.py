"""Template catalog: the built-in goldens and every tenant's own templates.

Theory of operation
-------------------
A *template* is a name that resolves to a golden snapshot directory (``vmctl.golden``:
device state + memory + disk + manifest). Built-in templates come from the config
(``[sandbox] templates``) and are shared by every key. Tenant templates are made by
``POST /v1/sandboxes/{id}/snapshot`` (source ``snapshot``), anonymously by a fork
(``fork``), or from a Dockerfile (``dockerfile``); each has a row in the registry's
``templates`` table and a directory of its own under ``DATA_DIR/templates/<id>/``.

Names are tenant-scoped: two keys may both have ``my-env``. A tenant template may not
take a built-in name (409 ``template_exists``), so ``python`` means the same thing for
everyone; a key's own name is resolved only for that key.

A sandbox's disk is a qcow2 overlay over its template's disk, and a tenant template's
disk is itself an overlay over its source sandbox's template (``parent``), down to a
built-in golden (``base``). Files therefore go only when nothing depends on them:
``delete`` removes the name at once (state ``deleting``; the name is free again) and
``collect`` removes the files of every deleting template that no live sandbox and no
other template uses (run after each sandbox is destroyed, each delete, and at start-up,
so it survives a daemon restart). Fork templates never have a listed name: they are
collected as soon as the last fork is gone. ``pinned`` keeps a template from being
collected while a fork is still creating its sandboxes from it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.http import wire
from gateway.errors import Conflict, TemplateNotFound, Unavailable
from gateway.sandbox.goldens import Golden, load_golden_dir
from gateway.sandbox.states import State
from gateway.store.registry import Registry

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MAX_CHAIN = 10  # tenant templates stacked on one another (qcow2 backing chain depth)


class Source(enum.Enum):
    BUILTIN = "builtin"
    SNAPSHOT = "snapshot"
    FORK = "fork"
    DOCKERFILE = "dockerfile"


class TemplateState(enum.Enum):
    READY = "ready"
    BUILDING = "building"  # a built-in whose golden is still being built (not yet servable)
    DELETING = "deleting"  # name gone; files kept until nothing depends on them


@dataclass(frozen=True)
class Template:
    """One catalog entry (tenant ``""`` for built-ins)."""

    id: str
    tenant: str
    name: str
    golden_dir: str
    source: Source
    state: TemplateState
    created_at: float
    parent: str | None = None  # golden dir this one's disk is an overlay over
    base: str | None = None  # the built-in golden at the bottom of the chain
    size_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def view(self, default: str = "") -> wire.Template:
        """The API's Template object (no host paths)."""
        progress = self.meta.get("progress")
        if isinstance(progress, str):  # a progress line (TemplateCatalog.building)
            progress = wire.TemplateProgress(last=progress)
        return wire.Template(
            name=self.name, source=self.source.value,  # type: ignore[arg-type]
            state=self.state.value,  # type: ignore[arg-type]
            owner="tenant" if self.tenant else "builtin",
            default=bool(default) and self.name == default and not self.tenant,
            created_at=self.created_at, size_bytes=self.size_bytes,
            mem_mib=self.meta.get("mem_mib"), progress=progress,
            from_sandbox=self.meta.get("from_sandbox"))


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        from gateway.errors import BadRequest
        raise BadRequest("a template name is 1-63 characters of [a-z0-9._-], starting with a "
                         "letter or digit", code="bad_template_name")
    return name


def collectable(templates: Iterable[Template], live_goldens: set[str],
                pinned: set[str]) -> list[Template]:
    """Deleting (or fork) templates that no live sandbox, no other kept template and no
    pin uses, repeated down the chain (decision only: no I/O)."""
    alive = {t.id: t for t in templates}
    out: list[Template] = []
    while True:
        used = live_goldens | pinned | {t.parent for t in alive.values() if t.parent}
        gone = [t for t in alive.values() if t.state is TemplateState.DELETING
                and t.golden_dir not in used]
        if not gone:
            return out
        for t in gone:
            del alive[t.id]
        out += gone


class TemplateCatalog:
    """Resolves template names for a tenant and owns tenant templates' rows and files."""

    def __init__(self, registry: Registry, root: Path, builtins: dict[str, Golden],
                 builtin_names: Iterable[str] = ()) -> None:
        self.registry = registry
        self.root = root  # DATA_DIR/templates
        self.builtins = builtins  # shared with the service: name -> Golden
        self.reserved = set(builtin_names) | set(builtins)
        self.building: dict[str, str] = {}  # built-in name -> progress, while it builds
        self._pinned: set[str] = set()

    # -- names -> goldens ----------------------------------------------------------

    def resolve(self, tenant: str, name: str) -> Golden:
        """The golden snapshot ``name`` means for ``tenant``; TemplateNotFound if none."""
        golden = self.builtins.get(name)
        if golden is not None:
            return golden
        if name in self.building:
            raise Unavailable(f"template {name!r} is still being built "
                              f"({self.building[name]})", code="template_building",
                              headers={"Retry-After": "30"})
        t = self.get(tenant, name)
        if t is None:
            raise TemplateNotFound(f"template {name!r} not found; available: "
                                   f"{', '.join(self.names(tenant)) or 'none'}")
        return load_golden_dir(Path(t.golden_dir))

    def get(self, tenant: str, name: str) -> Template | None:
        for t in self._rows(tenant):
            if t.name == name and t.state is not TemplateState.DELETING:
                return t
        return None

    def names(self, tenant: str) -> list[str]:
        return sorted(self.builtins) + [t.name for t in self.list(tenant) if t.tenant]

    def list(self, tenant: str) -> list[Template]:
        """Built-ins (ready and building), then the tenant's own (not forks or deleted)."""
        out = [Template(id=f"builtin:{name}", tenant="", name=name, golden_dir=str(g.dir),
                        source=Source.BUILTIN, state=TemplateState.READY, created_at=0.0,
                        meta={"mem_mib": g.mem_mib}) for name, g in self.builtins.items()]
        out += [Template(id=f"builtin:{name}", tenant="", name=name, golden_dir="",
                         source=Source.BUILTIN, state=TemplateState.BUILDING, created_at=0.0,
                         meta={"progress": progress})
                for name, progress in self.building.items() if name not in self.builtins]
        return out + [t for t in self._rows(tenant) if t.state is not TemplateState.DELETING
                      and t.source is not Source.FORK]

    # -- tenant templates ------------------------------------------------------------

    def new_dir(self) -> tuple[str, Path]:
        """An id and the (not yet existing) directory its files go to."""
        template_id = "tpl_" + secrets.token_hex(8)
        return template_id, self.root / template_id

    def check_new(self, tenant: str, name: str) -> None:
        """Refuse a name that is a built-in's or already the tenant's (409)."""
        if name in self.reserved or name in self.builtins or name in self.building:
            raise Conflict(f"{name!r} is a built-in template name", code="template_exists")
        if self.get(tenant, name) is not None:
            raise Conflict(f"template {name!r} exists; delete it first", code="template_exists")

    def add(self, tenant: str, name: str, golden_dir: Path, source: str | Source,
            parent: Path | None = None, template_id: str | None = None,
            meta: dict[str, Any] | None = None) -> wire.Template:
        """Register a complete golden directory as ``tenant``'s template ``name``."""
        src = Source(source)
        if src is not Source.FORK:
            validate_name(name)
            self.check_new(tenant, name)
        parent_t = self._by_dir(str(parent)) if parent is not None else None
        t = Template(id=template_id or golden_dir.name, tenant=tenant, name=name,
                     golden_dir=str(golden_dir), source=src, state=TemplateState.READY,
                     created_at=time.time(), parent=str(parent) if parent else None,
                     base=(parent_t.base if parent_t else str(parent) if parent else None),
                     size_bytes=_tree_bytes(golden_dir), meta=dict(meta or {}))
        row = {k: getattr(t, k) for k in ("id", "tenant", "name", "golden_dir", "created_at",
                                          "parent", "base", "size_bytes", "meta")}
        self.registry.insert_template(row | {"source": t.source.value, "state": t.state.value})
        return t.view()

    def chain_depth(self, golden_dir: str) -> int:
        depth, t = 0, self._by_dir(golden_dir)
        while t is not None and depth <= MAX_CHAIN:
            depth, t = depth + 1, self._by_dir(t.parent) if t.parent else None
        return depth

    def delete(self, tenant: str, name: str) -> None:
        """Remove the name now; the files go once nothing depends on them."""
        if name in self.builtins or name in self.reserved:
            raise Conflict(f"{name!r} is a built-in template; it cannot be deleted",
                           code="template_builtin")
        t = self.get(tenant, name)
        if t is None:
            raise TemplateNotFound(f"template {name!r} not found")
        self.registry.update_template(t.id, state=TemplateState.DELETING.value)
        self.collect()

    def release(self, template_id: str) -> None:
        """Mark an anonymous (fork) template for collection once its forks are gone."""
        self.registry.update_template(template_id, state=TemplateState.DELETING.value)

    @contextlib.contextmanager
    def pinned(self, golden_dir: str) -> Iterator[None]:
        self._pinned.add(golden_dir)
        try:
            yield
        finally:
            self._pinned.discard(golden_dir)

    def collect(self, startup: bool = False) -> list[str]:
        """Delete the files and rows of templates nothing uses; returns their ids.
        ``startup``: no snapshot is in progress, so temp directories go too."""
        live = {r.golden for r in self.registry.list() if r.state is not State.DESTROYED}
        gone = collectable(self._rows(None), live, self._pinned)
        for t in gone:
            shutil.rmtree(t.golden_dir, ignore_errors=True)
            self.registry.delete_template(t.id)
            log.info("template %s (%s of %s) removed: nothing uses it", t.id, t.name, t.tenant)
        self._remove_strays(startup)
        return [t.id for t in gone]

    def disk_bytes(self, tenant: str) -> int:
        """What the tenant's templates occupy (kept deleting ones included)."""
        return sum(t.size_bytes for t in self._rows(tenant))

    def in_use_bases(self) -> set[Path]:
        """Built-in golden directories that tenant templates are built on (for image GC)."""
        return {Path(t.base) for t in self._rows(None) if t.base}

    # -- internals -----------------------------------------------------------------

    def _rows(self, tenant: str | None) -> list[Template]:
        return [_template(r) for r in self.registry.list_templates(tenant)]

    def _by_dir(self, golden_dir: str) -> Template | None:
        return next((t for t in self._rows(None) if t.golden_dir == golden_dir), None)

    def _remove_strays(self, startup: bool) -> None:
        """Directories under the root no row owns: a snapshot interrupted by a crash (or,
        while the daemon runs, one being written: temp names start with '.')."""
        if not self.root.is_dir():
            return
        known = {Path(t.golden_dir).name for t in self._rows(None)}
        for path in self.root.iterdir():
            if path.name not in known and (startup or not path.name.startswith(".")):
                log.warning("removing template files no registry row owns: %s", path)
                shutil.rmtree(path, ignore_errors=True)


def _template(row: dict[str, Any]) -> Template:
    return Template(id=row["id"], tenant=row["tenant"], name=row["name"],
                    golden_dir=row["golden_dir"], source=Source(row["source"]),
                    state=TemplateState(row["state"]), created_at=row["created_at"],
                    parent=row["parent"], base=row["base"], size_bytes=row["size_bytes"],
                    meta=row["meta"])


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())
