"""Fixtures for tests against real etcd: 3 members in 3 network namespaces made per test
(tests/cluster/etcd_env.py). Skipped, saying why, only when etcd or root is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.etcd_env import EtcdCluster, sweep_stale_namespaces
from tests.cluster.fleet_env import Fleet, running_fleet
from tests.cluster.fleet_env import skip_reason as fleet_skip_reason


def _skip_reason() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd is not installed (make setup installs Debian's etcd-server)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    sweep_stale_namespaces()
    cluster = EtcdCluster(tmp_path / "etcd")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Three real daemons (tests/cluster/fleet_env.py) on a fresh etcd and SeaweedFS."""
    reason = fleet_skip_reason()
    if reason:
        pytest.skip(reason)
    sweep_stale_namespaces()
    cluster = EtcdCluster(tmp_path / "etcd")
    try:
        cluster.start()
        with running_fleet(cluster, tmp_path / "fleet") as f:
            yield f
    finally:
        cluster.close()
