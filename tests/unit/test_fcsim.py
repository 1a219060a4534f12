"""The Firecracker API simulator enforces the documented API rules.

What these tests prove: each rule the simulator claims (tests/fcsim/server.py)
is enforced, and a violation reaches a caller as our typed error
(``FirecrackerFault``, a ``VMProtocolError``) through ``FirecrackerAPI``.
What they do not prove: anything about a guest. The simulator runs no VM.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.fcsim import Simulator, VMState, make_app
from vmctl.drivers.fc_api import FirecrackerAPI, FirecrackerFault
from vmctl.errors import VMGoneError, VMProtocolError


class Served:
    """A Simulator behind a real Unix socket, with a FirecrackerAPI client on it."""

    def __init__(self, sim: Simulator, api: FirecrackerAPI) -> None:
        self.sim, self.api, self.exits = sim, api, 0


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "vmlinux").write_bytes(b"kernel")
    (tmp_path / "rootfs.ext4").write_bytes(b"\0" * 4096)
    return tmp_path


async def _serve(tmp_path: Path, sock_name: str) -> AsyncIterator[Served]:
    sim = Simulator(cwd=tmp_path)
    served = Served(sim, FirecrackerAPI(tmp_path / sock_name))

    def fatal() -> None:
        served.exits += 1

    runner = web.AppRunner(make_app(sim, fatal))
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / sock_name)).start()
    try:
        yield served
    finally:
        await served.api.aclose()
        await runner.cleanup()


@pytest.fixture
async def fc(files: Path) -> AsyncIterator[Served]:
    async for served in _serve(files, "api.sock"):
        yield served


@pytest.fixture
async def fc2(files: Path) -> AsyncIterator[Served]:
    async for served in _serve(files, "api2.sock"):
        yield served


def _boot_calls(mem: int = 128) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("PUT", "/boot-source", {"kernel_image_path": "vmlinux", "boot_args": "console=ttyS0"}),
        ("PUT", "/drives/rootfs", {"drive_id": "rootfs", "is_root_device": True,
                                   "path_on_host": "rootfs.ext4"}),
        ("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": mem}),
        ("PUT", "/actions", {"action_type": "InstanceStart"}),
    ]


async def _boot(fc: Served, skip: str | None = None) -> None:
    for method, path, body in _boot_calls():
        if path != skip:
            await fc.api.request(method, path, body)


async def _fault(coro: Any) -> str:
    with pytest.raises(FirecrackerFault) as info:
        await coro
    assert isinstance(info.value, VMProtocolError)
    assert info.value.status == 400
    return info.value.fault_message


async def test_boot_pause_resume_states_and_recorded_calls(fc: Served) -> None:
    assert (await fc.api.get("/"))["state"] == "Not started"
    await _boot(fc)
    assert (await fc.api.get("/"))["state"] == "Running"
    assert await fc.api.patch("/vm", {"state": "Paused"}) is None  # 204
    await fc.api.patch("/vm", {"state": "Paused"})  # idempotent
    assert (await fc.api.get("/"))["state"] == "Paused"
    await fc.api.patch("/vm", {"state": "Resumed"})
    assert fc.sim.state is VMState.RUNNING
    recorded = (await fc.api.get("/_sim/calls"))["calls"]
    puts = [(c["method"], c["path"], c["status"]) for c in recorded if c["method"] != "GET"]
    assert puts[:4] == [(m, p, 204) for m, p, _ in _boot_calls()]
    assert (await fc.api.get("/version")) == {"firecracker_version": fc.sim.version}


# -- one violation per rule -----------------------------------------------------------------


async def test_missing_required_field(fc: Served) -> None:
    msg = await _fault(fc.api.put("/boot-source", {"boot_args": "console=ttyS0"}))
    assert "kernel_image_path" in msg


async def test_unknown_field_and_wrong_type(fc: Served) -> None:
    assert "vcpus" in await _fault(fc.api.put("/machine-config",
                                              {"vcpus": 1, "vcpu_count": 1, "mem_size_mib": 128}))
    assert "vcpu_count" in await _fault(fc.api.put("/machine-config",
                                                   {"vcpu_count": "2", "mem_size_mib": 128}))
    assert "invalid" in await _fault(fc.api.put("/machine-config",
                                                {"vcpu_count": 33, "mem_size_mib": 128}))


async def test_path_id_must_match_body_id(fc: Served) -> None:
    msg = await _fault(fc.api.put("/drives/rootfs", {"drive_id": "other", "is_root_device": True,
                                                     "path_on_host": "rootfs.ext4"}))
    assert "does not match" in msg


async def test_files_are_opened_when_configured(fc: Served) -> None:
    assert "kernel" in await _fault(fc.api.put("/boot-source", {"kernel_image_path": "nope"}))
    assert "block device" in await _fault(fc.api.put("/drives/d", {
        "drive_id": "d", "is_root_device": False, "path_on_host": "nope.ext4"}))


async def test_only_one_root_device(fc: Served) -> None:
    await fc.api.put("/drives/a", {"drive_id": "a", "is_root_device": True,
                                   "path_on_host": "rootfs.ext4"})
    assert "root" in await _fault(fc.api.put("/drives/b", {
        "drive_id": "b", "is_root_device": True, "path_on_host": "rootfs.ext4"}))


async def test_pre_boot_resources_rejected_after_start(fc: Served) -> None:
    await _boot(fc)
    for path, body in [("/boot-source", {"kernel_image_path": "vmlinux"}),
                       ("/machine-config", {"vcpu_count": 1, "mem_size_mib": 128}),
                       ("/entropy", {}),
                       ("/network-interfaces/eth0", {"iface_id": "eth0", "host_dev_name": "tap0"})]:
        assert "after starting" in await _fault(fc.api.put(path, body))


async def test_post_boot_patches_rejected_before_start(fc: Served) -> None:
    assert "before starting" in await _fault(fc.api.patch("/vm", {"state": "Paused"}))
    assert "before starting" in await _fault(fc.api.patch("/drives/rootfs", {"drive_id": "rootfs"}))


async def test_vm_state_enum(fc: Served) -> None:
    await _boot(fc)
    assert "Stopped" in await _fault(fc.api.patch("/vm", {"state": "Stopped"}))


async def test_instance_start_only_once(fc: Served) -> None:
    await _boot(fc)
    again = fc.api.put("/actions", {"action_type": "InstanceStart"})
    assert "after starting" in await _fault(again)


@pytest.mark.parametrize("skip", ["/boot-source", "/drives/rootfs", "/machine-config"])
async def test_instance_start_needs_source_root_drive_and_machine(fc: Served, skip: str) -> None:
    for method, path, body in _boot_calls()[:-1]:
        if path != skip:
            await fc.api.request(method, path, body)
    await _fault(fc.api.put("/actions", {"action_type": "InstanceStart"}))
    assert fc.sim.state is VMState.NOT_STARTED


async def test_unknown_action_and_path(fc: Served) -> None:
    assert "Reboot" in await _fault(fc.api.put("/actions", {"action_type": "Reboot"}))
    assert "Invalid request" in await _fault(fc.api.put("/nope", {}))
    assert "Invalid request" in await _fault(fc.api.put("/snapshot/delete", {}))


async def test_logger_and_metrics_once(fc: Served, files: Path) -> None:
    await fc.api.put("/metrics", {"metrics_path": str(files / "m")})
    assert "Reinitialization" in await _fault(fc.api.put("/metrics", {"metrics_path": "x"}))


async def test_invalid_json_is_a_fault(fc: Served) -> None:
    session = fc.api._ensure_session()
    async with session.put("http://localhost/boot-source", data=b"{not json") as resp:
        assert resp.status == 400
        assert "fault_message" in json.loads(await resp.read())


async def test_snapshot_create_needs_boot_and_pause(fc: Served, files: Path) -> None:
    body = {"snapshot_path": str(files / "st"), "mem_file_path": str(files / "mem")}
    assert "before starting" in await _fault(fc.api.put("/snapshot/create", body))
    await _boot(fc)
    assert "not paused" in await _fault(fc.api.put("/snapshot/create", body))
    await fc.api.patch("/vm", {"state": "Paused"})
    assert "Diff" in await _fault(fc.api.put("/snapshot/create", {**body, "snapshot_type": "Diff"}))
    await fc.api.put("/snapshot/create", {**body, "snapshot_type": "Full"})
    assert (files / "mem").stat().st_size == 128 << 20
    assert not fc.exits


def _load_body(files: Path, **extra: Any) -> dict[str, Any]:
    return {"snapshot_path": str(files / "st"),
            "mem_backend": {"backend_type": "File", "backend_path": str(files / "mem")}, **extra}


async def _make_snapshot(fc: Served, files: Path) -> None:
    await _boot(fc)
    await fc.api.patch("/vm", {"state": "Paused"})
    await fc.api.put("/snapshot/create", {"snapshot_path": str(files / "st"),
                                          "mem_file_path": str(files / "mem")})


async def test_create_then_load_round_trips(fc: Served, fc2: Served, files: Path) -> None:
    await _make_snapshot(fc, files)
    await fc2.api.put("/snapshot/load", _load_body(files))
    assert (await fc2.api.get("/"))["state"] == "Paused"
    assert (await fc2.api.get("/machine-config"))["vcpu_count"] == 2
    await fc2.api.patch("/vm", {"state": "Resumed"})
    assert fc2.sim.state is VMState.RUNNING and not fc2.exits


async def test_load_only_on_a_fresh_process(fc: Served, fc2: Served, files: Path) -> None:
    await _make_snapshot(fc, files)
    await fc2.api.put("/metrics", {"metrics_path": str(files / "metrics")})  # still fresh
    await fc2.api.put("/boot-source", {"kernel_image_path": "vmlinux"})
    assert "not allowed" in await _fault(fc2.api.put("/snapshot/load", _load_body(files)))
    assert not fc2.exits  # refused, not failed: the process lives on


async def test_load_needs_exactly_one_memory_source(fc2: Served, files: Path) -> None:
    body = _load_body(files, mem_file_path=str(files / "mem"))
    assert "Exactly one" in await _fault(fc2.api.put("/snapshot/load", body))
    assert not fc2.exits


@pytest.mark.parametrize("breakage", ["no_state", "garbage_state", "other_version",
                                      "short_memory", "no_disk", "unknown_nic"])
async def test_failed_load_ends_the_process(fc: Served, fc2: Served, files: Path,
                                            breakage: str) -> None:
    await _make_snapshot(fc, files)
    body = _load_body(files)
    if breakage == "no_state":
        (files / "st").unlink()
    elif breakage == "garbage_state":
        (files / "st").write_bytes(b"\x00garbage")
    elif breakage == "other_version":
        fc2.sim.version = "1.15.0"
    elif breakage == "short_memory":
        with open(files / "mem", "r+b") as f:
            f.truncate(1 << 20)
    elif breakage == "no_disk":
        (files / "rootfs.ext4").unlink()
    else:
        body["network_overrides"] = [{"iface_id": "eth9", "host_dev_name": "tap9"}]
    await _fault(fc2.api.put("/snapshot/load", body))
    assert fc2.exits == 1


async def test_client_maps_a_missing_socket_to_vm_gone(tmp_path: Path) -> None:
    api = FirecrackerAPI(tmp_path / "absent.sock")
    try:
        with pytest.raises(VMGoneError):
            await api.get("/")
    finally:
        await api.aclose()
