"""The values stored under gateway.cluster.keys: frozen dataclasses <-> bounded JSON.

A record that fails to parse is a ``ProtocolError`` (someone else's bug or a newer
version's record), never a crash deep in the caller.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from gateway.cluster.errors import ProtocolError
from gateway.cluster.keys import check_host_name, check_sandbox_id
from gateway.sandbox.states import State

MAX_RECORD_BYTES = 16 << 10
MAX_BASES = 64  # goldens a host publishes (64 ids of 64 hex digits: 4.3 KiB of its record)
MAX_REASON = 1024
_BASE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class HostRecord:
    """A live host and what it has free, published on its lease (placement reads it)."""

    name: str
    address: str  # where other hosts reach this host's gateway: HOST:PORT
    total_mib: int = 0
    free_mib: int = 0
    total_vcpus: int = 0
    free_vcpus: int = 0
    awake: int = 0  # sandboxes running or paused (holding RAM)
    # The base images (goldens) it holds, by identity (gateway.sandbox.shipped.base_identity):
    # a suspended sandbox's snapshot stands on one, so only a host holding it can adopt it.
    bases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_host_name(self.name)
        if not isinstance(self.address, str) or not self.address or len(self.address) > 255:
            raise ValueError("address must be a non-empty HOST:PORT")
        for name in ("total_mib", "free_mib", "total_vcpus", "free_vcpus", "awake"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
        if not isinstance(self.bases, (list, tuple)) or len(self.bases) > MAX_BASES or \
                not all(isinstance(b, str) and _BASE.fullmatch(b) for b in self.bases):
            raise ValueError(f"bases must be at most {MAX_BASES} SHA256 hex digests")
        object.__setattr__(self, "bases", tuple(sorted(set(self.bases))))

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> HostRecord:
        return _decode(cls, raw)


@dataclass(frozen=True)
class SandboxRecord:
    """Who owns a sandbox. ``gen`` goes up by one every time it changes hands: a write
    conditioned on an older generation (or mod revision) fails, which fences a stale owner."""

    id: str
    host: str
    state: State
    gen: int = 1
    snapshot: str = ""  # where its suspended files are (object store URL), "" = local only
    # Named with the snapshot (gateway.cluster.shipper), so the reaper places it without
    # reading the object store: the base its disk and memory stand on ("" = unknown: a
    # record from before bases), and its shape (0 = unknown).
    base: str = ""
    vcpus: int = 0
    memory_mib: int = 0
    disk_mib: int = 0
    reason: str = ""  # why it is FAILED (the reaper's or an adoption's words), "" = none
    # Whose it is and what of (the publisher names them at create): a host the reaper
    # gives a sandbox that shipped nothing registers it from these alone (FAILED, so
    # its owner can see why and delete it). "" = unknown (a record from before them).
    tenant: str = ""
    template: str = ""
    snapshot_at: float = 0.0  # when the shipped snapshot was made (unix time), 0 = unknown

    def __post_init__(self) -> None:
        check_sandbox_id(self.id)
        check_host_name(self.host)
        if not isinstance(self.state, State):
            object.__setattr__(self, "state", State(self.state))
        if not isinstance(self.gen, int) or isinstance(self.gen, bool) or self.gen < 1:
            raise ValueError(f"gen must be an integer >= 1, not {self.gen!r}")
        if not isinstance(self.snapshot, str) or len(self.snapshot) > 2048:
            raise ValueError("snapshot must be a string of at most 2048 characters")
        if not isinstance(self.base, str) or (self.base and not _BASE.fullmatch(self.base)):
            raise ValueError("base must be a SHA256 hex digest or empty")
        for name in ("tenant", "template"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 128:
                raise ValueError(f"{name} must be a string of at most 128 characters")
        if not isinstance(self.snapshot_at, (int, float)) or isinstance(self.snapshot_at, bool) \
                or not 0 <= self.snapshot_at < 1e11:
            raise ValueError(f"snapshot_at must be a unix time, not {self.snapshot_at!r}")
        if not isinstance(self.reason, str) or len(self.reason) > MAX_REASON:
            raise ValueError(f"reason must be a string of at most {MAX_REASON} characters")
        for name in ("vcpus", "memory_mib", "disk_mib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, not {value!r}")

    def moved_to(self, host: str, state: State) -> SandboxRecord:
        return replace(self, host=host, state=state, gen=self.gen + 1)

    def encode(self) -> bytes:
        return json.dumps({**asdict(self), "state": self.state.value}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SandboxRecord:
        return _decode(cls, raw)


START_STATES = frozenset({"none", "starting", "started", "failed"})
MAX_START_CHARS = 8192


@dataclass(frozen=True)
class SessionRecord:
    """Who holds a session name in the fleet (``{prefix}/sessions/{name}``): the tenant, the
    host that reserved it (its registry holds the session's row) and the session's sandbox
    ("" while it is being made, or before the host bound it). ``port``, ``start`` and the
    start's recorded state are what a host the sandbox moves to needs to take the session
    over (gateway.cluster.session_takeover): the row it inserts is made from them."""

    name: str
    tenant: str
    host: str
    sandbox_id: str = ""
    port: int = 8000
    start: str | None = None
    start_state: str = "none"
    start_pid: int | None = None

    def __post_init__(self) -> None:
        check_host_name(self.name)
        check_host_name(self.host)
        if not isinstance(self.tenant, str) or not 0 < len(self.tenant) <= 128:
            raise ValueError("tenant must be a string of 1-128 characters")
        if not isinstance(self.sandbox_id, str):
            raise ValueError("sandbox_id must be a string")
        if self.sandbox_id:
            check_sandbox_id(self.sandbox_id)
        if type(self.port) is not int or not 0 < self.port < 65536:
            raise ValueError("port must be an integer in 1-65535")
        if self.start is not None and (not isinstance(self.start, str)
                                       or len(self.start) > MAX_START_CHARS):
            raise ValueError(f"start must be a string of at most {MAX_START_CHARS} characters")
        if self.start_state not in START_STATES:
            raise ValueError(f"start_state must be one of {sorted(START_STATES)}")
        if self.start_pid is not None and (type(self.start_pid) is not int
                                           or self.start_pid < 0):
            raise ValueError("start_pid must be a non-negative integer")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SessionRecord:
        return _decode(cls, raw)


def _decode(cls: Any, raw: bytes) -> Any:
    if len(raw) > MAX_RECORD_BYTES:
        raise ProtocolError(f"{cls.__name__} over {MAX_RECORD_BYTES} bytes")
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise TypeError("not an object")
        return cls(**data)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from exc
