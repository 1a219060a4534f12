"""Adoption's host side (gateway.sandbox.adoption): a snapshot made on "host A" (its own
data dir and golden), shipped through an in-memory store, adopted on "host B": paths,
the qcow2 overlay's backing file and the stat checks rewritten, a SUSPENDED row
inserted; failures leave nothing. Real files and qemu-img; the network is faked."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.cluster.shipping import Index, SnapshotRefused, describe, fetch, plan_upload, upload
from gateway.sandbox import adoption
from gateway.sandbox.adoption import AdoptionError, old_root_of, record_for, relocate
from gateway.sandbox.shipped import base_identity, describe_suspended, local_bases
from gateway.sandbox.states import State
from gateway.store.registry import Registry, SandboxRecord
from tests.unit.test_cluster_shipping import MemStore
from vmctl import store
from vmctl.disks import QemuLayout
from vmctl.spec import Accel, SnapshotFiles

needs_qemu_img = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="no qemu-img")
SID = "0123abcd4567ef89"


async def qemu_img(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec("qemu-img", *argv,
                                                stdout=asyncio.subprocess.DEVNULL)
    assert await proc.wait() == 0


async def make_golden(images: Path) -> Path:
    """A golden as vmctl.golden lays it out: images/python/{build}/golden-.../"""
    d = images / "python" / "build1" / "golden-qemu-tcg-512M-r3"
    d.mkdir(parents=True)
    (d / "vmstate").write_bytes(b"golden state")
    (d / "memory").write_bytes(b"\0" * 4096)
    await qemu_img("create", "-q", "-f", "qcow2", str(d / "disk.qcow2"), "64M")
    store.write_manifest(d, SnapshotFiles(d / "vmstate", d / "memory", d / "disk.qcow2",
                                          Accel.TCG, "qemu"),
                         meta={"template": "python", "mem_mib": 512, "vcpus": 1,
                               "kernel": "/k", "cmdline": "c", "initrd": None})
    return d


async def suspended_on_a(tmp: Path, golden: Path) -> SandboxRecord:
    """A sandbox suspended on host A: QEMU's layout, manifest as Machine.suspend writes it."""
    root = tmp / "hostA" / "sandboxes" / SID
    snap = root / "snapshot"
    snap.mkdir(parents=True)
    (root / "memory").write_bytes(b"guest ram " * 400)
    await qemu_img("create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                   str(golden / "disk.qcow2"), str(root / "disk.qcow2"))
    (snap / "vmstate").write_bytes(b"device state")
    store.write_manifest(snap, SnapshotFiles(snap / "vmstate", root / "memory",
                                             root / "disk.qcow2", Accel.TCG, "qemu"),
                         hash_roles=("state",), stat_roles=("memory", "disk"))
    return SandboxRecord(
        id=SID, tenant="t1", template="python", state=State.SUSPENDED, slot=3,
        root=str(root), golden=str(golden), idle_timeout=60.0, host="a", created_at=0.0,
        updated_at=0.0, last_activity=0.0, metadata={"k": "v"}, vcpus=1, memory_mib=512,
        egress={"allow": ["example.com"]})


async def ship(rec: SandboxRecord, objects: MemStore) -> str:
    found = describe_suspended(rec)
    assert found is not None
    files = await describe(found.directory, found.names)
    plan = plan_upload("p", Index(rec.id, found.base, files, found.meta))
    return await upload(objects, plan, found.directory)


class FakeService:
    """What adoption reads of a SandboxService (host B)."""

    def __init__(self, tmp: Path, images: Path) -> None:
        (tmp / "hostB").mkdir(exist_ok=True)
        self.registry = Registry(tmp / "hostB" / "registry.sqlite")
        self.sandboxes_dir = tmp / "hostB" / "sandboxes"
        self.config = SimpleNamespace(server=SimpleNamespace(images_dir=images))
        self.backend = SimpleNamespace(config=SimpleNamespace(network=None),
                                       layout=QemuLayout())
        self.claimed: set[int] = set()
        self.released: list[int] = []

    def claim_slot(self) -> int:
        slot = max(self.registry.used_slots() | self.claimed | {6}) + 1
        self.claimed.add(slot)
        return slot

    def release_slot(self, slot: int) -> None:
        self.claimed.discard(slot)
        self.released.append(slot)


@pytest.fixture
def no_network(monkeypatch):
    made = []

    async def network_ready(service, rec):
        made.append(rec.slot)

    async def destroy(slot):
        made.append(("destroyed", slot.index))

    import gateway.sandbox.recovery as recovery
    monkeypatch.setattr(recovery, "network_ready", network_ready)
    monkeypatch.setattr(adoption.network, "destroy", destroy)
    monkeypatch.setattr(adoption.network, "slot_for",
                        lambda index, vm_id, cfg: SimpleNamespace(index=index))
    return made


def fetcher(objects: MemStore, location: str, bases):
    async def fetched(dest: Path):
        index = await fetch(objects, location, dest, base=bases)
        return index.base, index.meta
    return fetched


@needs_qemu_img
async def test_a_snapshot_from_host_a_is_adopted_on_host_b(tmp_path, no_network):
    images_a, images_b = tmp_path / "imagesA", tmp_path / "imagesB"
    golden_a = await make_golden(images_a)
    shutil.copytree(images_a, images_b)  # the operator copied the images dir
    rec = await suspended_on_a(tmp_path, golden_a)
    objects = MemStore()
    location = await ship(rec, objects)
    base = base_identity(golden_a)
    assert list(local_bases(images_b)) == [base]
    shutil.rmtree(images_a)  # host A (and its golden) is gone
    shutil.rmtree(tmp_path / "hostA")
    service = FakeService(tmp_path, images_b)

    got = await adoption.adopt(service, SID, fetcher(objects, location, {base}), base=base,
                               from_host="a")
    root = service.sandboxes_dir / SID
    golden_b = images_b / "python" / "build1" / "golden-qemu-tcg-512M-r3"
    assert got == service.registry.get(SID)
    assert (got.state, got.tenant, got.template, got.root, got.golden) == (
        State.SUSPENDED, "t1", "python", str(root), str(golden_b))
    assert (got.vcpus, got.memory_mib, got.metadata, got.egress, got.idle_timeout) == (
        1, 512, {"k": "v"}, {"allow": ["example.com"]}, 60.0)
    assert got.slot == 7 and no_network == [7] and service.released == [7]
    # Every path names the new root; the overlay stands on B's golden; the manifest's stat
    # checks hold (a wake's load verifies them), and nothing of host A remains.
    text = (root / "snapshot" / "manifest.json").read_text()
    assert "hostA" not in text and str(root / "memory") in text
    assert await adoption.backing_file(root / "disk.qcow2") == str(
        (golden_b / "disk.qcow2").resolve())
    snap, _ = store.load(root / "snapshot")
    assert snap.memory == root / "memory" and snap.disk == root / "disk.qcow2"
    assert (root / "memory").read_bytes() == b"guest ram " * 400
    assert not list(service.sandboxes_dir.glob(".adopt-*"))
    rows = service.registry.transitions(SID)
    assert [(r["to_state"], r["event"]) for r in rows] == [("suspended", "adopt")]
    # Idempotent: adopting again returns the row, fetches nothing.
    async def no_fetch(dest):
        raise AssertionError("fetched twice")
    assert await adoption.adopt(service, SID, no_fetch) == got


@needs_qemu_img
async def test_a_failed_adoption_leaves_nothing_and_a_retry_starts_clean(tmp_path,
                                                                         no_network):
    images = tmp_path / "images"
    golden = await make_golden(images)
    rec = await suspended_on_a(tmp_path, golden)
    objects = MemStore()
    location = await ship(rec, objects)
    base = base_identity(golden)
    service = FakeService(tmp_path, images)
    # A crash mid-adoption left a staging dir and a half-made root: both are garbage.
    stale = adoption.staging_dir(service.sandboxes_dir, SID)
    (stale / "snapshot").mkdir(parents=True)
    (service.sandboxes_dir / SID).mkdir()
    (service.sandboxes_dir / SID / "junk").write_bytes(b"x")

    # A byte changed in the store: refused by the fetch; nothing registered or left.
    key = next(k for k in objects.objects if k.endswith("/memory"))
    good = objects.objects[key]
    objects.objects[key] = b"X" + good[1:]
    with pytest.raises(SnapshotRefused):
        await adoption.adopt(service, SID, fetcher(objects, location, {base}), base=base)
    assert service.registry.get(SID) is None
    assert sorted(p.name for p in service.sandboxes_dir.iterdir()) == []
    # No golden of its base here: refused before anything is downloaded.
    with pytest.raises(AdoptionError, match="no golden with base"):
        await adoption.adopt(service, SID, fetcher(objects, location, {base}), base="f" * 64)
    # The registry refuses the row (the insert fails after the namespace was made): the
    # namespace and the files go, the slot is released.
    objects.objects[key] = good

    def refuse(*args, **kwargs):
        raise ValueError("disk full")
    service.registry.insert_sandbox = refuse
    with pytest.raises(AdoptionError, match="disk full"):
        await adoption.adopt(service, SID, fetcher(objects, location, {base}), base=base)
    assert no_network == [7, ("destroyed", 7)] and service.claimed == set()
    assert sorted(p.name for p in service.sandboxes_dir.iterdir()) == []
    del service.registry.insert_sandbox
    got = await adoption.adopt(service, SID, fetcher(objects, location, {base}), base=base)
    assert got.state is State.SUSPENDED


@needs_qemu_img
async def test_a_failed_sandbox_is_adopted_with_only_its_last_disk_or_nothing(tmp_path,
                                                                               no_network):
    # Its host died while it ran: its last shipped snapshot's disk is all that is left.
    images = tmp_path / "images"
    golden = await make_golden(images)
    rec = await suspended_on_a(tmp_path, golden)
    objects = MemStore()
    location = await ship(rec, objects)
    base = base_identity(golden)
    shutil.rmtree(tmp_path / "hostA")
    service = FakeService(tmp_path, images)
    why = "host a died; it was running: its memory is lost; its disk is as of ..."
    got = await adoption.adopt(service, SID, fetcher(objects, location, {base}), base=base,
                               from_host="a", failed=why)
    root = service.sandboxes_dir / SID
    assert (got.state, got.failure, got.tenant, got.template) == (
        State.FAILED, why, "t1", "python")
    # Only the disk, where the sandbox's own disk lives, standing on this host's golden:
    # the memory and device state are not kept (a request cold-boots the disk).
    assert sorted(p.name for p in root.iterdir()) == ["disk.qcow2"]
    assert await adoption.backing_file(root / "disk.qcow2") == str(
        (golden / "disk.qcow2").resolve())
    assert not list(service.sandboxes_dir.glob(".adopt-*"))
    assert [(r["to_state"], r["event"]) for r in service.registry.transitions(SID)] == [
        ("failed", "adopt")]

    # Nothing was shipped: registered FAILED with nothing, from the record's words.
    other = "fedcba9876543210"
    lost = await adoption.adopt(service, other, None, failed="host a died; all lost",
                                meta={"tenant": "t2", "template": "python", "vcpus": 2})
    assert (lost.state, lost.failure, lost.tenant, lost.vcpus) == (
        State.FAILED, "host a died; all lost", "t2", 2)
    assert list((service.sandboxes_dir / other).iterdir()) == []
    assert lost.golden == str(golden) and lost.slot != got.slot
    with pytest.raises(AdoptionError, match="tenant"):
        await adoption.adopt(service, "00000000000000aa", None, failed="x", meta={})
    assert not (service.sandboxes_dir / "00000000000000aa").exists()


def test_relocate_moves_root_paths_and_points_a_compact_memory_at_this_golden(tmp_path):
    golden = SimpleNamespace(snapshot=SimpleNamespace(memory=Path("/imgB/g/memory")))
    files = {
        "state": {"path": "vmstate", "sha256": "0" * 64, "size": 1},
        "memory": {"path": f"/dataA/sandboxes/{SID}/memory", "size": 9, "mtime_ns": 5,
                   "diff": {"path": "memory.diff", "size": 3, "mtime_ns": 6,
                            "golden": "/imgA/g/memory"}},
        "disk": {"path": f"/dataA/sandboxes/{SID}/disk.qcow2", "size": 4, "mtime_ns": 7}}
    got = relocate(files, SID, Path(f"/dataB/sb/{SID}"), golden)
    assert got.files["memory"]["path"] == f"/dataB/sb/{SID}/memory"
    assert got.files["memory"]["diff"] == {"path": "memory.diff", "size": 3, "mtime_ns": 6,
                                           "golden": "/imgB/g/memory"}
    assert got.files["state"] == files["state"]
    assert got.overlay == f"/dataB/sb/{SID}/disk.qcow2" and got.compact
    assert old_root_of(f"/x/{SID}/memory", SID) == Path(f"/x/{SID}")
    assert old_root_of("/img/g/memory", SID) is None
    # The shipped index's root, when it names one, wins over the guess.
    again = relocate({"memory": {"path": "/r/memory"}}, SID, Path("/n"), golden, "/r")
    assert again.files["memory"]["path"] == "/n/memory" and not again.compact
    with pytest.raises(AdoptionError):
        relocate({"memory": {"path": "/elsewhere/memory"}}, SID, Path("/n"), golden, "/r")


def test_the_row_comes_from_the_index_meta(tmp_path):
    golden = SimpleNamespace(template="python", dir=Path("/g"), vcpus=1, mem_mib=512,
                             disk_mib=1216)
    meta = {"tenant": "t", "template": "python", "vcpus": 2, "memory_mib": 1024,
            "disk_mib": 0, "idle_timeout": 30, "metadata": {"a": 1}, "egress": None}
    rec = record_for(SID, meta, golden, 4, Path("/r"), "b", 10.0)
    assert (rec.state, rec.slot, rec.golden, rec.vcpus, rec.memory_mib, rec.host) == (
        State.SUSPENDED, 4, "/g", 2, 1024, "b")
    assert rec.asleep_since == 10.0 and rec.metadata == {"a": 1}
    with pytest.raises(AdoptionError, match="template"):
        record_for(SID, {**meta, "template": "node"}, golden, 4, Path("/r"), "b", 0.0)
    with pytest.raises(AdoptionError, match="tenant"):
        record_for(SID, {"template": "python"}, golden, 4, Path("/r"), "b", 0.0)


def test_adoptable_only_without_a_row_or_after_an_eviction(tmp_path):
    registry = Registry(tmp_path / "r.sqlite")
    assert adoption.adoptable(registry, SID)
    rec = SandboxRecord(id=SID, tenant="t", template="python", state=State.SUSPENDED, slot=1,
                        root="/r", golden="/g", idle_timeout=0.0, host="h", created_at=0.0,
                        updated_at=0.0, last_activity=0.0)
    registry.insert_sandbox(rec)
    assert not adoption.adoptable(registry, SID)
    from gateway.sandbox.states import Event
    registry.transition(SID, Event.DESTROY, cause="deleted by API")
    assert not adoption.adoptable(registry, SID)  # destroyed here: never brought back
    registry.insert_sandbox(rec, replace_destroyed=True)
    registry.transition(SID, Event.DESTROY, cause=f"{adoption.EVICTED}b while away")
    assert adoption.adoptable(registry, SID)  # evicted, now moved back: adopt again


def test_sweep_removes_staging_dirs(tmp_path):
    (tmp_path / ".adopt-x").mkdir()
    (tmp_path / ".adopt-x.fetching").mkdir()
    (tmp_path / "keep").mkdir()
    assert len(adoption.sweep(tmp_path)) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]
    assert json.dumps([]) == "[]"


async def test_a_discarded_copy_goes_destroyed_and_is_never_adopted_again(tmp_path):
    """adoption.discard: the eviction's path (the controller's destroy, the service
    forgets it), with a cause that names the delete and never makes it adoptable."""
    from gateway.sandbox.states import Event

    registry = Registry(tmp_path / "r.sqlite")
    rec = SandboxRecord(id=SID, tenant="t", template="python", state=State.SUSPENDED, slot=1,
                        root="/r", golden="/g", idle_timeout=0.0, host="h", created_at=0.0,
                        updated_at=0.0, last_activity=0.0)
    registry.insert_sandbox(rec)
    forgot = []

    class Ctl:
        async def destroy(self, cause):
            registry.transition(SID, Event.DESTROY, cause=cause)

    class Service:
        def __init__(self):
            self.registry = registry

        def controller(self, row):
            assert row.id == SID
            return Ctl()

        def forget(self, sandbox_id):
            forgot.append(sandbox_id)

    assert await adoption.discard(Service(), SID)
    assert registry.get(SID).state is State.DESTROYED and forgot == [SID]
    assert "deleted" in registry.transitions(SID)[-1]["cause"]
    assert not adoption.adoptable(registry, SID)
    assert not await adoption.discard(Service(), SID)  # no live copy: nothing
    assert not await adoption.discard(Service(), "other")
