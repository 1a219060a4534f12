"""The build cache's bound: real qcow2 chains, templates that stand on layers, LRU order."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.builds import layer_cache
from gateway.builds.layer_cache import Entry, plan

QEMU_IMG, QEMU_IO = shutil.which("qemu-img"), shutil.which("qemu-io")


def e(name: str, mtime: float, size: int = 10, under: tuple[str, ...] = (),
      pinned: bool = False) -> Entry:
    return Entry(Path(name), mtime, size, frozenset(Path(u) for u in under), pinned)


def test_plan_removes_the_least_recently_used_until_it_fits():
    entries = [e("a", 3), e("b", 1), e("c", 2)]
    assert [x.path.name for x in plan(entries, budget=10)] == ["b", "c"]
    assert plan(entries, budget=30) == []


def test_plan_removes_what_stands_on_a_layer_before_the_layer():
    # base (oldest) <- mid <- top; a golden over top. The golden goes first, then top, mid.
    entries = [e("base", 1), e("mid", 2, under=("base",)), e("top", 3, under=("mid", "base")),
               e("golden-x", 4, under=("top", "mid", "base"))]
    order = [x.path.name for x in plan(entries, budget=0)]
    assert order == ["golden-x", "top", "mid", "base"]


def test_plan_keeps_what_a_template_stands_on_and_may_not_fit():
    entries = [e("base", 1, pinned=True), e("mid", 2, under=("base",), pinned=True),
               e("other", 5)]
    assert [x.path.name for x in plan(entries, budget=0)] == ["other"]


def qcow2(path: Path, backing: Path | None = None, data: int = 0) -> Path:
    args = [QEMU_IMG, "create", "-q", "-f", "qcow2"]
    if backing is not None:
        args += ["-b", str(backing), "-F", "qcow2"]
    subprocess.run([*args, str(path), "64M"], check=True)
    if data:
        subprocess.run([QEMU_IO, "-f", "qcow2", "-c", f"write 0 {data}", str(path)],
                       check=True, capture_output=True)
    return path


@pytest.mark.skipif(None in (QEMU_IMG, QEMU_IO), reason="needs qemu-img and qemu-io")
def test_collect_on_real_chains(tmp_path):
    cache, templates = tmp_path / "build-cache", tmp_path / "templates"
    cache.mkdir()
    templates.mkdir()
    mib = 1 << 20
    # A used chain: base <- l1 <- golden-used (its template hard-links the golden's disk).
    base = qcow2(cache / "base.qcow2", data=2 * mib)
    l1 = qcow2(cache / "l1.qcow2", base, data=2 * mib)
    used = cache / "golden-used"
    used.mkdir()
    qcow2(used / "disk.qcow2", l1, data=mib)
    (templates / "t1").mkdir()
    os.link(used / "disk.qcow2", templates / "t1" / "disk.qcow2")
    # An unused chain (a failed build's layers), older than everything else.
    old = qcow2(cache / "old.qcow2", data=2 * mib)
    old_top = qcow2(cache / "old-top.qcow2", old, data=2 * mib)
    for i, path in enumerate([old, old_top, base, l1, used]):
        os.utime(path, (1000 + i, 1000 + i))
    (cache / ".work-abc").mkdir()  # a build in progress: never counted or touched

    removed = layer_cache.collect(cache, templates, budget=6 * mib)
    assert [p.name for p in removed] == ["old-top.qcow2", "old.qcow2"]
    removed = layer_cache.collect(cache, templates, budget=0)
    # The golden's disk is linked by the template: removing it frees nothing, but it goes;
    # the layers under the template's disk stay.
    assert [p.name for p in removed] == ["golden-used"]
    assert base.is_file() and l1.is_file() and (templates / "t1" / "disk.qcow2").is_file()
    assert (cache / ".work-abc").is_dir()
    # The template deleted: now its layers may go too (top first).
    shutil.rmtree(templates / "t1")
    assert [p.name for p in layer_cache.collect(cache, templates, budget=0)] == [
        "l1.qcow2", "base.qcow2"]


@pytest.mark.skipif(None in (QEMU_IMG, QEMU_IO), reason="needs qemu-img and qemu-io")
def test_touch_makes_an_entry_the_last_to_go(tmp_path):
    cache = tmp_path / "build-cache"
    cache.mkdir()
    a, b = qcow2(cache / "a.qcow2", data=1 << 20), qcow2(cache / "b.qcow2", data=1 << 20)
    os.utime(a, (1000, 1000))
    os.utime(b, (2000, 2000))
    layer_cache.touch(a)
    one = layer_cache._freeable(a)  # the data and qcow2's own metadata
    assert [p.name for p in layer_cache.collect(cache, tmp_path / "none", budget=one)] == [
        "b.qcow2"]
