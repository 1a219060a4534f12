"""Quota decisions, limit parsing and the [tenancy] config (no I/O but the registry's)."""

from __future__ import annotations

import os
import sqlite3

import pytest

from gateway.config import ConfigError, load
from gateway.errors import ApiError, QuotaExceeded
from gateway.sandbox.states import State
from gateway.tenancy.quotas import (
    Limits,
    TenancyConfig,
    Usage,
    apply_overrides,
    check_create,
    check_wake,
    parse_overrides,
    usage_of,
)
from gateway.store.registry import Registry


def test_usage_counts_awake_states_and_skips_destroyed():
    states = [State.CREATING, State.RUNNING, State.RESTORING, State.SUSPENDING,
              State.SUSPENDED, State.FAILED, State.DESTROYED]
    assert usage_of(states, 7) == Usage(sandboxes=6, awake=4, disk_bytes=7)


@pytest.mark.parametrize(("limits", "usage", "what"), [
    (Limits(max_sandboxes=2), Usage(sandboxes=2), "max_sandboxes=2"),
    (Limits(max_awake=1), Usage(sandboxes=1, awake=1), "max_awake=1"),
    (Limits(max_disk_mib=1), Usage(disk_bytes=1 << 20), "max_disk_mib=1"),
])
def test_create_at_a_limit_is_refused_naming_it(limits, usage, what):
    with pytest.raises(QuotaExceeded) as info:
        check_create("key_a", limits, usage)
    assert info.value.status == 409 and info.value.code == "quota_exceeded"
    assert what in str(info.value)


def test_create_below_every_limit_and_zero_means_unlimited():
    check_create("k", Limits(max_sandboxes=2, max_awake=2, max_disk_mib=2),
                 Usage(sandboxes=1, awake=1, disk_bytes=(2 << 20) - 1))
    check_create("k", Limits(), Usage(sandboxes=10**6, awake=10**6, disk_bytes=1 << 60))


def test_wake_checks_only_awake():
    check_wake("k", Limits(max_sandboxes=1, max_awake=2), Usage(sandboxes=5, awake=1))
    with pytest.raises(QuotaExceeded):
        check_wake("k", Limits(max_awake=2), Usage(sandboxes=5, awake=2))


@pytest.mark.parametrize("bad", [
    {"max_sandboxes": True}, {"max_sandboxes": "3"}, {"max_sandboxes": -1},
    {"max_awake": 1.5}, {"rate": "1"}, {"rate": False}, {"rate": float("inf")}, {"burst": 0},
])
def test_limit_values_must_have_their_json_type(bad):
    with pytest.raises(ApiError) as info:
        parse_overrides(bad)
    assert info.value.status == 400 and info.value.code == "invalid_type"


def test_unknown_limits_and_non_objects_are_400():
    with pytest.raises(ApiError, match="unknown limit"):
        parse_overrides({"max_cpus": 1})
    with pytest.raises(ApiError) as info:
        parse_overrides(["max_sandboxes", 1])
    assert info.value.code == "invalid_type"


def test_overrides_merge_and_null_restores_the_default():
    stored = apply_overrides({}, parse_overrides({"max_sandboxes": 1, "rate": 2}))
    assert stored == {"max_sandboxes": 1, "rate": 2}
    stored = apply_overrides(stored, parse_overrides({"max_sandboxes": None, "burst": 9}))
    assert stored == {"rate": 2, "burst": 9}
    limits = TenancyConfig().limits.merged(stored)
    assert (limits.max_sandboxes, limits.rate, limits.burst) == (64, 2.0, 9)


def test_tenancy_config_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[tenancy]\nmax_sandboxes = 3\nrate = 0\naddress_exempt = []\n")
    cfg = load(path).tenancy
    assert (cfg.max_sandboxes, cfg.limits.rate, cfg.address_exempt) == (3, 0.0, ())
    for bad in ("max_awake = true", "burst = 0", "address_exempt = ['nope']", "colour = 1",
                "table_size = 0"):
        path.write_text(f"[tenancy]\n{bad}\n")
        with pytest.raises(ConfigError, match=r"\[tenancy\]"):
            load(path)


def test_the_shipped_config_matches_the_defaults():
    assert load(None).tenancy == TenancyConfig()


def test_registry_migrates_an_old_keys_table(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT "
               "NOT NULL UNIQUE, admin INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, "
               "revoked INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO api_keys VALUES ('key_old', 'old', 'h', 0, 1.0, 0)")
    db.commit()
    db.close()
    reg = Registry(path)
    try:
        old = reg.get_key("key_old")
        assert old is not None and old.limits == {} and not old.revoked
        assert reg.set_key_limits("key_old", {"max_awake": 2})
        assert reg.get_key("key_old").limits == {"max_awake": 2}
    finally:
        reg.close()
    Registry(path).close()  # a second open finds the column and adds nothing


def test_revoked_keys_stop_authenticating_but_stay_listable(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    try:
        key, secret = reg.create_key("t", limits={"max_sandboxes": 1})
        assert reg.lookup_key(secret).limits == {"max_sandboxes": 1}
        assert reg.revoke_key(key.id)
        assert reg.lookup_key(secret) is None
        assert reg.get_key(key.id).revoked
        assert [k.id for k in reg.list_keys()] == []
        assert [k.id for k in reg.list_keys(include_revoked=True)] == [key.id]
    finally:
        reg.close()


def test_the_sdk_maps_the_new_codes():
    from agentbox import exceptions as ex

    quota = ex.from_response(409, {"error": {"code": "quota_exceeded", "message": "m"}})
    assert type(quota) is ex.QuotaExceededError and isinstance(quota, ex.ConflictError)
    rate = ex.from_response(429, {"error": {"code": "rate_limited", "message": "m"}},
                            {"Retry-After": "3"})
    assert type(rate) is ex.RateLimitError and rate.retry_after == 3.0


def test_admin_keys_start_unlimited_but_keep_their_own_overrides():
    from gateway.tenancy.quotas import Limits, TenancyConfig
    cfg = TenancyConfig(max_sandboxes=5, max_awake=2, rate=10, burst=20)
    assert cfg.limits_for(False, {}).max_awake == 2 and cfg.limits_for(False, {}).rate == 10
    assert cfg.limits_for(True, {}) == Limits()
    assert cfg.limits_for(True, {"max_awake": 3}).max_awake == 3


def test_a_sandboxs_disk_usage_counts_its_own_files_not_its_chroots_links(tmp_path):
    from gateway.sandbox.disk_usage import tree_bytes

    template = tmp_path / "images" / "rootfs.ext4"
    template.parent.mkdir()
    template.write_bytes(b"t" * (1 << 20))
    root = tmp_path / "sandbox"
    chroot = root / "vm" / "images"
    chroot.mkdir(parents=True)
    (root / "memory").write_bytes(b"m" * (2 << 20))
    (root / "disk.qcow2").write_bytes(b"d" * (1 << 20))
    os.link(root / "disk.qcow2", root / "vm" / "disk.qcow2")  # its own disk, linked in
    os.link(template, chroot / "rootfs.ext4")  # the template's, linked in
    (root / "vm" / "vmm.log").write_bytes(b"l" * 4096)  # its own, only in the chroot
    blocks = lambda p: p.lstat().st_blocks * 512  # noqa: E731
    assert tree_bytes(root) == (blocks(root / "memory") + blocks(root / "disk.qcow2")
                                + blocks(root / "vm" / "vmm.log"))
