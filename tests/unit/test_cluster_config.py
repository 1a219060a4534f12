"""[cluster] parses into ClusterConfig: off by default, every bad value names its field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.cluster.config import ClusterConfig
from gateway.config import DEFAULT_CONFIG, ConfigError, load

GOOD = """
[cluster]
enabled = true
endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379/"]
host = "host-a"
advertise = "10.0.0.1:8080"
lease_ttl = 3
"""


def _load(tmp_path: Path, text: str):
    path = tmp_path / "agentbox.toml"
    path.write_text(text)
    return load(path)


def test_off_by_default_and_in_the_shipped_config() -> None:
    assert ClusterConfig().enabled is False
    assert load(DEFAULT_CONFIG).cluster == ClusterConfig()


def test_a_good_section_parses(tmp_path: Path) -> None:
    cluster = _load(tmp_path, GOOD).cluster
    assert cluster.enabled and cluster.host == "host-a" and cluster.lease_ttl == 3
    assert cluster.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    assert cluster.keys.host("host-a") == "/agentbox/hosts/host-a"


def test_the_documented_example_is_valid(tmp_path: Path) -> None:
    """Uncommenting the block in config/agentbox.toml gives a config that loads."""
    text = DEFAULT_CONFIG.read_text()
    block = text[text.index("# [cluster]"):]
    lines = [re.sub(r"^# ?", "", line) for line in block.splitlines() if line.startswith("#")]
    cluster = _load(tmp_path, "\n".join(lines)).cluster
    assert cluster.enabled and len(cluster.endpoints) == 3


@pytest.mark.parametrize("change, field", [
    ('endpoints = []', "endpoints"),
    ('endpoints = ["https://10.0.0.1:2379"]', "endpoints"),
    ('endpoints = ["http://10.0.0.1"]', "endpoints"),
    ('endpoints = ["http://10.0.0.1:2379/v3"]', "endpoints"),
    ('endpoints = "http://10.0.0.1:2379"', "endpoints"),
    ('host = "Host_A"', "host"),
    ('host = ""', "host"),
    ('advertise = "10.0.0.1"', "advertise"),
    ('advertise = "10.0.0.1:99999"', "advertise"),
    ('lease_ttl = 1', "lease_ttl"),
    ('lease_ttl = 2.5', "lease_ttl"),
    ('timeout = 0', "timeout"),
    ('key_prefix = "agentbox"', "key_prefix"),
    ('key_prefix = "/a/../b c"', "key_prefix"),
    ('placement_choices = 0', "placement_choices"),
    ('enabled = "yes"', "enabled"),
    ('nodes = 3', "nodes"),
])
def test_a_bad_value_names_its_field(tmp_path: Path, change: str, field: str) -> None:
    key = change.split(" = ")[0]
    lines = [line for line in GOOD.splitlines() if not line.startswith(key + " =")]
    with pytest.raises(ConfigError, match=rf"\[cluster\].*{field}"):
        _load(tmp_path, "\n".join(lines) + "\n" + change + "\n")


def test_disabled_needs_no_host_but_still_checks_types(tmp_path: Path) -> None:
    assert _load(tmp_path, "[cluster]\nendpoints = []\n").cluster.enabled is False
    with pytest.raises(ConfigError, match="lease_ttl"):
        _load(tmp_path, "[cluster]\nlease_ttl = 0\n")


def test_objstore_off_by_default_and_checked_when_set():
    assert ClusterConfig().objstore_endpoint == ""
    good = dict(objstore_endpoint="http://127.0.0.1:8333", objstore_bucket="snapshots",
                objstore_access_key="AK", objstore_secret_key="SK")
    cfg = ClusterConfig(**good)
    assert "SK" not in repr(cfg)
    for bad, match in [({"objstore_endpoint": "ftp://x"}, "objstore_endpoint"),
                       ({"objstore_endpoint": "http://x:1/path"}, "objstore_endpoint"),
                       ({"objstore_bucket": "Bad_Bucket"}, "objstore_bucket"),
                       ({"objstore_bucket": ""}, "objstore_bucket"),
                       ({"objstore_secret_key": ""}, "objstore_secret_key"),
                       ({"upload_concurrency": 0}, "upload_concurrency")]:
        with pytest.raises(ValueError, match=match):
            ClusterConfig(**{**good, **bad})
