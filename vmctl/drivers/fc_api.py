"""A small client for Firecracker's REST API (HTTP/1.1 over its Unix socket).

The API is request/response only: every configuring call answers ``204`` on
success and ``400 {"fault_message": ...}`` when Firecracker refuses it; ``GET``
calls answer ``200`` with JSON. This module maps that, and every transport
failure, into vmctl's errors at this one edge:

- a refusal (any non-2xx with a body)   -> ``FirecrackerFault`` (a VMProtocolError)
- socket missing / refused / dropped    -> VMGoneError (the process is not there)
- no answer in time                     -> VMTimeoutError

One ``aiohttp.ClientSession`` over a ``UnixConnector`` per VMM; ``aclose()`` is
idempotent and must be called by the owner (the driver does it in ``_quit``).

The request bodies the driver sends are built here too, by pure functions
(checked field by field against the swagger of the pinned release), so tests
can compare them with what the simulator records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import aiohttp

from vmctl.errors import SnapshotError, VMGoneError, VMProtocolError, VMTimeoutError
from vmctl.spec import VMSpec

# Firecracker ignores the host part, but HTTP/1.1 needs one.
_BASE = "http://localhost"
_VERSION_RE = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")
NETWORK_OVERRIDES_SINCE = (1, 12)
ROOT_DRIVE_ID, ROOT_DRIVE_PATH = "rootfs", "rootfs"  # relative: see firecracker.py
IFACE_ID = "eth0"


class FirecrackerFault(VMProtocolError):
    """Firecracker answered a request with an error (``fault_message``)."""

    def __init__(self, method: str, path: str, status: int, fault_message: str) -> None:
        super().__init__(f"firecracker {method} {path} -> {status}: {fault_message}")
        self.method, self.path = method, path
        self.status, self.fault_message = status, fault_message


class FirecrackerAPI:
    """Client for one Firecracker API socket."""

    def __init__(self, socket_path: Path, timeout: float = 30.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"<FirecrackerAPI {self.socket_path} open={self._session is not None}>"

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                      timeout: float | None = None) -> Any:
        """Send one request; return the decoded JSON body (None for 204)."""
        session = self._ensure_session()
        data = None if body is None else json.dumps(body)
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        limit = aiohttp.ClientTimeout(total=timeout or self.timeout)
        try:
            async with session.request(method, _BASE + path, data=data, headers=headers,
                                       timeout=limit) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError as exc:
            raise VMTimeoutError(f"firecracker {method} {path}: no answer in time") from exc
        except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionError) as exc:
            raise VMGoneError(f"firecracker {method} {path}: API socket unavailable "
                              f"({exc.__class__.__name__}: {exc})") from exc
        except aiohttp.ClientError as exc:
            raise VMProtocolError(f"firecracker {method} {path}: {exc}") from exc
        return _decode(method, path, status, raw)

    async def get(self, path: str, timeout: float | None = None) -> Any:
        return await self.request("GET", path, timeout=timeout)

    async def put(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return await self.request("PUT", path, body, timeout=timeout)

    async def patch(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return await self.request("PATCH", path, body, timeout=timeout)

    async def wait_ready(self, timeout: float,
                         alive: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Poll ``GET /`` until the API answers; ``alive()`` False aborts early (VMGoneError)."""
        deadline = time.monotonic() + timeout
        while True:
            if alive is not None and not alive():
                raise VMGoneError("firecracker exited before its API came up")
            if self.socket_path.exists():
                with contextlib.suppress(VMGoneError):
                    return await self.get("/", timeout=max(0.5, deadline - time.monotonic()))
            if time.monotonic() > deadline:
                raise VMTimeoutError(f"firecracker API {self.socket_path} not ready "
                                     f"after {timeout}s")
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # force_close: Firecracker serves one connection at a time; a kept-alive
            # idle connection from us must not be what a second client waits behind.
            connector = aiohttp.UnixConnector(path=str(self.socket_path), force_close=True)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session


def _decode(method: str, path: str, status: int, raw: bytes) -> Any:
    payload: Any = None
    if raw:
        try:
            payload = json.loads(raw)
        except ValueError as exc:
            raise VMProtocolError(f"firecracker {method} {path} -> {status}: "
                                  f"not JSON: {raw[:200]!r}") from exc
    if 200 <= status < 300:
        return payload
    message = payload.get("fault_message") if isinstance(payload, dict) else None
    raise FirecrackerFault(method, path, status, str(message or payload or "(no body)"))


def parse_version(text: str) -> str:
    """``Firecracker v1.16.1`` (first line of ``--version``) -> ``1.16.1``."""
    match = _VERSION_RE.search(text.strip().splitlines()[0] if text.strip() else "")
    if match is None:
        raise ValueError(f"no version in {text[:80]!r}")
    return ".".join(match.groups())


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in parse_version(version).split("."))


# -- request bodies (pure) ---------------------------------------------------------------------


def boot_args(cmdline: str) -> str:
    """spec.cmdline plus what a Firecracker guest needs: a serial console, and a
    reboot or panic that ends the VMM instead of hanging it."""
    args = cmdline.split()
    if not any(a.startswith("console=") for a in args):
        args.insert(0, "console=ttyS0")
    if not any(a.startswith("reboot=") for a in args):
        args.append("reboot=k")
    if not any(a.startswith("panic=") for a in args):
        args.append("panic=1")
    return " ".join(args)


def boot_requests(spec: VMSpec, kernel: str, initrd: str | None,
                  network: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """The API calls that configure and start a fresh VM, in order."""
    source: dict[str, Any] = {"kernel_image_path": kernel, "boot_args": boot_args(spec.cmdline)}
    if initrd is not None:
        source["initrd_path"] = initrd
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("PUT", "/boot-source", source),
        ("PUT", f"/drives/{ROOT_DRIVE_ID}", {
            "drive_id": ROOT_DRIVE_ID, "is_root_device": True, "is_read_only": False,
            "path_on_host": ROOT_DRIVE_PATH}),
        ("PUT", "/machine-config", {"vcpu_count": spec.vcpus, "mem_size_mib": spec.mem_mib,
                                    "smt": False}),
    ]
    if network:
        calls.append(("PUT", f"/network-interfaces/{IFACE_ID}", {
            "iface_id": IFACE_ID, "host_dev_name": spec.tap, "guest_mac": spec.mac}))
    calls.append(("PUT", "/entropy", {}))
    calls.append(("PUT", "/actions", {"action_type": "InstanceStart"}))
    return calls


def snapshot_load_body(state: str, memory: str, tap_override: str | None,
                       version: str) -> dict[str, Any]:
    """``PUT /snapshot/load``: File memory backend, resume at once; the NIC moves to
    ``tap_override`` when given (needs ``network_overrides``, Firecracker 1.12+)."""
    body: dict[str, Any] = {"snapshot_path": state,
                            "mem_backend": {"backend_type": "File", "backend_path": memory},
                            "resume_vm": True}
    if tap_override is not None:
        if version_tuple(version)[:2] < NETWORK_OVERRIDES_SINCE:
            raise SnapshotError(f"Firecracker {version} cannot move a restored NIC to "
                                f"TAP {tap_override!r} (network_overrides needs 1.12+)")
        body["network_overrides"] = [{"iface_id": IFACE_ID, "host_dev_name": tap_override}]
    return body
