"""The warm pool's decisions (gateway.sandbox.warm_pool), without I/O."""

from __future__ import annotations

import pytest

from gateway.sandbox import warm_pool
from gateway.config import ConfigError, PoolConfig, load


def test_auto_size_follows_host_memory_and_templates():
    assert warm_pool.auto_size(24 * 1024, 1) == 3
    assert warm_pool.auto_size(24 * 1024, 2) == 1
    assert warm_pool.auto_size(256 * 1024, 1) == 4  # capped
    assert warm_pool.auto_size(24 * 1024, 4) == 1  # at least one on a host with 8 GiB or more
    assert warm_pool.auto_size(4 * 1024, 1) == 0
    assert warm_pool.auto_size(None, 1) == 0


def test_refill_takes_the_emptiest_template_and_yields_to_the_foreground():
    members = {"python": 2, "node": 0}
    assert warm_pool.refill_choice(members, 2, False, True) == "node"
    assert warm_pool.refill_choice({"python": 2}, 2, False, True) is None
    assert warm_pool.refill_choice(members, 2, True, True) is None  # a create/restore runs
    assert warm_pool.refill_choice(members, 2, False, False) is None  # host at its limits
    assert warm_pool.refill_choice(members, 0, False, True) is None


def test_pool_tenant_is_no_key_id():
    assert not all(ch in "0123456789abcdef" for ch in warm_pool.POOL_TENANT)


def test_pool_config(tmp_path):
    assert PoolConfig().size == -1
    f = tmp_path / "a.toml"
    f.write_text("[pool]\nsize = 2\n")
    assert load(f).pool.size == 2
    f.write_text("[pool]\nsize = -5\n")
    with pytest.raises(ConfigError, match=r"\[pool\]"):
        load(f)
