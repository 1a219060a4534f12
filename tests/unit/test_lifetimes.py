"""gateway.sandbox.expiry: expiry decisions from the registry's facts, and the scan that destroys
through the service's controllers (fake ones: registry transitions only)."""

from __future__ import annotations

import dataclasses
import sqlite3
from types import SimpleNamespace

import pytest

from gateway.sandbox import expiry
from gateway.http import wire
from gateway.config import Config, SandboxConfig, ServerConfig
from gateway.errors import BadRequest
from gateway.sandbox.states import Event, State
from gateway.store.registry import Registry, SandboxRecord
from tests.unit.test_tenancy_api import FakeService
from vmctl.network import NetworkConfig


def rec(state=State.RUNNING, **kw) -> SandboxRecord:
    return SandboxRecord(id="a", tenant="t", template="python", state=state, slot=0, root="/x",
                         golden="/g", idle_timeout=0, host="h", created_at=100.0,
                         updated_at=100.0, last_activity=100.0, **kw)


def test_ttl_expires_at_its_deadline_in_any_state_but_creating():
    r = rec(expires_at=160.0)
    assert expiry.expired(r, 159.9) is None
    assert "ttl expired" in expiry.expired(r, 160.0)
    for state in (State.SUSPENDED, State.FAILED, State.RESTORING, State.SUSPENDING):
        assert expiry.expired(dataclasses.replace(r, state=state), 161) is not None
    assert expiry.expired(dataclasses.replace(r, state=State.CREATING), 1e9) is None
    assert expiry.expired(dataclasses.replace(r, state=State.DESTROYED), 1e9) is None
    assert expiry.expired(rec(), 1e12) is None  # no ttl: never


def test_auto_delete_counts_only_time_asleep():
    awake = rec(auto_delete_after=10.0, asleep_since=50.0)  # asleep before, awake now
    assert expiry.expired(awake, 1e9) is None and expiry.delete_at(awake) is None
    asleep = dataclasses.replace(awake, state=State.SUSPENDED, asleep_since=200.0)
    assert expiry.delete_at(asleep) == 210.0
    assert expiry.expired(asleep, 209.9) is None
    assert "auto_delete_after" in expiry.expired(asleep, 210.0)
    failed = dataclasses.replace(asleep, state=State.FAILED)
    assert expiry.expired(failed, 210.0) is not None
    never = dataclasses.replace(asleep, auto_delete_after=0.0)
    assert expiry.expired(never, 1e12) is None


def test_create_and_patch_fields_defaults_and_bounds():
    cfg = SandboxConfig(ttl=600, auto_delete_after=30)
    assert expiry.at_create(expiry.Lifetimes(), cfg, 1000.0) == {
        "expires_at": 1600.0, "auto_delete_after": 30}
    assert expiry.at_create(expiry.Lifetimes(ttl=0, auto_delete_after=0), cfg, 1000.0) == {
        "expires_at": None, "auto_delete_after": 0}
    # a PATCH ttl counts from now; 0 removes the deadline
    assert expiry.at_update(expiry.Lifetimes(ttl=50), cfg, 2000.0) == {"expires_at": 2050}
    assert expiry.at_update(expiry.Lifetimes(ttl=0), cfg, 2000.0) == {"expires_at": None}
    assert expiry.at_update(expiry.Lifetimes(), cfg, 2000.0) == {}
    capped = SandboxConfig(max_ttl=100)
    assert expiry.at_create(expiry.Lifetimes(), capped, 0.0)["expires_at"] == 100
    for ttl in (0, 101):
        with pytest.raises(BadRequest):
            expiry.at_create(expiry.Lifetimes(ttl=ttl), capped, 0.0)
    for body in ({"ttl": -1}, {"ttl": "10"}, {"ttl": True}, {"auto_delete_after": 1e12}):
        with pytest.raises(BadRequest, match="must be a number of seconds from 0 to"):
            wire.parse(wire.UpdateSandboxRequest, body)
    req = wire.parse(wire.CreateSandboxRequest, {"ttl": 5})
    assert (req.ttl, req.auto_delete_after) == (5.0, None)
    with pytest.raises(ValueError):
        SandboxConfig(ttl=200, max_ttl=100)


def test_registry_records_when_a_sandbox_fell_asleep(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    reg.insert_sandbox(rec(state=State.CREATING))
    reg.transition("a", Event.CREATED)
    assert reg.get("a").asleep_since is None
    reg.transition("a", Event.SUSPEND)
    first = reg.transition("a", Event.SUSPENDED).asleep_since
    assert first is not None
    assert reg.transition("a", Event.SNAPSHOT_LOST).asleep_since == first  # still asleep
    reg.transition("a", Event.WAKE)
    assert reg.transition("a", Event.RESTORE_FAILED).asleep_since >= first  # asleep again
    reg.close()


def test_an_old_registry_gets_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE sandboxes (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
                     "template TEXT NOT NULL, state TEXT NOT NULL, metadata TEXT NOT NULL "
                     "DEFAULT '{}', slot INTEGER NOT NULL, root TEXT NOT NULL, golden TEXT NOT "
                     "NULL, vmm TEXT, idle_timeout REAL NOT NULL, host TEXT NOT NULL, "
                     "created_at REAL NOT NULL, updated_at REAL NOT NULL, last_activity REAL "
                     "NOT NULL, suspend_count INTEGER NOT NULL DEFAULT 0, restore_count "
                     "INTEGER NOT NULL DEFAULT 0, last_suspend_ms REAL, last_restore_ms REAL, "
                     "failure TEXT);"
                     "INSERT INTO sandboxes VALUES ('a','t','python','running','{}',0,'/x','/g',"
                     "NULL,0,'h',1,1,1,0,0,NULL,NULL,NULL);")
    db.close()
    reg = Registry(path)
    got = reg.get("a")
    assert got.expires_at is None and got.auto_delete_after == 0 and got.asleep_since is None
    reg.close()


@pytest.fixture
def service(tmp_path):
    registry = Registry(tmp_path / "r.sqlite")
    config = Config(server=ServerConfig(data_dir=tmp_path))
    backend = SimpleNamespace(config=SimpleNamespace(network=NetworkConfig(
        pool="169.254.64.0/18")))
    golden = SimpleNamespace(template="python", dir=tmp_path / "golden", mem_mib=256)
    svc = FakeService(config, registry, backend, {"python": golden})  # type: ignore[arg-type]
    yield svc
    registry.close()


async def test_the_scan_destroys_expired_sandboxes_through_their_controller(service):
    reg = service.registry
    for sid, extra in (("ttl", {"expires_at": 150.0}), ("keep", {"expires_at": 10_000.0}),
                       ("asleep", {"auto_delete_after": 5.0}), ("none", {})):
        reg.insert_sandbox(dataclasses.replace(rec(state=State.CREATING), id=sid, **extra))
        reg.transition(sid, Event.CREATED)
    reg.transition("asleep", Event.SUSPEND)
    reg.transition("asleep", Event.SUSPENDED, asleep_since=300.0)
    assert await expiry.scan(service, now=200.0) == ["ttl"]
    assert reg.get("ttl").state is State.DESTROYED
    assert reg.transitions("ttl")[-1]["cause"].startswith("ttl expired")
    assert await expiry.scan(service, now=304.0) == []
    assert await expiry.scan(service, now=305.0) == ["asleep"]
    assert await expiry.scan(service, now=1e9) == ["keep"]  # "none" never expires
    assert reg.get("none").state is State.RUNNING
    assert service.metrics.events["expired"] == 3


async def test_snapshot_sizes_are_measured_after_a_suspend_and_again_later(service, tmp_path):
    from gateway.sandbox.disk_usage import measure_snapshots

    root = tmp_path / "sb"
    (root / "snapshot").mkdir(parents=True)
    (root / "snapshot" / "vmstate").write_bytes(b"x" * 8192)
    (root / "memory").write_bytes(b"y" * 65536)
    reg = service.registry
    reg.insert_sandbox(dataclasses.replace(rec(state=State.CREATING), root=str(root)))
    for event in (Event.CREATED, Event.SUSPEND):
        reg.transition("a", event)
    reg.transition("a", Event.SUSPENDED, suspend_count=1)
    seen: dict = {}
    await measure_snapshots(service.registry, seen)
    assert reg.get("a").snapshot_bytes >= 8192 + 65536
    (root / "memory").unlink()  # compacted: the memory file is gone
    await measure_snapshots(service.registry, seen)  # too soon to look again
    assert reg.get("a").snapshot_bytes >= 8192 + 65536
    await measure_snapshots(service.registry, seen, every=0)
    assert 8192 <= reg.get("a").snapshot_bytes < 65536
