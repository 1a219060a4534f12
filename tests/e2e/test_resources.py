"""Per-sandbox resources with real VMs: a 1 vCPU / 1 GiB / 4 GiB sandbox sees that shape
(also after a suspend and a wake), a default one is unchanged, over-limit requests are
refused, and the 4 GiB disk stays sparse on the host.

The default shape has 2 vCPUs (``[vm] vcpus``). The first create of the 1 vCPU / 1 GiB shape
builds its golden snapshot (unless an earlier run left it in the shared images dir): slow
under TCG, hence the timeouts."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import CONFIG, running_daemon, start_daemon, stop_daemon, vmm_pids_for

pytestmark = pytest.mark.e2e

SHAPE = {"vcpus": 1, "memory_mib": 1024, "disk_mib": 4096}  # every field not the default's
PROBE = "nproc; grep MemTotal /proc/meminfo; df -k --output=size / | tail -1"


@pytest.fixture(scope="module")
def shaped_daemon(images_built, tmp_path_factory):
    base = tmp_path_factory.mktemp("resources")
    config = base / "agentbox.toml"  # room above the default 2 vCPUs for a key's own limit
    config.write_text(CONFIG.read_text() + "\n[resources]\nmax_vcpus = 4\n")
    with running_daemon(base / "data", config=config) as d:
        yield d


def client(d, key=None) -> httpx.Client:
    c = d.client(key)
    c.timeout = httpx.Timeout(900)
    return c


def probe(api: httpx.Client, sb_id: str) -> tuple[int, int, int]:
    """(nproc, MemTotal KiB, size of / in KiB) as the guest sees them."""
    r = api.post(f"/v1/sandboxes/{sb_id}/execute", json={"command": PROBE, "timeout": 120})
    assert r.status_code == 200, r.text
    assert r.json()["exit_code"] == 0, r.json()
    lines = r.json()["stdout"].split("\n")
    return int(lines[0]), int(lines[1].split()[1]), int(lines[2])


def assert_shape(seen: tuple[int, int, int]) -> None:
    nproc, mem_kib, root_kib = seen
    assert nproc == 1
    assert 900 * 1024 < mem_kib <= 1024 * 1024, mem_kib  # the kernel keeps some for itself
    assert 3900 * 1024 < root_kib <= 4096 * 1024, root_kib


def assert_cgroup_follows_the_shape(sb_id: str) -> None:
    """The confined VMM's cgroup: memory = 1 GiB + the overhead, CPU quota = 1 core."""
    from vmctl.cgroup import Hierarchy
    from vmctl.confine import ConfineConfig

    hierarchy = Hierarchy.detect()
    if os.geteuid() != 0 or hierarchy is None:
        pytest.skip("VMMs are not confined here (not root, or no cgroups)")
    overhead = ConfineConfig().memory_overhead_mib
    if hierarchy.version == 2:
        [d] = Path("/sys/fs/cgroup/agentbox").glob(f"*/{sb_id}")
        assert int((d / "memory.max").read_text()) == (1024 + overhead) << 20
        assert (d / "cpu.max").read_text().split()[0] == "100000"
    else:
        [mem] = Path("/sys/fs/cgroup/memory/agentbox").glob(f"*/{sb_id}")
        [cpu] = Path("/sys/fs/cgroup/cpu/agentbox").glob(f"*/{sb_id}")
        assert int((mem / "memory.limit_in_bytes").read_text()) == (1024 + overhead) << 20
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 100000


def test_shaped_sandbox_sees_its_shape_across_suspend_and_wake(shaped_daemon):
    with client(shaped_daemon) as api:
        r = api.post("/v1/sandboxes", json={"template": "python", **SHAPE})
        assert r.status_code == 201, r.text + shaped_daemon.log_tail()
        sb = r.json()
        try:
            assert {k: sb[k] for k in SHAPE} == SHAPE
            assert_shape(probe(api, sb["id"]))
            got = api.get(f"/v1/sandboxes/{sb['id']}").json()
            assert {k: got[k] for k in SHAPE} == SHAPE
            assert_cgroup_follows_the_shape(sb["id"])
            # The disk file is sparse: a 4 GiB virtual disk takes a fraction of that.
            disk = Path(shaped_daemon.data_dir) / "sandboxes" / sb["id"] / "disk.qcow2"
            allocated = os.stat(disk).st_blocks * 512
            assert allocated < 512 << 20, allocated
            # 1800 MiB fit, more than the template's whole disk: the file system really grew.
            r = api.post(f"/v1/sandboxes/{sb['id']}/execute", json={
                "command": "fallocate -l 1800M /root/big && rm /root/big && echo ok",
                "timeout": 120})
            assert r.json()["exit_code"] == 0, r.json()
            r = api.post(f"/v1/sandboxes/{sb['id']}/suspend")
            assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
            assert_shape(probe(api, sb["id"]))  # woken by the request
            assert api.get(f"/v1/sandboxes/{sb['id']}").json()["restore_count"] >= 1
        finally:
            api.delete(f"/v1/sandboxes/{sb['id']}")


def test_default_sandbox_is_unchanged(shaped_daemon):
    with client(shaped_daemon) as api:
        templates = {t["name"]: t for t in api.get("/v1/templates").json()["templates"]}
        r = api.post("/v1/sandboxes", json={"template": "python"})
        assert r.status_code == 201, r.text
        sb = r.json()
        try:
            nproc, mem_kib, root_kib = probe(api, sb["id"])
            assert nproc == 2  # [vm] vcpus: the default shape has two
            assert mem_kib <= templates["python"]["mem_mib"] * 1024
            assert root_kib < 2048 * 1024  # the template's own ~1.2 GiB disk
            assert sb["vcpus"] == 2 and sb["memory_mib"] == templates["python"]["mem_mib"]
        finally:
            api.delete(f"/v1/sandboxes/{sb['id']}")


def test_refusals(shaped_daemon):
    with client(shaped_daemon) as api:
        r = api.post("/v1/keys", json={"name": "small", "limits": {"max_vcpus": 2,
                                                                   "max_disk_mib": 3000}})
        assert r.status_code == 201, r.text
        key = r.json()
        cases = [
            (api, {"vcpus": 64}, 400, "invalid_resources"),
            (api, {"vcpus": "2"}, 400, "invalid_type"),
            (api, {"memory_mib": 32}, 400, "invalid_resources"),
            (api, {"disk_mib": 100}, 400, "invalid_resources"),  # smaller than the template's
            (api, {"vcpus": 5}, 403, "resource_limit"),  # over [resources] max_vcpus = 4
            (api, {"disk_mib": 1 << 20}, 403, "resource_limit"),
        ]
        with client(shaped_daemon, key["key"]) as small:
            cases += [(small, {"vcpus": 3}, 403, "resource_limit"),  # the key's max_vcpus
                      (small, {"disk_mib": 4096}, 409, "quota_exceeded")]  # its max_disk_mib
            for who, body, status, code in cases:
                r = who.post("/v1/sandboxes", json={"template": "python", **body})
                assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body, r.text)
        assert not api.get("/v1/sandboxes").json()["sandboxes"]


def test_shape_survives_a_daemon_restart(images_built, tmp_path):
    """The shape is the registry's: a suspended 1 vCPU / 1 GiB / 4 GiB sandbox woken by the
    next daemon is restored with that shape (its golden is found again by its name)."""
    data = tmp_path / "data"
    d = start_daemon(data)
    try:
        with client(d) as api:
            r = api.post("/v1/sandboxes", json={"template": "python", **SHAPE})
            assert r.status_code == 201, r.text
            sb_id = r.json()["id"]
            assert api.post(f"/v1/sandboxes/{sb_id}/suspend").json()["state"] == "suspended"
        stop_daemon(d)
        d = start_daemon(data)
        with client(d) as api:
            got = api.get(f"/v1/sandboxes/{sb_id}").json()
            assert {k: got[k] for k in SHAPE} == SHAPE
            assert_shape(probe(api, sb_id))
    finally:
        with client(d) as api:
            for sb in api.get("/v1/sandboxes").json()["sandboxes"]:
                api.delete(f"/v1/sandboxes/{sb['id']}")
        stop_daemon(d)
        assert not vmm_pids_for(str(data))
