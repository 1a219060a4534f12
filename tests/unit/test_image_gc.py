import os
import time

from gateway.templates import image_gc
from gateway.sandbox.states import State
from gateway.store.registry import Registry, SandboxRecord


def _build(images, template, name, age):
    d = images / template / name
    (d / "golden-qemu-tcg-512M").mkdir(parents=True)
    (d / "rootfs.ext4").write_bytes(b"x" * 4096)
    (d / image_gc.MANIFEST).write_text("{}")
    t = time.time() - age
    os.utime(d / image_gc.MANIFEST, (t, t))
    return d


def test_keeps_newest_and_builds_in_use(tmp_path):
    images = tmp_path / "images"
    old_unused = _build(images, "python", "a", 300)
    old_used = _build(images, "python", "b", 200)
    newest = _build(images, "python", "c", 100)
    only = _build(images, "node", "n", 100)
    (images / "python" / ".half-built").mkdir()  # in progress: never touched
    data = tmp_path / "data"
    data.mkdir()
    reg = Registry(data / "registry.sqlite")
    now = time.time()
    reg.insert_sandbox(SandboxRecord(
        id="s1", tenant="t", template="python", state=State.CREATING, slot=0, root="/r",
        golden=str(old_used / "golden-qemu-tcg-512M"), idle_timeout=0, host="h",
        created_at=now, updated_at=now, last_activity=now))
    reg.close()

    gc = image_gc.plan(images, image_gc.in_use([data]))
    assert gc.remove == [old_unused]
    assert gc.keep_in_use == [old_used] and set(gc.keep_newest) == {newest, only}
    assert image_gc.apply(gc) > 0
    assert not old_unused.exists() and old_used.exists()
    assert (images / "python" / ".half-built").exists()
