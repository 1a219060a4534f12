"""A Firecracker API simulator: the documented REST rules, and no guest.

It exists so the Firecracker driver can be tested on machines that cannot run
Firecracker. It proves the driver speaks the API correctly (fields, order,
states, snapshot files, the exit on a failed load); it proves nothing about
guest behaviour: no VM, kernel or device is emulated.

``Simulator`` is the sans-IO core (``handle(method, path, body)`` -> status,
payload, fatal); ``make_app`` is the aiohttp shell. Rules enforced, from the
swagger (``src/firecracker/swagger/firecracker.yaml``) and
``docs/snapshotting/snapshot-support.md``:

- bodies are JSON objects with the endpoint's required fields, the right types,
  no unknown fields; path ids match body ids; enums are checked;
- boot-source, drives, machine-config, network-interfaces, vsock, entropy,
  balloon, mmds/config are pre-boot only; PATCH of drives/NICs is post-boot only;
- files are opened when configured (kernel, initrd, drive paths), relative
  paths resolve against the process's working directory;
- InstanceStart runs once, and (stricter than Firecracker, which defaults the
  machine to 1 vCPU/128 MiB and can boot an initrd without a root drive) only
  with boot-source, a root drive and machine-config set;
- PATCH /vm (Paused/Resumed, idempotent) only after start;
- snapshot/create only when Paused; it writes a placeholder state file (JSON)
  and a sparse memory file of the guest's size, so create -> load round-trips;
- snapshot/load only on a fresh process (nothing but logger/metrics set);
  exactly one of mem_file_path / mem_backend; a load that fails (missing or
  foreign state file, other version, memory file of the wrong size, missing
  drive, unknown NIC in network_overrides) answers 400 and the process EXITS;
- success is 204 (GET: 200 + JSON); errors are 400 {"fault_message": ...}.

Not enforced: TAP devices are not opened (host_dev_name is only checked for
length), and no metrics/logger files are written.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

DEFAULT_VERSION = "1.16.1"
STATE_MAGIC = "fcsim-vmstate"
MEMORY_MAGIC = b"FCSIM-MEMORY\n"
_MIB = 1 << 20
_MAC_RE = re.compile(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}")
PRE_BOOT_ONLY = "The requested operation is not supported after starting the microVM."
POST_BOOT_ONLY = "The requested operation is not supported before starting the microVM."


class VMState(enum.Enum):
    NOT_STARTED = "Not started"
    RUNNING = "Running"
    PAUSED = "Paused"


class Fault(Exception):
    """A 400 answer; ``fatal`` faults end the process (failed snapshot load)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


S, B, I, O, L = str, bool, int, dict, list  # noqa: E741
# definition name -> (required fields, optional fields), from the swagger.
SCHEMAS: dict[str, tuple[dict[str, type], dict[str, type]]] = {
    "BootSource": ({"kernel_image_path": S}, {"boot_args": S, "initrd_path": S}),
    "Drive": ({"drive_id": S, "is_root_device": B},
              {"path_on_host": S, "is_read_only": B, "partuuid": S, "cache_type": S,
               "io_engine": S, "rate_limiter": O, "socket": S}),
    "PartialDrive": ({"drive_id": S}, {"path_on_host": S, "rate_limiter": O}),
    "MachineConfiguration": ({"vcpu_count": I, "mem_size_mib": I},
                             {"smt": B, "track_dirty_pages": B, "huge_pages": S,
                              "cpu_template": S}),
    "NetworkInterface": ({"iface_id": S, "host_dev_name": S},
                         {"guest_mac": S, "mtu": I, "rx_rate_limiter": O, "tx_rate_limiter": O}),
    "PartialNetworkInterface": ({"iface_id": S}, {"rx_rate_limiter": O, "tx_rate_limiter": O}),
    "Vsock": ({"guest_cid": I, "uds_path": S}, {"vsock_id": S}),
    "EntropyDevice": ({}, {"rate_limiter": O}),
    "Balloon": ({"amount_mib": I, "deflate_on_oom": B},
                {"stats_polling_interval_s": I, "free_page_hinting": B,
                 "free_page_reporting": B}),
    "MmdsConfig": ({"network_interfaces": L}, {"version": S, "ipv4_address": S,
                                               "imds_compat": B}),
    "Logger": ({}, {"log_path": S, "level": S, "show_level": B, "show_log_origin": B,
                    "module": S}),
    "Metrics": ({"metrics_path": S}, {}),
    "InstanceActionInfo": ({"action_type": S}, {}),
    "Vm": ({"state": S}, {}),
    "SnapshotCreateParams": ({"mem_file_path": S, "snapshot_path": S}, {"snapshot_type": S}),
    "SnapshotLoadParams": ({"snapshot_path": S},
                           {"mem_file_path": S, "mem_backend": O, "enable_diff_snapshots": B,
                            "track_dirty_pages": B, "resume_vm": B, "network_overrides": L,
                            "vsock_override": O, "clock_realtime": B}),
    "MemoryBackend": ({"backend_type": S, "backend_path": S}, {}),
    "NetworkOverride": ({"iface_id": S, "host_dev_name": S}, {}),
}


def validate(definition: str, body: Any) -> dict[str, Any]:
    """Check ``body`` against a swagger definition (required, types, no extras)."""
    if not isinstance(body, dict):
        raise Fault(f"{definition}: expected a JSON object")
    required, optional = SCHEMAS[definition]
    for name in required:
        if name not in body:
            raise Fault(f"{definition}: missing field `{name}`")
    for name, value in body.items():
        kind = required.get(name) or optional.get(name)
        if kind is None:
            raise Fault(f"{definition}: unknown field `{name}`")
        wrong_int = kind is int and isinstance(value, bool)
        if not isinstance(value, kind) or wrong_int:
            raise Fault(f"{definition}: field `{name}` must be {kind.__name__}")
    return body


def _enum(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise Fault(f"unknown variant `{value}` for `{name}`, expected one of {allowed}")


@dataclass
class Call:
    method: str
    path: str
    body: Any
    status: int
    fault: str | None = None


@dataclass
class Simulator:
    """One Firecracker process's API state."""

    version: str = DEFAULT_VERSION
    instance_id: str = "anonymous-instance"
    cwd: Path = field(default_factory=Path.cwd)
    chroot: Path | None = None  # set when started by the fake jailer: "/" maps here
    state: VMState = VMState.NOT_STARTED
    config: dict[str, Any] = field(default_factory=lambda: {
        "drives": {}, "network-interfaces": {}})
    configured: bool = False  # anything but logger/metrics was set: no snapshot load
    track_dirty_pages: bool = False
    calls: list[Call] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"<Simulator {self.version} state={self.state.value!r} calls={len(self.calls)}>"

    @property
    def started(self) -> bool:
        return self.state is not VMState.NOT_STARTED

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any, bool]:
        """Process one request: (status, JSON payload or None, process must exit)."""
        try:
            status, payload = self._route(method, path.rstrip("/") or "/", body)
            fatal, fault = False, None
        except Fault as exc:
            status, payload, fatal, fault = 400, {"fault_message": str(exc)}, exc.fatal, str(exc)
        self.calls.append(Call(method, path, body, status, fault))
        return status, payload, fatal

    # -- routing ---------------------------------------------------------------------------

    def _route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        parts = path.strip("/").split("/") if path != "/" else []
        if method == "GET":
            return 200, self._get(path)
        key = (method, parts[0] if parts else "", len(parts))
        handler = _ROUTES.get(key)
        if handler is None or parts[-1] not in _SUBPATHS.get(parts[0], (parts[-1],)):
            raise Fault(f"Invalid request method and/or path: {method} {path}.")
        handler(self, parts[1] if len(parts) > 1 else "", body)
        if parts[0] in _BOOT_RESOURCES:
            self.configured = True  # a fresh process no longer: snapshot load is refused
        return 204, None

    def _get(self, path: str) -> Any:
        if path == "/":
            return {"app_name": "Firecracker", "id": self.instance_id,
                    "state": self.state.value, "vmm_version": self.version}
        if path == "/version":
            return {"firecracker_version": self.version}
        if path == "/machine-config":
            return self.config.get("machine-config") or {
                "vcpu_count": 1, "mem_size_mib": 128, "smt": False, "track_dirty_pages": False}
        if path == "/vm/config":
            return {**self.config, "drives": list(self.config["drives"].values()),
                    "network-interfaces": list(self.config["network-interfaces"].values())}
        raise Fault(f"Invalid request method and/or path: GET {path}.")

    def _pre_boot(self) -> None:
        if self.started:
            raise Fault(PRE_BOOT_ONLY)

    def _post_boot(self) -> None:
        if not self.started:
            raise Fault(POST_BOOT_ONLY)

    def host_path(self, value: str) -> Path:
        """Where the process would find ``value``: relative to its cwd, and inside
        its chroot when jailed."""
        path = Path(value)
        if not path.is_absolute():
            return self.cwd / path
        return self.chroot / path.relative_to("/") if self.chroot is not None else path

    def _file(self, value: str, what: str, fatal: bool = False) -> Path:
        path = self.host_path(value)
        if not path.is_file():
            raise Fault(f"Unable to open {what} {value}: No such file or directory (os error 2)",
                        fatal=fatal)
        return path

    # -- pre-boot resources ---------------------------------------------------------------

    def put_boot_source(self, _id: str, body: Any) -> None:
        validate("BootSource", body)
        self._pre_boot()
        self._file(body["kernel_image_path"], "kernel image")
        if "initrd_path" in body:
            self._file(body["initrd_path"], "initrd image")
        self.config["boot-source"] = body

    def put_drive(self, drive_id: str, body: Any) -> None:
        validate("Drive", body)
        self._pre_boot()
        if body["drive_id"] != drive_id:
            raise Fault("The id from the path does not match the id from the body!")
        _enum("cache_type", body.get("cache_type"), ("Unsafe", "Writeback"))
        _enum("io_engine", body.get("io_engine"), ("Sync", "Async"))
        if "socket" not in body:
            if "path_on_host" not in body:
                raise Fault("Drive: `path_on_host` is required for virtio-block")
            self._file(body["path_on_host"], "block device")
        drives = self.config["drives"]
        if body["is_root_device"] and any(d["is_root_device"] for i, d in drives.items()
                                          if i != drive_id):
            raise Fault("A root block device already exists!")
        drives[drive_id] = body

    def put_machine_config(self, _id: str, body: Any) -> None:
        validate("MachineConfiguration", body)
        self._pre_boot()
        self._check_machine(body)
        self.config["machine-config"] = body
        self.track_dirty_pages = bool(body.get("track_dirty_pages"))

    def patch_machine_config(self, _id: str, body: Any) -> None:
        if not isinstance(body, dict):
            raise Fault("MachineConfiguration: expected a JSON object")
        merged = {**self._get("/machine-config"), **body}
        self.put_machine_config(_id, merged)

    @staticmethod
    def _check_machine(body: dict[str, Any]) -> None:
        vcpus, mem = body["vcpu_count"], body["mem_size_mib"]
        if not 1 <= vcpus <= 32:
            raise Fault("The vCPU number is invalid! The vCPU number can only be 1 or an "
                        "even number when SMT is enabled.")
        if body.get("smt") and vcpus > 1 and vcpus % 2:
            raise Fault("The vCPU number is invalid! The vCPU number can only be 1 or an "
                        "even number when SMT is enabled.")
        if mem <= 0:
            raise Fault("The memory size (MiB) is invalid.")
        _enum("huge_pages", body.get("huge_pages"), ("None", "Transparent", "2M"))

    def put_network_interface(self, iface_id: str, body: Any) -> None:
        validate("NetworkInterface", body)
        self._pre_boot()
        if body["iface_id"] != iface_id:
            raise Fault("The id from the path does not match the id from the body!")
        if not 0 < len(body["host_dev_name"]) <= 15:
            raise Fault(f"Could not create the network device: invalid TAP name "
                        f"{body['host_dev_name']!r}")
        if "guest_mac" in body and not _MAC_RE.fullmatch(body["guest_mac"]):
            raise Fault(f"Invalid MAC address: {body['guest_mac']}")
        for other_id, other in self.config["network-interfaces"].items():
            if other_id != iface_id and other["host_dev_name"] == body["host_dev_name"]:
                raise Fault(f"The host device name {body['host_dev_name']} is already in use.")
        self.config["network-interfaces"][iface_id] = body

    def put_vsock(self, _id: str, body: Any) -> None:
        validate("Vsock", body)
        self._pre_boot()
        if body["guest_cid"] < 3:
            raise Fault("Invalid guest CID: must be >= 3")
        self.config["vsock"] = body

    def put_entropy(self, _id: str, body: Any) -> None:
        validate("EntropyDevice", body)
        self._pre_boot()
        self.config["entropy"] = body

    def put_balloon(self, _id: str, body: Any) -> None:
        validate("Balloon", body)
        self._pre_boot()
        self.config["balloon"] = body

    def put_mmds(self, sub: str, body: Any) -> None:
        validate("MmdsConfig", body)
        self._pre_boot()
        self.config["mmds-config"] = body

    def put_logger(self, _id: str, body: Any) -> None:
        self._once("logger", validate("Logger", body))

    def put_metrics(self, _id: str, body: Any) -> None:
        self._once("metrics", validate("Metrics", body))

    def _once(self, name: str, body: dict[str, Any]) -> None:
        if name in self.config:
            raise Fault(f"Reinitialization of {name} not allowed.")
        self.config[name] = body

    # -- post-boot ---------------------------------------------------------------------------

    def patch_drive(self, drive_id: str, body: Any) -> None:
        validate("PartialDrive", body)
        self._post_boot()
        if drive_id not in self.config["drives"] or body["drive_id"] != drive_id:
            raise Fault(f"Unable to patch the block device: unknown drive {drive_id}")
        if "path_on_host" in body:
            self._file(body["path_on_host"], "block device")
            self.config["drives"][drive_id]["path_on_host"] = body["path_on_host"]

    def patch_network_interface(self, iface_id: str, body: Any) -> None:
        validate("PartialNetworkInterface", body)
        self._post_boot()
        if iface_id not in self.config["network-interfaces"]:
            raise Fault(f"Unable to patch the network device: unknown interface {iface_id}")

    def put_actions(self, _id: str, body: Any) -> None:
        validate("InstanceActionInfo", body)
        action = body["action_type"]
        _enum("action_type", action, ("FlushMetrics", "InstanceStart", "SendCtrlAltDel"))
        if action == "InstanceStart":
            self._instance_start()
        elif action == "SendCtrlAltDel":
            self._post_boot()

    def _instance_start(self) -> None:
        if self.started:
            raise Fault(PRE_BOOT_ONLY)
        if "boot-source" not in self.config:
            raise Fault("Cannot start microvm without kernel configuration.")
        if not any(d["is_root_device"] for d in self.config["drives"].values()):
            raise Fault("fcsim (strict): no root block device configured.")
        if "machine-config" not in self.config:
            raise Fault("fcsim (strict): machine-config was never set.")
        self.state = VMState.RUNNING

    def patch_vm(self, _id: str, body: Any) -> None:
        validate("Vm", body)
        _enum("state", body["state"], ("Paused", "Resumed"))
        self._post_boot()
        self.state = VMState.PAUSED if body["state"] == "Paused" else VMState.RUNNING

    # -- snapshots ---------------------------------------------------------------------------

    def put_snapshot(self, action: str, body: Any) -> None:
        if action == "create":
            self._snapshot_create(body)
        else:
            self._snapshot_load(body)

    def _snapshot_create(self, body: Any) -> None:
        validate("SnapshotCreateParams", body)
        _enum("snapshot_type", body.get("snapshot_type"), ("Full", "Diff"))
        self._post_boot()
        if self.state is not VMState.PAUSED:
            raise Fault("Cannot create a snapshot: the microVM is not paused.")
        if body.get("snapshot_type") == "Diff" and not self.track_dirty_pages:
            raise Fault("Diff snapshots are not enabled (track_dirty_pages).")
        state, memory = self._out(body["snapshot_path"]), self._out(body["mem_file_path"])
        saved = {k: v for k, v in self.config.items() if k not in ("logger", "metrics")}
        state.write_text(json.dumps({"magic": STATE_MAGIC, "firecracker_version": self.version,
                                     "config": saved}))
        mem_mib = self.config.get("machine-config", {}).get("mem_size_mib", 128)
        with open(memory, "wb") as f:  # sparse: costs only the header on disk
            f.write(MEMORY_MAGIC)
            f.truncate(mem_mib * _MIB)

    def _out(self, value: str) -> Path:
        path = self.host_path(value)
        if not path.parent.is_dir():
            raise Fault(f"Cannot create snapshot file {value}: No such file or directory")
        return path

    def _snapshot_load(self, body: Any) -> None:
        validate("SnapshotLoadParams", body)
        if self.started or self.configured:
            raise Fault("Loading a microVM snapshot not allowed after configuring "
                        "boot-specific resources.")
        if ("mem_file_path" in body) == ("mem_backend" in body):
            raise Fault("Exactly one of mem_file_path and mem_backend must be given.")
        backend = validate("MemoryBackend", body.get("mem_backend") or {
            "backend_type": "File", "backend_path": body.get("mem_file_path")})
        _enum("backend_type", backend["backend_type"], ("File", "Uffd"))
        overrides = [validate("NetworkOverride", o) for o in body.get("network_overrides", [])]
        saved = self._read_state(body["snapshot_path"])
        self._check_memory(backend, saved)
        for drive in saved["drives"].values():
            if "path_on_host" in drive:
                self._file(drive["path_on_host"], "block device", fatal=True)
        for override in overrides:
            nic = saved["network-interfaces"].get(override["iface_id"])
            if nic is None:
                raise Fault(f"Load snapshot error: unknown network interface "
                            f"{override['iface_id']}", fatal=True)
            nic["host_dev_name"] = override["host_dev_name"]
        self.config.update(saved)
        self.track_dirty_pages = bool(body.get("track_dirty_pages")
                                      or body.get("enable_diff_snapshots"))
        self.state = VMState.RUNNING if body.get("resume_vm") else VMState.PAUSED

    def _read_state(self, value: str) -> dict[str, Any]:
        path = self._file(value, "snapshot state file", fatal=True)
        try:
            data = json.loads(path.read_text())
            assert data["magic"] == STATE_MAGIC
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise Fault(f"Load snapshot error: {value} is not a microVM state file "
                        "(CRC or format mismatch)", fatal=True) from None
        if data["firecracker_version"] != self.version:
            raise Fault(f"Load snapshot error: state file version "
                        f"{data['firecracker_version']} is not supported by "
                        f"{self.version}", fatal=True)
        return data["config"]

    def _check_memory(self, backend: dict[str, str], saved: dict[str, Any]) -> None:
        path = self.host_path(backend["backend_path"])
        if backend["backend_type"] == "Uffd":
            if not path.is_socket():
                raise Fault(f"Load snapshot error: cannot connect to UFFD handler {path}",
                            fatal=True)
            return
        self._file(backend["backend_path"], "guest memory file", fatal=True)
        want = saved.get("machine-config", {}).get("mem_size_mib", 128) * _MIB
        if path.stat().st_size != want:
            raise Fault(f"Load snapshot error: memory file {path} is "
                        f"{path.stat().st_size} bytes, the snapshot needs {want}", fatal=True)


_SUBPATHS = {"mmds": ("config",), "snapshot": ("create", "load")}
_BOOT_RESOURCES = {"boot-source", "drives", "machine-config", "network-interfaces", "vsock",
                   "entropy", "balloon", "mmds"}
_Handler = Callable[[Simulator, str, Any], None]
_ROUTES: dict[tuple[str, str, int], _Handler] = {
    ("PUT", "boot-source", 1): Simulator.put_boot_source,
    ("PUT", "drives", 2): Simulator.put_drive,
    ("PATCH", "drives", 2): Simulator.patch_drive,
    ("PUT", "machine-config", 1): Simulator.put_machine_config,
    ("PATCH", "machine-config", 1): Simulator.patch_machine_config,
    ("PUT", "network-interfaces", 2): Simulator.put_network_interface,
    ("PATCH", "network-interfaces", 2): Simulator.patch_network_interface,
    ("PUT", "vsock", 1): Simulator.put_vsock,
    ("PUT", "entropy", 1): Simulator.put_entropy,
    ("PUT", "balloon", 1): Simulator.put_balloon,
    ("PUT", "mmds", 2): Simulator.put_mmds,
    ("PUT", "logger", 1): Simulator.put_logger,
    ("PUT", "metrics", 1): Simulator.put_metrics,
    ("PUT", "actions", 1): Simulator.put_actions,
    ("PATCH", "vm", 1): Simulator.patch_vm,
    ("PUT", "snapshot", 2): Simulator.put_snapshot,
}


def make_app(sim: Simulator, on_fatal: Callable[[], None]) -> web.Application:
    """The HTTP shell: every path goes to ``sim``; ``on_fatal`` runs after the
    answer to a fatal request has been written (the real process exits there)."""

    async def api(request: web.Request) -> web.StreamResponse:
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                sim.calls.append(Call(request.method, request.path, None, 400, "bad JSON"))
                return web.json_response({"fault_message": "Invalid JSON body."}, status=400)
        status, payload, fatal = sim.handle(request.method, request.path, body)
        if status == 204:
            return web.Response(status=204)
        resp = web.json_response(payload, status=status)
        if fatal:
            await resp.prepare(request)
            await resp.write_eof()
            on_fatal()
        return resp

    async def calls(_request: web.Request) -> web.Response:
        return web.json_response({"calls": [vars(c) for c in sim.calls],
                                  "state": sim.state.value})

    async def console(request: web.Request) -> web.Response:
        """Stand-in for a guest writing to its serial console: ``bytes`` of output, then
        ``marker``, from a thread (like Firecracker's vCPU thread: a full pipe blocks it,
        not the API)."""
        body = await request.json()
        threading.Thread(target=_write_console, args=(int(body["bytes"]), str(body["marker"])),
                         daemon=True).start()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/_sim/calls", calls)
    app.router.add_put("/_sim/console", console)
    app.router.add_route("*", "/{tail:.*}", api)
    return app


def _write_console(size: int, marker: str) -> None:
    line = b"guest console flood " + b"x" * 43 + b"\n"  # 64 bytes
    out = sys.stdout.buffer
    for _ in range(size // len(line)):
        out.write(line)
    out.write(f"{marker}\n".encode())
    out.flush()
