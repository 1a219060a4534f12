"""The template catalog (gateway/templates/catalog.py): names per tenant, built-ins not shadowed,
files kept while anything depends on them and removed once nothing does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.http import wire
from gateway.errors import BadRequest, Conflict, TemplateNotFound, Unavailable
from gateway.sandbox.states import Event, State
from gateway.store.registry import Registry, SandboxRecord
from gateway.templates.catalog import Source, Template, TemplateCatalog, TemplateState, collectable
from vmctl import store
from vmctl.golden import Golden
from vmctl.spec import Accel, SnapshotFiles


def _golden_dir(path: Path, name: str = "python") -> Path:
    """A loadable golden directory (tiny files, a real manifest)."""
    path.mkdir(parents=True)
    for f in ("vmstate", "memory", "disk.qcow2"):
        (path / f).write_bytes(b"x" * 10)
    snap = SnapshotFiles(path / "vmstate", path / "memory", path / "disk.qcow2", Accel.TCG,
                         "qemu")
    store.write_manifest(path, snap, {"template": name, "kernel": "/k", "initrd": None,
                                      "cmdline": "console=ttyS0", "mem_mib": 256})
    return path


@pytest.fixture
def env(tmp_path: Path):
    registry = Registry(tmp_path / "registry.sqlite")
    gdir = _golden_dir(tmp_path / "images" / "python" / "h" / "golden")
    snap, _ = store.load(gdir)
    builtin = Golden("python", gdir, snap, Path("/k"), None, "console=ttyS0", 256)
    catalog = TemplateCatalog(registry, tmp_path / "data" / "templates", {"python": builtin},
                              ["python", "node"])
    yield catalog, registry, gdir
    registry.close()


def _new(catalog: TemplateCatalog, parent: Path, source: str = "snapshot",
         name: str = "mine", tenant: str = "key_a") -> Path:
    tid, path = catalog.new_dir()
    _golden_dir(path, name)
    catalog.add(tenant, name, path, source, parent=parent, template_id=tid)
    return path


def _sandbox(registry: Registry, golden: Path, sid: str = "sb1",
             state: State = State.RUNNING) -> None:
    now = time.time()
    registry.insert_sandbox(SandboxRecord(
        id=sid, tenant="key_a", template="mine", state=state, slot=1, root="/nonexistent",
        golden=str(golden), idle_timeout=0, host="h", created_at=now, updated_at=now,
        last_activity=now))


def test_builtins_resolve_for_everyone_tenant_templates_only_for_their_key(env) -> None:
    catalog, _, gdir = env
    assert catalog.resolve("anyone", "python").dir == gdir
    path = _new(catalog, gdir)
    assert catalog.resolve("key_a", "mine").dir == path
    assert catalog.resolve("key_a", "mine").mem_mib == 256
    with pytest.raises(TemplateNotFound):
        catalog.resolve("key_b", "mine")
    assert [t.name for t in catalog.list("key_b")] == ["python"]
    assert [(t.name, t.source) for t in catalog.list("key_a")] == [
        ("python", Source.BUILTIN), ("mine", Source.SNAPSHOT)]


def test_names_may_not_shadow_builtins_or_repeat_and_must_be_valid(env) -> None:
    catalog, _, gdir = env
    for name in ("python", "node"):  # "node" is configured, even though not built
        with pytest.raises(Conflict) as exc:
            catalog.check_new("key_a", name)
        assert exc.value.code == "template_exists"
    _new(catalog, gdir)
    with pytest.raises(Conflict):
        catalog.check_new("key_a", "mine")
    catalog.check_new("key_b", "mine")  # tenant-scoped
    for bad in ("", "Up", "-x", "a/b", "x" * 64, 3):
        with pytest.raises(BadRequest):
            catalog.add("key_a", bad, gdir, "snapshot")  # type: ignore[arg-type]
    with pytest.raises(Conflict) as exc:
        catalog.delete("key_a", "python")
    assert exc.value.code == "template_builtin"


def test_delete_without_dependents_removes_files_and_frees_the_name(env) -> None:
    catalog, registry, gdir = env
    path = _new(catalog, gdir)
    catalog.delete("key_a", "mine")
    assert not path.exists() and registry.list_templates() == []
    with pytest.raises(TemplateNotFound):
        catalog.delete("key_a", "mine")


def test_delete_keeps_files_until_the_last_dependent_sandbox_goes(env) -> None:
    catalog, registry, gdir = env
    path = _new(catalog, gdir)
    _sandbox(registry, path)
    catalog.delete("key_a", "mine")
    assert path.is_dir()  # its sandbox still uses the files
    with pytest.raises(TemplateNotFound):
        catalog.resolve("key_a", "mine")  # but the name is gone...
    _new(catalog, gdir)  # ...and free for a new template
    registry.transition("sb1", Event.DESTROY)
    catalog.collect()
    assert not path.exists()
    assert [t.name for t in catalog.list("key_a")] == ["python", "mine"]


def test_a_template_built_on_another_keeps_it(env) -> None:
    catalog, _, gdir = env
    first = _new(catalog, gdir, name="first")
    second = _new(catalog, first, name="second")
    assert catalog.chain_depth(str(second)) == 2
    catalog.delete("key_a", "first")
    assert first.is_dir()
    catalog.delete("key_a", "second")
    assert not first.exists() and not second.exists()


def test_fork_templates_are_unlisted_pinned_while_forking_and_collected_after(env) -> None:
    catalog, registry, gdir = env
    tid, path = catalog.new_dir()
    _golden_dir(path)
    with catalog.pinned(str(path)):
        catalog.add("key_a", "~fork", path, "fork", parent=gdir, template_id=tid)
        catalog.release(tid)
        catalog.collect()
        assert path.is_dir()
        _sandbox(registry, path)
    assert [t.name for t in catalog.list("key_a")] == ["python"]
    catalog.collect()
    assert path.is_dir()
    registry.transition("sb1", Event.DESTROY)
    catalog.collect()
    assert not path.exists()


def test_state_survives_a_new_catalog_and_strays_go_at_start_up(env, tmp_path) -> None:
    catalog, registry, gdir = env
    path = _new(catalog, gdir)
    stray = catalog.root / ".tmp-interrupted"
    stray.mkdir()
    again = TemplateCatalog(registry, catalog.root, catalog.builtins, ["python"])
    again.collect()
    assert stray.is_dir()  # may be a snapshot being written right now
    again.collect(startup=True)
    assert not stray.exists() and path.is_dir()
    assert again.resolve("key_a", "mine").dir == path
    assert again.in_use_bases() == {gdir}
    assert again.disk_bytes("key_a") > 0 and again.disk_bytes("key_b") == 0


def test_building_builtins_answer_503_and_are_listed(env) -> None:
    catalog, _, _ = env
    catalog.building["node"] = "step 3/7"
    with pytest.raises(Unavailable) as exc:
        catalog.resolve("key_a", "node")
    assert exc.value.code == "template_building"
    views = {t.name: wire.encode(t.view("python")) for t in catalog.list("key_a")}
    assert views["node"]["state"] == "building"
    assert views["node"]["progress"]["last"] == "step 3/7"
    assert views["python"]["default"] is True and "golden_dir" not in views["python"]


def test_collectable_is_a_fixpoint_over_the_chain() -> None:
    def t(tid: str, parent: str | None, state=TemplateState.DELETING) -> Template:
        return Template(tid, "k", tid, tid, Source.SNAPSHOT, state, 0.0, parent=parent)

    chain = [t("a", "builtin"), t("b", "a"), t("c", "b")]
    assert [x.id for x in collectable(chain, set(), set())] == ["c", "b", "a"]
    assert collectable(chain, {"c"}, set()) == []
    assert [x.id for x in collectable(chain, {"b"}, set())] == ["c"]
    kept = [t("a", "builtin"), t("b", "a", TemplateState.READY)]
    assert collectable(kept, set(), set()) == []
