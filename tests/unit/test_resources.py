"""Shape decisions (gateway.sandbox.resources), their config and key limits, the disk quota,
golden naming per shape (vmctl.golden) and the guest's grow command (vmctl.disk_grow)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.http import wire
from gateway.config import ConfigError, load
from gateway.errors import BadRequest, Forbidden, QuotaExceeded
from gateway.tenancy.quotas import Limits, Usage, check_create, parse_overrides
from gateway.store.registry import Registry
from gateway.sandbox.resources import (
    ResourceLimits,
    ResourcesConfig,
    Shape,
    ShapeRequest,
    resolve,
)
from vmctl.disk_grow import grow_command
from vmctl.golden import _mem_from_name, _vcpus_from_name, golden_dir

DEFAULT = Shape(vcpus=1, memory_mib=512, disk_mib=1216)
TEMPLATE = ResourceLimits(max_vcpus=2, max_memory_mib=4096, max_disk_mib=16384)
NO_KEY_LIMIT = ResourceLimits()


def shape(**asked: int) -> Shape:
    return resolve(ShapeRequest(**asked), DEFAULT, TEMPLATE, NO_KEY_LIMIT)


def test_unset_fields_are_the_template_default():
    assert shape() == DEFAULT
    assert shape(vcpus=2, memory_mib=1024, disk_mib=4096) == Shape(2, 1024, 4096)
    assert shape(disk_mib=2048) == Shape(1, 512, 2048)


@pytest.mark.parametrize("asked", [{"vcpus": 0}, {"vcpus": 33}, {"memory_mib": 100},
                                   {"disk_mib": 1215}])
def test_impossible_shapes_are_400(asked):
    with pytest.raises(BadRequest) as err:
        shape(**asked)
    assert (err.value.status, err.value.code) == (400, "invalid_resources")


@pytest.mark.parametrize("asked", [{"vcpus": 3}, {"memory_mib": 4097}, {"disk_mib": 16385}])
def test_over_the_template_limit_is_403(asked):
    with pytest.raises(Forbidden) as err:
        shape(**asked)
    assert (err.value.status, err.value.code) == (403, "resource_limit")
    assert "template" in str(err.value)


def test_the_key_limit_applies_too_and_the_default_always_passes():
    key = ResourceLimits(max_vcpus=1, max_memory_mib=256, max_disk_mib=1024)
    with pytest.raises(Forbidden, match="this key's limit"):
        resolve(ShapeRequest(vcpus=2), DEFAULT, TEMPLATE, key)
    # 512 MiB and 1216 MiB are over the key's limits, but they are the default shape.
    assert resolve(ShapeRequest(), DEFAULT, TEMPLATE, key) == DEFAULT
    assert resolve(ShapeRequest(memory_mib=512), DEFAULT, TEMPLATE, key) == DEFAULT
    assert resolve(ShapeRequest(vcpus=2), DEFAULT, TEMPLATE, ResourceLimits(max_vcpus=2)) \
        == Shape(2, 512, 1216)


@pytest.mark.parametrize("body", [{"vcpus": "2"}, {"memory_mib": 1.5}, {"disk_mib": True}])
def test_a_create_wants_integers(body):
    with pytest.raises(BadRequest) as err:
        wire.parse(wire.CreateSandboxRequest, body)
    assert err.value.code == "invalid_type"


@pytest.mark.parametrize("body", [{"vcpus": 0}, {"memory_mib": 32}, {"disk_mib": 0}])
def test_a_create_under_the_schemas_minimum_is_invalid_resources(body):
    with pytest.raises(BadRequest) as err:
        wire.parse(wire.CreateSandboxRequest, body)
    assert err.value.code == "invalid_resources"


def test_a_create_parses_its_shape():
    req = wire.parse(wire.CreateSandboxRequest, {"template": "python", "vcpus": 2,
                                                 "disk_mib": None})
    assert (req.vcpus, req.memory_mib, req.disk_mib) == (2, None, None)
    assert req.template == "python"


def test_config_per_template_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[resources]\nmax_vcpus = 4\n[resources.templates.python]\n"
                    "max_vcpus = 1\nmax_disk_mib = 2048\n")
    cfg = load(path).resources
    assert cfg.for_template("python") == ResourceLimits(1, 4096, 2048)
    assert cfg.for_template("node") == ResourceLimits(4, 4096, 16384)
    path.write_text("[resources.templates.python]\nmax_cpus = 1\n")
    with pytest.raises(ConfigError, match="templates.python"):
        load(path)
    with pytest.raises(ValueError, match="min_memory_mib"):
        ResourcesConfig(min_memory_mib=32)


def test_key_limits_carry_the_shape_fields():
    assert parse_overrides({"max_vcpus": 1, "max_sandbox_disk_mib": 4096}) == {
        "max_vcpus": 1, "max_sandbox_disk_mib": 4096}
    with pytest.raises(BadRequest):
        parse_overrides({"max_vcpus": -1})
    assert Limits().merged({"max_memory_mib": 1024}).max_memory_mib == 1024


def test_an_asked_disk_counts_against_the_disk_quota():
    limits = Limits(max_disk_mib=5000)
    check_create("k", limits, Usage(disk_bytes=900 << 20))  # the template's: not counted
    check_create("k", limits, Usage(disk_bytes=900 << 20), disk_mib=4096)
    with pytest.raises(QuotaExceeded, match="4096 MiB more"):
        check_create("k", limits, Usage(disk_bytes=1000 << 20), disk_mib=4096)
    check_create("k", Limits(), Usage(disk_bytes=1 << 40), disk_mib=1 << 20)  # 0 = no limit


def test_registry_keeps_the_shape_and_migrates_old_rows(tmp_path):
    import sqlite3

    from gateway.store.registry import SCHEMA
    db = sqlite3.connect(tmp_path / "r.sqlite")
    db.executescript(SCHEMA)
    db.execute("INSERT INTO sandboxes (id, tenant, template, state, slot, root, golden, "
               "idle_timeout, host, created_at, updated_at, last_activity) VALUES "
               "('old', 't', 'python', 'running', 0, '/r', '/g', 0, 'h', 1, 1, 1)")
    db.commit()
    db.close()
    reg = Registry(tmp_path / "r.sqlite")
    old = reg.get("old")
    assert (old.vcpus, old.memory_mib, old.disk_mib) == (0, 0, 0)
    from dataclasses import replace
    reg.insert_sandbox(replace(old, id="new", vcpus=2, memory_mib=1024, disk_mib=4096))
    new = reg.get("new")
    assert (new.vcpus, new.memory_mib, new.disk_mib) == (2, 1024, 4096)
    reg.close()


def test_golden_names_carry_the_shape_and_stay_for_one_vcpu():
    backend = SimpleNamespace(key="qemu-tcg")
    image = Path("/images/python/abc")
    one = golden_dir(image, backend, 512)  # type: ignore[arg-type]
    assert one.name == "golden-qemu-tcg-512M-r3"  # the name of before shapes
    two = golden_dir(image, backend, 1024, vcpus=2)  # type: ignore[arg-type]
    assert two.name == "golden-qemu-tcg-2c-1024M-r3"
    assert len({one, two, golden_dir(image, backend, 1024),  # type: ignore[arg-type]
                golden_dir(image, backend, 512, 2)}) == 4  # type: ignore[arg-type]
    assert (_vcpus_from_name(one.name), _mem_from_name(one.name)) == (1, 512)
    assert (_vcpus_from_name(two.name), _mem_from_name(two.name)) == (2, 1024)


def test_grow_command_waits_for_the_new_size_then_resizes(tmp_path):
    """The guest script run against a fake /sys/block size: fails while the kernel has
    not seen the new size, calls resize2fs once it has."""
    cmd = grow_command(4096 << 20)
    assert "resize2fs /dev/vda" in cmd and str((4096 << 20) // 512) in cmd
    fake = cmd.replace("/sys/block/vda/size", str(tmp_path / "size")) \
              .replace("resize2fs /dev/vda", "echo grown").replace("seq 200", "seq 2")
    (tmp_path / "size").write_text(str((1216 << 20) // 512))
    res = subprocess.run(["sh", "-c", fake], capture_output=True, text=True)
    assert res.returncode == 3 and "did not see" in res.stderr
    (tmp_path / "size").write_text(str((4096 << 20) // 512))
    res = subprocess.run(["sh", "-c", fake], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "grown"


def test_machine_spec_and_cgroup_limits_follow_the_golden_shape(tmp_path):
    from vmctl import network
    from vmctl.backend import Backend, VMConfig
    from vmctl.confine import ConfineConfig
    from vmctl.golden import Golden
    from vmctl.machine import Machine, MachinePlan
    from vmctl.spec import Accel, SnapshotFiles

    snap = SnapshotFiles(tmp_path / "s", tmp_path / "m", tmp_path / "d", Accel.TCG, "qemu")
    golden = Golden("python", tmp_path / "g", snap, tmp_path / "k", None, "console=ttyS0",
                    mem_mib=1024, vcpus=2, disk_mib=1216)
    cfg = VMConfig(vcpus=1, confine=ConfineConfig(memory_overhead_mib=256, cpu_percent=100))
    backend = Backend("qemu", Accel.TCG, "test", cfg, confined=True)
    slot = network.slot_for(3, "sb", cfg.network)
    spec = Machine(MachinePlan("sb", tmp_path / "sb", slot, golden, disk_mib=4096),
                   backend).spec
    assert (spec.vcpus, spec.mem_mib) == (2, 1024)  # the golden's, not the config's 1 vCPU
    assert spec.confinement is not None
    assert spec.confinement.limits.memory_bytes == (1024 + 256) << 20
    assert spec.confinement.limits.cpu_quota_us == 200_000


def _shape_goldens(tmp_path, monkeypatch, build):  # type: ignore[no-untyped-def]
    """A ShapeGoldens whose golden builds are ``build(mem_mib, vcpus)`` (no VM)."""
    import asyncio

    from gateway.sandbox import shape_goldens

    default = SimpleNamespace(template="python", dir=tmp_path / "img" / "golden-x-512M-r3",
                              vcpus=1, mem_mib=512, disk_mib=1216)
    tasks: set[asyncio.Task] = set()

    def spawn(coro, name):  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        return task

    async def fake_ensure(image, backend, progress, build_slot, mem_mib, vcpus):  # type: ignore[no-untyped-def]
        return await build(mem_mib, vcpus)

    monkeypatch.setattr(shape_goldens, "ensure_golden", fake_ensure)
    monkeypatch.setattr(shape_goldens, "_image_of", lambda golden: object())
    return shape_goldens.ShapeGoldens(SimpleNamespace(), {"python": default}, spawn), default


async def test_concurrent_creates_of_a_new_shape_share_one_build(tmp_path, monkeypatch):
    import asyncio

    builds = []
    gate = asyncio.Event()

    async def build(mem_mib, vcpus):  # type: ignore[no-untyped-def]
        builds.append((vcpus, mem_mib))
        await gate.wait()
        return SimpleNamespace(vcpus=vcpus, mem_mib=mem_mib)

    goldens, default = _shape_goldens(tmp_path, monkeypatch, build)
    assert await goldens.get("python", 1, 512) is default  # the default shape: no build
    waiters = [asyncio.create_task(goldens.get("python", 2, 1024)) for _ in range(3)]
    await asyncio.sleep(0.01)
    waiters[0].cancel()  # a client that goes away does not stop the build
    gate.set()
    got = await asyncio.gather(*waiters[1:])
    assert builds == [(2, 1024)]
    assert got[0] is got[1] and (got[0].vcpus, got[0].mem_mib) == (2, 1024)
    assert await goldens.get("python", 2, 1024) is got[0]  # cached now
    assert builds == [(2, 1024)]


async def test_a_failed_build_is_retried_by_the_next_create(tmp_path, monkeypatch):
    from vmctl.errors import ImageError

    attempts = []

    async def build(mem_mib, vcpus):  # type: ignore[no-untyped-def]
        attempts.append(mem_mib)
        if len(attempts) == 1:
            raise ImageError("warm-up failed")
        return SimpleNamespace(vcpus=vcpus, mem_mib=mem_mib)

    goldens, _ = _shape_goldens(tmp_path, monkeypatch, build)
    with pytest.raises(ImageError):
        await goldens.get("python", 1, 768)
    assert (await goldens.get("python", 1, 768)).mem_mib == 768
    assert attempts == [768, 768]
